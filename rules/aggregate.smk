# One summary row per cell, per study: Parquet for machines, CSV for spreadsheets, HTML for the report.
# Inside Snakemake, as the simulated cells (servematrix.workflow.in_process_job): a new process
# would spend more on its imports than the summary takes.
from servematrix.results.aggregate import summarize, write_summary


rule summarize:
    input:
        get_study_traces,
    output:
        parquet="results/{backend}/summary/{study}.parquet",
        csv="results/{backend}/summary/{study}.csv",
        html=report(
            "results/{backend}/summary/{study}.html",
            caption="../report/summary.rst",
            category="{study}",
            subcategory="Tables",
            labels={"study": "{study}", "item": "summary table", "backend": "{backend}"},
        ),
    log:
        "results/{backend}/logs/summary/{study}.log",
    params:
        slo_ms=get_slo_ms,
        title=get_study_title,
    run:
        with in_process_job(log[0]):
            summary = summarize(list(input), slo_ms=params.slo_ms)
            write_summary(summary, output.parquet, output.csv, output.html, title=params.title)
