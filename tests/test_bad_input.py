"""Bad input (issue 11): every row is one exact line from `servematrix check`, nothing written.

The same rows go through real Snakemake in test_bad_input_workflow.py; both call
`servematrix.workflow.check_config`, so the lines are the same.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from servematrix import cli
from servematrix.engine import architecture
from servematrix.spec import config
from servematrix.spec.matrix import ConfigError
from servematrix.workflow import check_config
from tests.conftest import ROOT, SMALL_CONFIG

SHIPPED = ", ".join(architecture.shipped())
MODEL = "Qwen2.5-14B-Instruct"


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict], None]:
    """Set a key path (``("studies", "disagg", "qps")``) of the config."""

    def apply(cfg: dict) -> None:
        *parents, last = path
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return apply


def _pins(gpus: list[list[int]]) -> Callable[[dict], None]:
    def apply(cfg: dict) -> None:
        cfg["models"][MODEL].update(gpus=gpus, tensor_parallel=len(gpus[0]))

    return apply


def _dataset(name: str) -> Callable[[dict], None]:
    """Every cell replays a jsonl file of tests/data."""

    def apply(cfg: dict) -> None:
        cfg["defaults"].update(dataset="jsonl", dataset_path=str(DATA / name))

    return apply


DATA = ROOT / "tests" / "data"


def _plain_prefill_above_32k(cfg: dict) -> None:
    """Llama 3.2 1B (context 131072) in single-plain on v0 at max_model_len 40000."""
    cfg["models"][MODEL]["architecture"] = str(ROOT / "config/examples/my-model/config.json")
    cfg["studies"]["sizes"].update(
        models=[MODEL], modes=["single", "single-plain"], workload={"max_model_len": 40_000}
    )


BAD_TRACE = DATA / "bad-trace.jsonl"


def _bad_trace(cfg: dict) -> None:
    cfg["defaults"].update(
        dataset="mooncake", dataset_path=str(BAD_TRACE), warmup_requests=0, num_prompts=1
    )


# (row of the table, change to the small config, the one line both check and workflow print)
ROWS: list[tuple[str, Callable[[dict], None], str]] = [
    (
        "trace-negative-length",
        _bad_trace,
        f"config error at defaults.dataset_path: trace file {BAD_TRACE} line 2: input_length "
        "must be an integer >= 1, got -5",
    ),
    (
        "num_prompts-ceiling",
        _set(("defaults", "num_prompts"), 1_000_000_000),
        "config error at defaults.num_prompts: 1,000,000,001 requests of input 1024 and output 6 "
        "tokens need about 4,530.0 GiB in one cell, above the ceiling of 4.0 GiB "
        "(at most 883,011 requests of these lengths)",
    ),
    (
        "architecture-not-shipped",
        _set(("models", MODEL, "architecture"), "llama-3.1-8b"),
        f"config error at models.{MODEL}.architecture: unknown architecture 'llama-3.1-8b': "
        f"give a shipped name ({SHIPPED}), a path to a config.json, or a Hugging Face id such "
        "as org/model",
    ),
    (
        "deploy-nodes-neither-count-nor-addresses",
        _set(("deploy", "nodes"), "two"),
        "config error at deploy.nodes: 'two' is not valid under any of the given schemas",
    ),
    (
        "integer-float-tp",
        _set(("models", MODEL, "tensor_parallel"), 4.0),
        f"config error at models.{MODEL}.tensor_parallel: 4.0 is not of type 'integer'",
    ),
    (
        "integer-float-num-prompts",
        _set(("defaults", "num_prompts"), 200.0),
        "config error at defaults.num_prompts: 200.0 is not of type 'integer'",
    ),
    (
        "qps-nan",
        _set(("studies", "disagg", "qps"), [2, math.nan]),
        "config error at studies.disagg.qps[1]: nan is not of type 'number'",
    ),
    (
        "duplicate-qps",
        _set(("studies", "disagg", "qps"), [2, 2, 4]),
        "config error at studies.disagg.qps[1]: 2 is already qps[0]: each value once",
    ),
    (
        "gpu-pin-12",
        _pins([[12]]),
        f"config error at models.{MODEL}.gpus[0]: pins GPU 12 but the node has 8 GPUs "
        "(ids 0-7; set node.gpus for a bigger node)",
    ),
    (
        "gpu-pins-8-11",
        _pins([[8, 9, 10, 11]]),
        f"config error at models.{MODEL}.gpus[0]: pins GPU 8 but the node has 8 GPUs "
        "(ids 0-7; set node.gpus for a bigger node)",
    ),
    (
        "jsonl-malformed-line",
        _dataset("malformed-line.jsonl"),
        f"config error at defaults.dataset_path: dataset file {DATA}/malformed-line.jsonl line 2: "
        "not valid JSON (Expecting ',' delimiter)",
    ),
    (
        "jsonl-output-len-0",
        _dataset("output-len-zero.jsonl"),
        f"config error at defaults.dataset_path: dataset file {DATA}/output-len-zero.jsonl line 3: "
        "output_len must be an integer >= 1, got 0",
    ),
    (
        "max-model-len-beyond-context",
        _set(("defaults", "max_model_len"), 200_000),
        "config error at defaults.max_model_len: Qwen2.5-7B-Instruct-GPTQ-Int4: User-specified "
        "max_model_len (200000) is greater than the derived max_model_len "
        "(max_position_embeddings=32768 in model's config.json).",
    ),
    (
        "plain-prefill-vllm-0.6-would-chunk",
        _plain_prefill_above_32k,
        "config error at studies.sizes.modes[1]: mode 'single-plain' is plain prefill, but vLLM "
        "0.6 (recipe v0) chunks prefills by itself above max_model_len 32768 (here 40000): lower "
        "max_model_len, or use recipe v1",
    ),
    (
        "slo-negative",
        _set(("slo", "ttft", "max_ms"), -5),
        "config error at slo.ttft.max_ms: -5 is less than or equal to the minimum of 0",
    ),
    (
        "slo-ms-retired",
        _set(("slo_ms",), {"ttft": 2000}),
        "config error at slo_ms: slo_ms is replaced by slo (per metric a statistic and a bound, "
        "plus attainment); write slo: {ttft: {statistic: p99, max_ms: 2000}, attainment: 0.9}",
    ),
    (
        "slo-statistic",
        _set(("slo", "tpot", "statistic"), "p50"),
        "config error at slo.tpot.statistic: 'p50' is not one of "
        "['mean', 'median', 'p90', 'p95', 'p99']",
    ),
]

# A key written twice, and a syntax error: YAML text, located by line.
TEXT_ROWS: list[tuple[str, Callable[[str], str], str]] = [
    (
        "duplicate-yaml-key",
        lambda text: text + "studies:\n  other: {}\n",
        "config error at {path}: key 'studies' appears twice (lines {first} and {last})",
    ),
    (
        "yaml-syntax-error",
        lambda text: text.replace("seed: 0", "seed: [0", 1),
        "config error at {path}: not valid YAML at line {after_seed}, column 18: "
        "expected ',' or ']', but got ':' (while parsing a flow sequence at line {seed_line})",
    ),
]


def config_text(cfg: dict[str, Any]) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)


def broken_text(row: str) -> tuple[str, dict[str, int]]:
    """The YAML of a TEXT_ROWS row, and the line numbers its message names."""
    _, change, _ = next(r for r in TEXT_ROWS if r[0] == row)
    text = config_text(copy.deepcopy(SMALL_CONFIG))
    lines = text.splitlines()
    numbers = {
        "first": lines.index("studies:") + 1,
        "last": len(lines) + 1,
        "seed_line": next(i for i, line in enumerate(lines, 1) if "seed: 0" in line),
    }
    numbers["after_seed"] = numbers["seed_line"] + 1  # where the parser notices
    return change(text), numbers


def expected_text_line(row: str, path: str) -> str:
    _, numbers = broken_text(row)
    message = next(r[2] for r in TEXT_ROWS if r[0] == row)
    return "servematrix: " + message.format(path=path, **numbers)


def check(path: Path, capsys) -> tuple[int, list[str]]:
    code = cli.main(["check", str(path)])
    return code, capsys.readouterr().err.splitlines()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("row", "change", "message"), ROWS, ids=[r[0] for r in ROWS])
def test_check_refuses_in_one_line(in_tmp, capsys, row, change, message):
    cfg = copy.deepcopy(SMALL_CONFIG)
    change(cfg)
    (in_tmp / "c.yaml").write_text(config_text(cfg))
    assert check(Path("c.yaml"), capsys) == (1, [f"servematrix: {message}"])
    assert not (in_tmp / "results").exists()


@pytest.mark.parametrize("row", [r[0] for r in TEXT_ROWS])
def test_check_locates_yaml_errors_by_line(in_tmp, capsys, row):
    text, _ = broken_text(row)
    (in_tmp / "c.yaml").write_text(text)
    assert check(Path("c.yaml"), capsys) == (1, [expected_text_line(row, "c.yaml")])
    assert not (in_tmp / "results").exists()


def test_the_node_size_is_configurable(in_tmp, capsys):
    cfg = copy.deepcopy(SMALL_CONFIG)
    _pins([[12]])(cfg)
    cfg["node"] = {"gpus": 16}
    (in_tmp / "c.yaml").write_text(config_text(cfg))
    assert cli.main(["check", "c.yaml"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1] == "GPU ids pinned: 0, 4, 12 (of 16 on the node)"
    )


def test_check_lists_the_gpus_a_config_pins(in_tmp, capsys):
    (in_tmp / "c.yaml").write_text(config_text(copy.deepcopy(SMALL_CONFIG)))
    assert cli.main(["check", "c.yaml"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "GPU ids pinned: 0, 4 (of 8 on the node)"


def test_check_takes_the_workflows_overrides_and_names_step_time_fallbacks(monkeypatch, capsys):
    """`--config KEY=VALUE` as Snakemake parses it; a roofline fallback is a warning line
    here, as on a cell's terminal, with aiconfigurator's reason (this model's heads are not in
    its A100 tables)."""
    monkeypatch.chdir(ROOT)
    example = "config/examples/my-model.yaml"
    assert cli.main(["check", example, "--config", "backend=emulator"]) == 0
    out, err = capsys.readouterr()
    assert "2 distinct cells on backend emulator" in out
    [warning] = err.splitlines()
    assert warning.startswith(
        "servematrix: warning: step times of meta-llama/Llama-3.2-1B-Instruct on A100-SXM4-80GB, "
        "TP 1, bf16: aiconfigurator's measured tables do not cover this setup (aiconfigurator "
        "rejects it: perf database error: context attention data missing for "
    )
    assert "head_size: 64" in warning  # its tables hold 128-dimension heads, not this model's
    assert warning.endswith(
        "; falling back to the roofline model, an estimate (docs/engine-model.md)"
    )
    assert cli.main(["check", example, "--config", "backend=tgi"]) == 1
    assert capsys.readouterr().err.startswith(
        "servematrix: config error at backend: 'tgi' is not one of ["
    )


@pytest.mark.parametrize(
    ("backend", "fits"), [("simulator", 883_011), ("emulator", 79_512), ("vllm", 79_512)]
)
def test_a_cell_just_under_the_ceiling_is_accepted(backend, fits):
    """The simulator replays lengths; the backends that send prompts hold their token ids."""
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["backend"] = backend
    cfg["defaults"]["num_prompts"] = fits - 1  # plus the one warm-up request
    config.load(cfg)
    cfg["defaults"]["num_prompts"] = fits
    with pytest.raises(ConfigError, match=f"at most {fits:,} requests"):
        config.load(cfg)


def test_a_cell_of_one_huge_request_names_the_input_length():
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["backend"] = "emulator"
    cfg["defaults"]["max_model_len"] = 10**9
    cfg["studies"]["sizes"]["input_len"] = [10**8]
    with pytest.raises(ConfigError) as caught:
        config.load(cfg)
    assert caught.value.key_path == "studies.sizes.input_len"


def test_a_model_the_engine_cannot_start_is_refused_before_its_job():
    """vLLM's own start-up refusals, on the backends whose server is the engine model."""
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["defaults"].update(max_model_len=30_000, gpu_memory_utilization=0.085)
    with pytest.raises(ConfigError) as caught:
        check_config(cfg)
    assert str(caught.value).startswith(
        "config error at studies.disagg.models[0]: Qwen2.5-7B-Instruct-GPTQ-Int4 (gptq-int4) on "
        "A100-SXM4-80GB at TP 1: no available memory for the cache blocks"
    )
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["defaults"]["max_num_batched_tokens"] = 100
    with pytest.raises(ConfigError) as caught:
        check_config(cfg)
    assert caught.value.key_path == "defaults.max_num_batched_tokens"


