# The simulator's predictions in the report: where every simulated study's step times came from
# and, on a measured run (emulator, vllm, external), the simulator beside the measurement.
from servematrix.reporting.steptimes import write_step_times


rule step_time_sources:
    input:
        get_simulated_traces,
    output:
        md="results/simulator/step_times/{study}.md",
        html=report(
            "results/simulator/step_times/{study}.html",
            caption="../report/step_times.rst",
            category="{study}",
            subcategory="Findings",
            labels={"study": "{study}", "item": "step-time sources"},
        ),
    log:
        "results/simulator/logs/step_times/{study}.log",
    params:
        title=get_study_title,
    run:
        with in_process_job(log[0]):
            write_step_times(list(input), params.title, output.md, output.html)


if PREDICTED is not None:

    rule compare:
        input:
            predicted="results/simulator/summary/{study}.parquet",
            measured=f"results/{RUN_CONFIG.backend}/summary/{{study}}.parquet",
        output:
            parquet=f"results/{RUN_CONFIG.backend}/compare/{{study}}/ratios.parquet",
            csv=f"results/{RUN_CONFIG.backend}/compare/{{study}}/ratios.csv",
            html=report(
                f"results/{RUN_CONFIG.backend}/compare/{{study}}/ratios.html",
                caption="../report/compare_ratios.rst",
                category="{study}",
                subcategory="Predicted vs measured",
                labels={"study": "{study}", "item": "ratio table"},
            ),
            **{
                figure: report(
                    f"results/{RUN_CONFIG.backend}/compare/{{study}}/{figure}.svg",
                    caption="../report/compare_figures.rst",
                    category="{study}",
                    subcategory="Predicted vs measured",
                    labels={"study": "{study}", "item": figure},
                )
                for figure in COMPARED_FIGURES
            },
            **{
                f"{figure}_html": f"results/{RUN_CONFIG.backend}/compare/{{study}}/{figure}.html"
                for figure in COMPARED_FIGURES
            },
        log:
            f"results/{RUN_CONFIG.backend}/logs/compare/{{study}}.log",
        params:
            title=get_study_title,
            x=get_study_x,
            confirmed=get_study_confirms,
        script:
            "../scripts/compare.py"
