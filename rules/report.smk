# Findings: the study's comparisons as sentences with their numbers, for the report.


rule findings:
    input:
        "results/{backend}/summary/{study}.parquet",
    output:
        md="results/{backend}/findings/{study}.md",
        html=report(
            "results/{backend}/findings/{study}.html",
            caption="../report/findings.rst",
            category="{study}",
            subcategory="Findings",
            labels={"study": "{study}", "item": "findings"},
        ),
    log:
        "results/{backend}/logs/findings/{study}.log",
    params:
        title=get_study_title,
        x=get_study_x,
    script:
        "../scripts/findings.py"
