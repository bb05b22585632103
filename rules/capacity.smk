# Capacity at the SLO: per deployment (model × mode × recipe × workload), the highest request
# rate sustained within the SLO, found by search; every probe is a steady-state cell at its
# usual trace path (servematrix.capacity.run). A measured run starts each search from the
# simulator's capacity for the same deployment, after the study's own cells (one deployment on
# the GPUs at a time). The simulator's searches, seconds of CPU each, run in Snakemake's
# worker processes, one per core (servematrix.workflow.worker_job).
from servematrix.capacity.confirm import write_candidates
from servematrix.capacity.run import capacity_job, write_study_table
from servematrix.workflow import worker_job


rule simulate_capacity:
    input:
        get_engine_profile,
    output:
        "results/{backend}/capacity/{recipe}/{model}/{mode}/{deployment}.json",
    log:
        "results/{backend}/logs/capacity/{recipe}/{model}/{mode}/{deployment}.log",
    params:
        cells=get_deployment_cells,
        slo=get_slo,
        settings=get_capacity_settings,
    wildcard_constraints:
        backend=SIMULATED_BACKENDS,
    # The search runs in a worker process (servematrix.workflow.worker_job, one per core): the
    # thread that waits for it takes no core from Snakemake's count, so the cells and charts
    # go on beside the searches.
    threads: 0
    run:
        worker_job(log[0], capacity_job, params.cells, params.slo, params.settings, [], output[0])


rule capacity:
    input:
        traces=get_deployment_traces,
        simulated=get_simulated_capacity,
        profile=get_engine_profile,
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


# The split question confirmed (`confirm_top`): the simulator twin's capacity table of the study
# picks the topologies the measured backend deploys. A checkpoint: the study's measured cells
# and searches (rules/common.smk, `study_cells`) are known only once it has run.
if PREDICTED is not None:

    checkpoint confirm_candidates:
        input:
            f"results/{PREDICTED.backend}/capacity/{{study}}.parquet",
        output:
            "results/{backend}/confirm/{study}.json",
        log:
            "results/{backend}/logs/confirm/{study}.log",
        params:
            top=get_confirm_top,
        wildcard_constraints:
            backend=MEASURED_BACKENDS,
        run:
            with in_process_job(log[0]):
                write_candidates(input[0], params.top, output[0])
