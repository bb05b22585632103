"""Real vLLM CPU: does a profile's scaling to a larger model of the family hold its terms?

``calibration_cpu.py`` predicts ``small-qwen2`` (twice the layers and the MLP of ``tiny-qwen2``)
from the tiny model's profile, each term scaled by what it is taken to cost
(``engine.profile.scaled_terms``: a step's fixed part by weight bytes, a prefilled token by
linear-layer parameters, a KV token read by KV bytes, a sequence by the LM head). This script
fits both models' own profiles on the same deployment arrangement (mode ``single``, engine on
core 0, API server and client on core 1), in the order tiny, small, tiny, so the two tiny fits
bracket the small one and show how far the machine moved meanwhile. Per term it prints the
three fits, the measured small/tiny ratio (against the mean of the tiny fits) and the ratio the
scaling assumes.

Usage (from the repository root, in a private network namespace; about 5 minutes)::

    unshare -n bash -c 'ip link set lo up; .venv/bin/python benchmarks/calibration_cpu_scaling.py'
"""

from __future__ import annotations

import argparse
import os

from calibration_cpu import FIT_MODEL, LARGER_MODEL, calibrate, scratch, served

from servematrix.engine.architecture import load_architecture
from servematrix.engine.profile import TERMS, read_profile, scaled_terms
from servematrix.vllmcpu import env

ORDER = (FIT_MODEL, LARGER_MODEL, FIT_MODEL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="calibrate's runs per probe")
    args = parser.parse_args()
    work = scratch("calibration-cpu-scaling-", (FIT_MODEL, LARGER_MODEL))
    print(f"work directory {work}; load average {os.getloadavg()}", flush=True)
    paths = []
    for index, model in enumerate(ORDER):
        path = work / f"{index}-{model}.yaml"
        with served(model, "single", work) as plan:
            calibrate(plan.base_url, model, path, args.repeats)
        paths.append(path)
        print(f"fitted {model}: load average {os.getloadavg()}", flush=True)
    tiny = [read_profile(paths[0]), read_profile(paths[2])]
    small = read_profile(paths[1])
    rule, note = scaled_terms(tiny[0], load_architecture(str(env.model_dir(name=LARGER_MODEL))), "")
    print(f"\nscaling: {note}")
    header = ("term", "tiny", "small", "tiny again", "measured", "scaling")
    print(f"{header[0]:<22} " + " ".join(f"{h:>10}" for h in header[1:]))
    for k, name in enumerate(TERMS):
        t0, t1 = (p.terms.vector()[k] for p in tiny)
        s, base = small.terms.vector()[k], tiny[0].terms.vector()[k]
        mean = (t0 + t1) / 2
        measured = f"{s / mean:10.2f}" if mean else f"{'-':>10}"
        assumed = f"{rule.vector()[k] / base:10.2f}" if base else f"{'-':>10}"
        print(f"{name:<22} {t0:10.4g} {s:10.4g} {t1:10.4g} {measured} {assumed}")
    for label, profile in zip(ORDER, (tiny[0], small, tiny[1]), strict=True):
        api = profile.api_server_cpu
        if api is not None:
            print(
                f"API server CPU ({label}): {api.per_request_s * 1e3:.2f} ms a request, "
                f"{api.per_output_token_s * 1e3:.3f} ms a token, "
                f"{api.per_step_s * 1e3:.2f} ms a step"
            )


if __name__ == "__main__":
    main()
