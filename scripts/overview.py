# Snakemake adapter: the report's front page (every study's answer and its two charts).
import polars as pl

from servematrix.files import write_text
from servematrix.findings.render import recommendation_of
from servematrix.overview import StudyPage, capacity_chart, overview_html, pareto_chart
from servematrix.workflow import log_to

log_to(snakemake.log[0])
pages = []
for name, title, summary, capacity, recommendation in zip(
    snakemake.params.names,
    snakemake.params.titles,
    snakemake.input.summaries,
    snakemake.input.capacity,
    snakemake.input.recommendations,
    strict=True,
):
    table = pl.read_parquet(capacity)
    pages.append(
        StudyPage(
            name,
            title,
            recommendation_of(recommendation),
            capacity_chart(table, title),
            pareto_chart(pl.read_parquet(summary), table, title),
        )
    )
write_text(snakemake.output[0], overview_html(pages, "servematrix: what to run at the SLO"))