def test_metrics_refuses_a_negative_slo(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "metrics", "x.parquet", "--slo", "ttft=-5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "usage: servematrix metrics [-h] [--slo KEY=MS] trace",
        "servematrix metrics: error: argument --slo: ttft=-5: an SLO must be a positive number "
        "of ms",
    ]
    assert list(tmp_path.iterdir()) == []


# --- any model: shipped name, local config.json, Hugging Face id --------------------------------

LLAMA_1B = ROOT / "config" / "examples" / "my-model" / "config.json"


def with_architecture(tmp_path: Path, value: str) -> Path:
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["models"][MODEL]["architecture"] = value
    path = tmp_path / "c.yaml"
    path.write_text(config_text(cfg))
    return path


def test_a_local_config_json_is_simulated(tmp_path):
    """The local-path route for real: check, then one cell through the simulator."""
    from servematrix.backends.cell import run_cell
    from servematrix.spec.trace import read

    cfg = config.load_file(with_architecture(tmp_path, str(LLAMA_1B)))
    cell = next(c for c in cfg.all_cells() if c.model.name == MODEL)
    run_cell(cell, tmp_path / "t.parquet")
    assert read(tmp_path / "t.parquet").num_rows == 21


def test_a_model_directory_is_accepted(tmp_path):
    config.load_file(with_architecture(tmp_path, str(LLAMA_1B.parent)))


