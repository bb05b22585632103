# One job per cell: deploy (or simulate), drive the workload, write one Parquet trace.


rule cell:
    output:
        f"results/{{backend}}/cells/{CELL_PATTERN}.parquet",
    log:
        f"results/{{backend}}/logs/{CELL_PATTERN}.log",
    params:
        cell=get_cell,
    script:
        "../scripts/run_cell.py"
