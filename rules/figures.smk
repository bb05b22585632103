# The published study's figures: TTFT, TPOT and ITL (mean, median, P99), throughput and memory
# (peak GPU memory, peak KV-cache usage) against x. Charts render in Snakemake's worker processes
# (servematrix.workflow.worker_job, as the simulator's capacity searches), which imported altair
# once: a job of its own process would spend more on its start and imports (~1.5 s) than on the
# study's charts, and in Snakemake's own process they would take turns with the cells and
# summaries (benchmarks/workflow_speed.py).
from servematrix.reporting.figures import write_study_figures
from servematrix.workflow import worker_job


rule figures:
    input:
        "results/{backend}/summary/{study}.parquet",
    output:
        **{
            figure: report(
                f"results/{{backend}}/figures/{{study}}/{figure}.svg",
                caption=f"../report/{figure}.rst",
                category="{study}",
                subcategory="Figures",
                labels={"study": "{study}", "item": figure},
            )
            for figure in FIGURES
        },
        **{
            f"{figure}_html": f"results/{{backend}}/figures/{{study}}/{figure}.html"
            for figure in FIGURES
        },
    log:
        "results/{backend}/logs/figures/{study}.log",
    params:
        title=get_study_title,
        x=get_study_x,
    threads: 0
    run:
        worker_job(
            log[0], write_study_figures, input[0], params.title, params.x, Path(output.ttft).parent
        )