@pytest.mark.parametrize(
    ("extra", "feature"),
    [
        ({"num_local_experts": 8}, "mixture of experts (num_local_experts: 8)"),
        ({"kv_lora_rank": 512}, "multi-head latent attention (MLA) (kv_lora_rank: 512)"),
        ({"sliding_window": 4096}, "sliding-window attention (sliding_window: 4096)"),
        ({"vision_config": {"depth": 32}}, "a vision tower (multimodal model) (vision_config:"),
        (
            {"architectures": ["BertModel"]},
            "not a causal language model (architectures: BertModel)",
        ),
    ],
)
def test_an_unsupported_feature_is_named(tmp_path, capsys, extra, feature):
    arch = {**json.loads(LLAMA_1B.read_text()), **extra}
    (tmp_path / "arch.json").write_text(json.dumps(arch))
    code, err = check(with_architecture(tmp_path, str(tmp_path / "arch.json")), capsys)
    assert code == 1
    assert err[0].startswith(
        f"servematrix: config error at models.{MODEL}.architecture: {tmp_path / 'arch.json'}: "
        f"servematrix does not model {feature}"
    )
    assert len(err) == 1


def test_a_missing_local_file_is_named(tmp_path, capsys):
    code, err = check(with_architecture(tmp_path, "nowhere/config.json"), capsys)
    assert (code, err) == (
        1,
        [
            f"servematrix: config error at models.{MODEL}.architecture: no such file "
            "'nowhere/config.json' (architecture 'nowhere/config.json')"
        ],
    )


