# The published study's figures: TTFT, TPOT and ITL (mean, median, P99), throughput and memory
# (peak GPU memory, peak KV-cache usage) against x.


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
    script:
        "../scripts/figures.py"
