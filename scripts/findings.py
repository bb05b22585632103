# Snakemake adapter: turn a study's summary and capacity table into findings (Markdown, HTML).
import polars as pl

from servematrix import steptimes, trace
from servematrix.files import write_text
from servematrix.findings import Context, study_findings, to_html, to_markdown
from servematrix.findings.recommend import caveat
from servematrix.overview import recommendation_json
from servematrix.workflow import log_to

log_to(snakemake.log[0])
summary = pl.read_parquet(snakemake.input.summary)
capacity = pl.read_parquet(snakemake.input.capacity[0]) if snakemake.input.capacity else None
step_times = []
if snakemake.params.backend == "simulator" and not summary.is_empty():
    try:
        cells = [steptimes.cell_step_times(path) for path in summary["trace"]]
        step_times = steptimes.step_time_sentences(steptimes.group_setups(cells))
    except trace.TraceError:  # a trace from before step-time sources were recorded
        step_times = []
context = Context(
    snakemake.params.slo, caveat(snakemake.params.backend, snakemake.params.gpu, step_times)
)
findings = study_findings(summary, snakemake.params.title, snakemake.params.x, capacity, context)
write_text(snakemake.output.md, to_markdown(findings))
write_text(snakemake.output.html, to_html(findings))
write_text(snakemake.output.json, recommendation_json(findings))
