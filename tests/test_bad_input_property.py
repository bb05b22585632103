"""Property: whatever config `servematrix check` is given, it accepts it and every planned cell
has a valid path, or it refuses it in one line; it never ends in a traceback."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servematrix import cli
from servematrix.engine import architecture
from servematrix.spec import config
from servematrix.spec.matrix import MODES, WORKLOAD_TOKEN_PATTERN, Config
from tests.conftest import ROOT, SMALL_CONFIG
from tests.workflow_helpers import copy_workflow, planned_jobs, snakemake

MODELS = list(SMALL_CONFIG["models"])
EXAMPLE_ARCH = str(ROOT / "config" / "examples" / "my-model" / "config.json")
number_list = st.lists(
    st.one_of(st.floats(0.01, 1e4), st.just(math.inf), st.integers(1, 100)), min_size=1, max_size=4
)

# Key paths a user edits, in the small config, each with values a user might plausibly write.
PLAUSIBLE: dict[tuple[str, ...], st.SearchStrategy] = {
    ("backend",): st.just("simulator"),
    ("defaults", "num_prompts"): st.integers(1, 200_000),
    ("defaults", "output_len"): st.integers(1, 20_000),
    ("defaults", "seed"): st.integers(0, 2**31),
    ("defaults", "warmup_requests"): st.integers(0, 100),
    ("defaults", "max_model_len"): st.integers(16, 10**6),
    ("defaults", "burstiness"): st.floats(0.01, 100),
    ("defaults", "gpu_memory_utilization"): st.floats(0.05, 1),
    ("slo", "ttft", "max_ms"): st.floats(0.1, 1e6),
    ("slo", "attainment"): st.floats(0.01, 1),
    ("node", "gpus"): st.integers(1, 64),
    ("models", MODELS[1], "architecture"): st.sampled_from([*architecture.shipped(), EXAMPLE_ARCH]),
    ("models", MODELS[1], "tensor_parallel"): st.sampled_from([1, 2, 4, 8]),
    ("models", MODELS[1], "gpus"): st.lists(
        st.lists(st.integers(0, 15), min_size=1, max_size=8), min_size=1, max_size=2
    ),
    ("models", MODELS[1], "quantization"): st.sampled_from(
        ["bf16", "awq", "gptq-int4", "gptq-int8", "fp8"]
    ),
    ("studies", "sizes", "qps"): number_list,
    ("studies", "sizes", "input_len"): st.lists(st.integers(1, 20_000), min_size=1, max_size=3),
    ("studies", "sizes", "models"): st.lists(st.sampled_from(MODELS), min_size=1, max_size=2),
    ("studies", "sizes", "modes"): st.lists(st.sampled_from(sorted(MODES)), min_size=1, max_size=3),
    ("studies", "disagg", "qps"): number_list,
    ("studies", "disagg", "workload"): st.dictionaries(
        st.sampled_from(["num_prompts", "output_len", "seed", "warmup_requests"]),
        st.integers(1, 1000),
    ),
}

scalars = st.one_of(
    st.integers(min_value=-(10**3), max_value=10**13),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 4, 8, 1024, 4.0, 200.0, 0.5, "", "x", "4", "qwen2.5-7b", None]),
    st.booleans(),
    st.text(max_size=6),
)
junk = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.lists(st.lists(st.integers(-2, 16), max_size=4), max_size=3),
    st.dictionaries(st.sampled_from(["num_prompts", "output_len", "qps", "x"]), scalars),
)


@st.composite
def edit(draw) -> tuple[tuple[str, ...], Any]:
    """Mostly a plausible value (so cross-key checks are reached), sometimes junk."""
    path = draw(st.sampled_from(list(PLAUSIBLE)))
    value = draw(st.one_of(*[PLAUSIBLE[path]] * 5, junk))
    return path, value


edits = st.lists(edit(), min_size=1, max_size=3)

CELL_PATH = re.compile(
    rf"results/simulator/cells/v[01]/[A-Za-z0-9][A-Za-z0-9._-]*/[a-z-]+/"
    rf"({WORKLOAD_TOKEN_PATTERN})\.parquet"
)


def edited(changes: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    cfg = copy.deepcopy(SMALL_CONFIG)
    for (*parents, last), value in changes:
        node = cfg
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = value
    return cfg


def assert_accepted_or_one_line(path: Path, capsys) -> Config | None:
    code = cli.main(["check", str(path)])
    out, err = capsys.readouterr()
    if code != 0:
        assert code == 1
        assert len(err.splitlines()) == 1, err
        assert err.startswith("servematrix: config error at "), err
        return None
    # An accepted config may only be warned about (a roofline step-time fallback, once per setup).
    assert all(line.startswith("servematrix: warning: ") for line in err.splitlines()), err
    cfg = config.load_file(path)
    paths = [cell.path for cell in cfg.all_cells()]
    assert len(set(paths)) == len(paths)
    for cell_path in paths:
        assert CELL_PATH.fullmatch(cell_path), cell_path
    assert f"{len(paths)} distinct cells" in out
    return cfg


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(edits)
def test_check_accepts_or_refuses_in_one_line(tmp_path, capsys, changes):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(edited(changes), sort_keys=False))
    assert_accepted_or_one_line(path, capsys)


# Valid edits only: Snakemake must plan exactly the cells `check` counts (a handful of runs).
valid_edits = st.lists(
    st.one_of(
        st.tuples(st.just(("defaults", "num_prompts")), st.integers(1, 10**5)),
        st.tuples(st.just(("defaults", "output_len")), st.integers(1, 64)),
        st.tuples(
            st.just(("studies", "sizes", "qps")),
            st.lists(st.one_of(st.floats(0.01, 1000), st.just(math.inf)), min_size=1, max_size=3),
        ),
        st.tuples(
            st.just(("studies", "sizes", "input_len")),
            st.lists(st.integers(1, 4096), min_size=1, max_size=3, unique=True),
        ),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.slow
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(valid_edits)
def test_snakemake_plans_what_check_accepts(tmp_path_factory, capsys, changes):
    workdir = copy_workflow(tmp_path_factory.mktemp("prop"), edited(changes))
    cfg = assert_accepted_or_one_line(workdir / "config" / "config.yaml", capsys)
    dry = snakemake(workdir, "-n", "--cores", "1", "all")
    if cfg is None:
        assert dry.returncode != 0 and "Traceback" not in dry.stderr
        return
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert planned_jobs(dry)["simulate_cell"] == len(cfg.all_cells())
