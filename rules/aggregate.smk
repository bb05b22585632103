# One summary row per cell, per study: Parquet for machines, CSV for spreadsheets, HTML for the report.


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
    script:
        "../scripts/summarize.py"
