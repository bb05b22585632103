"""Multi-turn sessions: the plan, prompts carrying the history, dependent sends on the
simulator and on the real emulator, and a bad sessions config refused in one line."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from servematrix.simulate import simulate
from servematrix.spec.config import load_file
from servematrix.spec.matrix import ConfigError
from servematrix.workload import build_requests, session_plan, sessions

BIN = Path(sys.executable).parent
CONFIG = """\
backend: simulator
defaults:
  output_len: 8
models:
  llama-1b:
    hf_id: meta-llama/Llama-3.2-1B-Instruct
    architecture: config/examples/my-model/config.json
    quantization: bf16
    tensor_parallel: 1
    gpus: [[0], [1]]
studies:
  chat:
    recipe: v1
    models: [llama-1b]
    modes: [{modes}]
    qps: [.inf]
    input_len: [256]
    workload:
      sessions: {sessions}
"""


def config_file(tmp_path: Path, modes: str = "single", sessions_yaml: str = "") -> Path:
    path = tmp_path / "sessions.yaml"
    spec = sessions_yaml or "{users: 2, turns: 3, think_time_s: 0.5}"
    path.write_text(CONFIG.format(modes=modes, sessions=spec))
    return path


def cell(tmp_path: Path, modes: str = "single"):
    return next(iter(load_file(config_file(tmp_path, modes)).studies.values())).cells[0]


def test_plan_is_turn_major_and_counts_the_history():
    spec = sessions.Sessions(users=3, turns=4, min_turns=2, think_time_s=1.0)
    turns = sessions.plan(spec, 100, 10, 0.2, seed=7)
    assert turns == sessions.plan(spec, 100, 10, 0.2, seed=7)
    assert [t.turn for t in turns] == sorted(t.turn for t in turns)
    for k, turn in enumerate(turns):
        if turn.turn == 1:
            assert (turn.after, turn.history_len, turn.think_s) == (None, 0, 0.0)
        else:
            before = turns[turn.after]
            assert before.user == turn.user and before.turn == turn.turn - 1 and turn.after < k
            assert turn.history_len == before.input_len + before.output_len
            assert turn.think_s > 0


def test_a_later_turn_begins_with_the_previous_prompt_and_answer(tmp_path):
    c = cell(tmp_path)
    specs = build_requests(c.workload, 1000)
    later = [s for s in specs if s.after_id is not None]
    assert len(later) == 4 and c.workload.num_prompts == 6
    for spec in later:
        before = specs[spec.after_id]
        assert len(spec.prompt) == spec.input_len == before.input_len + before.output_len + 256
        assert spec.prompt[: before.input_len] == before.prompt
        # the answer's ids come next, then new ones: the prompts differ right after the prompt
        assert (
            spec.prompt[before.input_len :] != before.prompt[: len(spec.prompt) - before.input_len]
        )


def test_simulator_sends_a_turn_its_think_time_after_the_previous_answer(tmp_path):
    c = cell(tmp_path, "nondisagg")
    records = {r.request_id: r for r in simulate(c).records}
    specs = build_requests(c.workload, 1000)
    for spec in specs[c.workload.warmup_requests :]:
        mine = records[spec.request_id]
        if spec.after_id is None:
            assert mine.sent_s == 0.0
        else:
            assert mine.sent_s == pytest.approx(records[spec.after_id].end_s + spec.think_s)
            assert mine.scheduled_s == mine.sent_s
        assert mine.prompt_tokens == spec.input_len and mine.success


def test_prefix_caching_serves_later_turns_from_the_history(tmp_path):
    c = cell(tmp_path)
    plan = session_plan(c.workload)
    warm = c.workload.warmup_requests

    def later_ttft(prefix_caching: bool) -> float:
        run = simulate(replace(c, serving=replace(c.serving, prefix_caching=prefix_caching)))
        ttfts = [
            r.first_token_s - r.sent_s
            for r in run.records
            if not r.warmup and plan[r.request_id - warm].turn > 1
        ]
        return sum(ttfts) / len(ttfts)

    assert later_ttft(True) < 0.95 * later_ttft(False)


@pytest.mark.parametrize(
    ("modes", "spec", "message"),
    [
        ("mooncake-rdma", "", "sessions run on single and round-robin modes only"),
        ("single", "{users: 2, turns: 2, min_turns: 3, think_time_s: 1}", "min_turns 3 exceeds"),
        ("single", "{users: 2, turns: 200, think_time_s: 1}", "beyond max_model_len"),
        ("single", "{users: 2, turns: 2}", "think_time_s"),
    ],
)
def test_bad_sessions_config_is_one_line_in_check_and_the_workflow(tmp_path, modes, spec, message):
    path = config_file(tmp_path, modes, spec)
    with pytest.raises(ConfigError):
        load_file(path)
    check = subprocess.run(
        [str(BIN / "servematrix"), "check", str(path)], capture_output=True, text=True
    )
    assert check.returncode != 0
    lines = [line for line in check.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "sessions" in lines[0], check.stderr
    workflow = subprocess.run(
        [str(BIN / "snakemake"), "-n", "--cores", "1", "--configfile", str(path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert workflow.returncode != 0 and message in workflow.stderr + workflow.stdout


@pytest.mark.slow
def test_emulator_gets_each_turn_its_think_time_after_the_previous_answer():
    """The load generator against the real emulator process: 2 users x 3 turns."""
    from servematrix.client import loadgen
    from tests.test_loadgen_e2e import MODEL, VOCAB, emulator, workload

    w = workload(
        qps=float("inf"),
        input_len=64,
        output_len=4,
        num_prompts=6,
        sessions=sessions.Sessions(users=2, turns=3, think_time_s=0.2, think_time="fixed"),
    )
    specs = build_requests(w, VOCAB)
    with emulator() as url:
        result = loadgen.run(
            loadgen.ClientSettings(base_url=url, model=MODEL, max_concurrency=None), specs
        )
    records = {r.request_id: r for r in result.records}
    assert all(r.success for r in records.values())
    for spec in specs[w.warmup_requests :]:
        mine = records[spec.request_id]
        assert mine.prompt_tokens == spec.input_len
        if spec.after_id is not None:
            due = records[spec.after_id].end_s + 0.2
            assert mine.scheduled_s == pytest.approx(due, abs=1e-6)
            assert due <= mine.sent_s < due + 0.05


def test_summary_gives_the_mean_ttft_of_first_and_later_turns(tmp_path):
    import polars as pl

    from servematrix.results import aggregate, metrics

    c = cell(tmp_path)
    records = simulate(c).records
    table = pl.DataFrame(
        [{name: getattr(r, name) for name in metrics.REQUIRED_COLUMNS} for r in records]
    ).to_arrow()
    summary = aggregate.turn_summary(table, c.to_dict()["workload"])
    specs = build_requests(c.workload, 1000)
    ttft = {
        first: [
            (r.first_token_s - r.sent_s) * 1e3
            for r in records
            if not r.warmup and (specs[r.request_id].after_id is None) == first
        ]
        for first in (True, False)
    }
    assert summary["ttft_turn1_mean_ms"] == pytest.approx(sum(ttft[True]) / 2)
    assert summary["ttft_later_turns_mean_ms"] == pytest.approx(sum(ttft[False]) / 4)
    assert aggregate.turn_summary(table, {}) == dict.fromkeys(aggregate.TURN_COLUMNS)
