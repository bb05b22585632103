# Snakemake adapter: turn a study's summary into findings (Markdown and HTML).
import polars as pl

from servematrix.files import write_text
from servematrix.findings import study_findings, to_html, to_markdown
from servematrix.workflow import log_to

log_to(snakemake.log[0])
findings = study_findings(
    pl.read_parquet(snakemake.input[0]), snakemake.params.title, snakemake.params.x
)
write_text(snakemake.output.md, to_markdown(findings))
write_text(snakemake.output.html, to_html(findings))
