# Capacity at the SLO: per deployment (model × mode × recipe × workload), the highest request
# rate meeting the SLO, found by search; every probe is a cell at its usual trace path. A
# measured run starts each search from the simulator's capacity for the same deployment. The
# simulator's searches run inside Snakemake, as its cells do (rules/cells.smk).
from servematrix.capacity_run import capacity_job, write_study_table


rule simulate_capacity:
    input:
        traces=get_deployment_traces,
    output:
        "results/{backend}/capacity/{recipe}/{model}/{mode}/{deployment}.json",
    log:
        "results/{backend}/logs/capacity/{recipe}/{model}/{mode}/{deployment}.log",
    params:
        cells=get_deployment_cells,
        slo=get_slo,
        settings=get_capacity_settings,
    wildcard_constraints:
        backend=matrix.PREDICTING_BACKEND,
    run:
        with in_process_job(log[0]):
            capacity_job(params.cells, params.slo, params.settings, [], output[0])


rule capacity:
    input:
        traces=get_deployment_traces,
        simulated=get_simulated_capacity,
    output:
        "results/{backend}/capacity/{recipe}/{model}/{mode}/{deployment}.json",
    log:
        "results/{backend}/logs/capacity/{recipe}/{model}/{mode}/{deployment}.log",
    params:
        cells=get_deployment_cells,
        slo=get_slo,
        settings=get_capacity_settings,
    wildcard_constraints:
        backend=MEASURED_BACKENDS,
    script:
        "../scripts/capacity.py"


rule capacity_table:
    input:
        get_study_deployments,
    output:
        parquet="results/{backend}/capacity/{study}.parquet",
        csv="results/{backend}/capacity/{study}.csv",
        html=report(
            "results/{backend}/capacity/{study}.html",
            caption="../report/capacity_table.rst",
            category="{study}",
            subcategory="Tables",
            labels={"study": "{study}", "item": "capacity table", "backend": "{backend}"},
        ),
    log:
        "results/{backend}/logs/capacity/{study}.log",
    params:
        title=get_study_title,
    run:
        with in_process_job(log[0]):
            write_study_table(input, params.title, output.parquet, output.csv, output.html)
