# A step-time profile fitted on a server already running (the config's `calibration:`), written
# where `engine.profile` names it; every simulated or emulated cell, and a measured run's
# simulator twin, takes it as an input (rules/common.smk, get_engine_profile).


if CALIBRATION:

    rule calibrate:
        output:
            ENGINE_PROFILE,
        log:
            "results/logs/calibrate.log",
        params:
            python=sys.executable,
            args=get_calibrate_args,
        shell:
            "{params.python} -m servematrix.cli calibrate {params.args} --out {output} > {log} 2>&1"
