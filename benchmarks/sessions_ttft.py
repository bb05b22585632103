"""Multi-turn sessions on the simulator: first-turn and later-turn TTFT, prefix caching off and on.

16 users x 6 turns, 512 new tokens and 128 output tokens per turn, exponential think time of
mean 2 s, all first turns at t = 0; Qwen2.5-7B bf16, recipe ``v1``, on A100s (``single``: one
instance, ``nondisagg``: two behind the round-robin proxy), one seed. Each user's turns are one
prefix chain, so with caching on a later turn finds its history cached. Prints the table the
docs/configuration.md's "Multi-turn sessions" section quotes (a few seconds)::

    .venv/bin/python benchmarks/sessions_ttft.py
"""

from __future__ import annotations

import numpy as np

from servematrix.simulate import simulate
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload
from servematrix.workload.sessions import Sessions

USERS, TURNS = 16, 6
MODEL = ModelSpec("Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", "bf16", 1, ((0,), (1,)))


def turn_ttfts_ms(mode: str, prefix_caching: bool) -> tuple[float, float]:
    """Mean TTFT of the first turns and of the later ones."""
    workload = Workload(
        qps=float("inf"),
        input_len=512,
        output_len=128,
        num_prompts=USERS * TURNS,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
        sessions=Sessions(users=USERS, turns=TURNS, think_time_s=2.0),
    )
    cell = Cell(
        backend="simulator",
        recipe="v1",
        model=MODEL,
        mode=MODES[mode],
        workload=workload,
        serving=Serving(10_000, 0.9, prefix_caching=prefix_caching),
        engine={"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0},
    )
    measured = sorted(
        (r for r in simulate(cell).records if not r.warmup), key=lambda r: r.request_id
    )
    ttft = [(r.first_token_s - r.sent_s) * 1e3 for r in measured]
    return float(np.mean(ttft[:USERS])), float(np.mean(ttft[USERS:]))  # turn-major numbering


def main() -> None:
    print("| mode | prefix caching | turn 1 mean TTFT (ms) | turns 2-6 mean TTFT (ms) |")
    print("|---|---|---:|---:|")
    for mode in ("single", "nondisagg"):
        for caching in (False, True):
            first, later = turn_ttfts_ms(mode, caching)
            print(f"| {mode} | {'on' if caching else 'off'} | {first:.1f} | {later:.1f} |")


if __name__ == "__main__":
    main()
