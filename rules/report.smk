# Findings: the answer at the SLO first, then the study's comparisons as tables and sentences.


rule findings:
    input:
        summary="results/{backend}/summary/{study}.parquet",
        capacity=get_findings_capacity,
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
        slo=get_slo_description,
        gpu=get_engine_gpu,
        backend=get_backend,
    script:
        "../scripts/findings.py"
