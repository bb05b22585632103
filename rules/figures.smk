# The published study's figures: TTFT, TPOT and ITL (mean, median, P99), throughput and memory
# (peak GPU memory, peak KV-cache usage) against x. Charts render inside Snakemake, as the
# summaries do (rules/aggregate.smk): a job of its own process would spend more on its start and
# imports (~1.5 s) than on the study's charts.
from servematrix.reporting.figures import write_study_figures


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
    run:
        with in_process_job(log[0]):
            write_study_figures(input[0], params.title, params.x, Path(output.ttft).parent)
