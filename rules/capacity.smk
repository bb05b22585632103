# Capacity at the SLO: per deployment (model × mode × recipe × workload), the highest request
# rate meeting the SLO, found by search; every probe is a cell at its usual trace path. A
# measured run starts each search from the simulator's capacity for the same deployment.


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
    script:
        "../scripts/capacity_table.py"