def _check_in_subprocess(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "check", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_a_hub_id_offline_and_not_cached_is_one_line(tmp_path):
    path = with_architecture(tmp_path, "meta-llama/Llama-3.2-1B-Instruct")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    run = _check_in_subprocess(path, env)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"servematrix: config error at models.{MODEL}.architecture: Hugging Face model "
        "'meta-llama/Llama-3.2-1B-Instruct' has no config.json in the Hugging Face cache and "
        "HF_HUB_OFFLINE is set: fetch it once online, or give a path to a local config.json"
    ]


def test_a_hub_id_with_the_hub_out_of_reach_says_so_and_how_to_do_without(tmp_path):
    """No network (here: nothing listens at HF_ENDPOINT): one line that says the Hub cannot be
    reached and how to give the architecture instead, after one attempt; it used to retry for
    ~25 s and then call the file missing ("has no config.json")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    path = with_architecture(tmp_path, "acme/tiny-llama")
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{closed}",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
    }
    run = _check_in_subprocess(path, env)
    assert run.returncode == 1
    [line] = run.stderr.splitlines()
    assert line.startswith(
        f"servematrix: config error at models.{MODEL}.architecture: Hugging Face model "
        "'acme/tiny-llama' needs its config.json from the Hugging Face Hub, which cannot be "
        "reached (ConnectError: "
    ), line
    assert line.endswith(
        "connect once (it is cached then), or give the model an `architecture:`, a shipped "
        f"name ({SHIPPED}) or a local config.json"
    ), line


def test_a_hub_id_in_the_cache_is_read_from_it(tmp_path):
    """A pre-populated Hugging Face cache (the layout hf_hub_download writes); no network."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(LLAMA_1B.read_text())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    path = with_architecture(tmp_path, "acme/tiny-llama")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    run = _check_in_subprocess(path, env)
    assert run.returncode == 0, run.stderr
    assert "8 distinct cells on backend simulator" in run.stdout


def test_the_worked_example_of_the_readme_checks(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["check", "config/examples/my-model.yaml"]) == 0
    assert "my-model: 2 cells (v1, x = qps)" in capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    assert "servematrix check config/examples/my-model.yaml" in readme
    assert "snakemake --cores 1 all --configfile config/examples/my-model.yaml" in readme


def test_the_emulator_example_of_the_readme_checks(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["check", "config/examples/emulator-mooncake.yaml"]) == 0
    assert "32 distinct cells on backend emulator" in capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    assert "--configfile config/examples/emulator-mooncake.yaml" in readme
