# Findings: the answer at the SLO first, then the study's comparisons as tables and sentences;
# the answer's charts; the front page. All inside Snakemake, as the summaries.
from servematrix.reporting.findings import write_findings
from servematrix.reporting.overview import StudyInputs, write_answer_figures, write_overview


rule findings:
    input:
        summary="results/{backend}/summary/{study}.parquet",
        capacity=get_findings_capacity,
        candidates=get_confirm_candidates,
    output:
        md="results/{backend}/findings/{study}.md",
        json="results/{backend}/findings/{study}.json",
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
        question=get_study_question,
        slo=get_slo_description,
        gpu=get_engine_gpu,
        profile=get_engine_profile_name,
        backend=get_backend,
    run:
        with in_process_job(log[0]):
            write_findings(
                input.summary,
                input.capacity,
                dict(params.items()),
                dict(output.items()),
                input.candidates,
            )


# The front page: every study's recommendation, capacity chart and Pareto chart.


rule answer_figures:
    input:
        summary="results/{backend}/summary/{study}.parquet",
        capacity="results/{backend}/capacity/{study}.parquet",
    output:
        capacity=report(
            "results/{backend}/figures/{study}/capacity.svg",
            caption="../report/capacity.rst",
            category="{study}",
            subcategory="Figures",
            labels={"study": "{study}", "item": "capacity"},
        ),
        pareto=report(
            "results/{backend}/figures/{study}/pareto.svg",
            caption="../report/pareto.rst",
            category="{study}",
            subcategory="Figures",
            labels={"study": "{study}", "item": "pareto"},
        ),
        capacity_html="results/{backend}/figures/{study}/capacity.html",
        pareto_html="results/{backend}/figures/{study}/pareto.html",
    log:
        "results/{backend}/logs/figures/{study}-answer.log",
    params:
        title=get_study_title,
        question=get_study_question,
    run:
        with in_process_job(log[0]):
            write_answer_figures(
                input.summary,
                input.capacity,
                params.title,
                Path(output.capacity).parent,
                params.question,
            )


rule overview:
    input:
        summaries=get_overview_inputs("summary", "parquet"),
        capacity=get_overview_inputs("capacity", "parquet"),
        recommendations=get_overview_inputs("findings", "json"),
    output:
        report(
            "results/{backend}/overview.html",
            caption="../report/overview.rst",
            category="Overview",
            labels={"item": "recommendations, capacity and Pareto charts"},
        ),
    log:
        "results/{backend}/logs/overview.log",
    params:
        names=list(STUDIES),
        titles=[study.title for study in STUDIES.values()],
        questions=[study.question for study in STUDIES.values()],
    run:
        with in_process_job(log[0]):
            write_overview(
                StudyInputs(params.names, params.titles, params.questions),
                input.summaries,
                input.capacity,
                input.recommendations,
                output[0],
            )
