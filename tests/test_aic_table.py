"""The aiconfigurator step-time table against aiconfigurator itself, and the roofline against both.

Issue 3's cross-check: Qwen2.5-7B on A100 at TP 1, 2 and 4. The table must reproduce
aiconfigurator exactly on grid points and within interpolation error between them; the roofline
fallback must land within 30 % of it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from servematrix.backends.cell import run_cell
from servematrix.engine import aic_table
from servematrix.engine import setup as engine_setup
from servematrix.engine.aic_table import AicStepTime, StepTimeFallback, select_step_time_model
from servematrix.engine.architecture import Architecture, load_architecture
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch
from servematrix.spec import trace
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload

A100 = "A100-SXM4-80GB"
H100 = "H100-SXM5-80GB"
QWEN_7B = load_architecture("qwen2.5-7b")
TPS = (1, 2, 4)
GRID_DECODES = ((1, 1024), (32, 1024), (8, 4096))
OFF_GRID_DECODES = ((37, 1500), (100, 3000), (3, 777))
GRID_PREFILLS = ((1024, 0), (4096, 0), (2048, 0))
OFF_GRID_PREFILLS = ((1500, 0), (3000, 0), (512, 3584), (700, 2500))
ON_GRID, OFF_GRID, ROOFLINE = 1e-9, 0.02, 0.30


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("steptime")


@pytest.fixture(scope="module")
def tables(cache: Path) -> dict[int, AicStepTime]:
    return {tp: AicStepTime(QWEN_7B, A100, tp, "bf16", cache) for tp in TPS}


@pytest.fixture(scope="module")
def handles() -> dict[int, object]:
    from aiconfigurator_core.sdk.engine import EngineHandle

    model_dir = str(aic_table.resolve_config_json("qwen2.5-7b").parent)
    with aic_table._aic_logs_to_debug():
        return {tp: EngineHandle.compile(model_dir, "a100_sxm", "vllm", tp_size=tp) for tp in TPS}


def decode(batch: int, context: int) -> StepBatch:
    return StepBatch(decode_contexts=(context,) * batch)


def prefill(new: int, past: int) -> StepBatch:
    return StepBatch(prefill_chunks=((new, past),))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(
    ("points", "tolerance"), [(GRID_DECODES, ON_GRID), (OFF_GRID_DECODES, OFF_GRID)]
)
def test_decode_matches_aiconfigurator(tables, handles, tp, points, tolerance):
    for batch, context in points:
        expected = handles[tp].predict_decode_latency(batch, context)
        got = tables[tp].step_ms(decode(batch, context))
        assert got == pytest.approx(expected, rel=tolerance), (tp, batch, context)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(
    ("points", "tolerance"), [(GRID_PREFILLS, ON_GRID), (OFF_GRID_PREFILLS, OFF_GRID)]
)
def test_prefill_matches_aiconfigurator(tables, handles, tp, points, tolerance):
    for new, past in points:
        expected = handles[tp].predict_prefill_latency(1, new + past, past)
        got = tables[tp].step_ms(prefill(new, past))
        assert got == pytest.approx(expected, rel=tolerance), (tp, new, past)


@pytest.mark.parametrize("tp", TPS)
def test_mixed_step_shares_gemms_like_aiconfigurator(tables, handles, tp):
    """A chunk plus decodes costs aiconfigurator's mixed step, far less than the two steps apart.

    (aiconfigurator's mixed step uses ``isl`` both as the prompt and as the decodes' context.)
    """
    batch = StepBatch(prefill_chunks=((1024, 0),), decode_contexts=(1024,) * 32)
    expected = handles[tp].mixed_step_latency(1024, 32, 1024, 2)
    got = tables[tp].step_ms(batch)
    assert got == pytest.approx(expected, rel=0.01)
    apart = tables[tp].step_ms(prefill(1024, 0)) + tables[tp].step_ms(decode(32, 1024))
    assert got < 0.95 * apart


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(
    ("chunks", "new", "tolerance"), [(64, 128, ON_GRID), (16, 512, ON_GRID), (5, 300, OFF_GRID)]
)
def test_a_steps_prefill_chunks_share_one_attention_call(
    tables, handles, tp, chunks, new, tolerance
):
    """vLLM runs one varlen attention call per layer over all of a step's prompts: n equal
    chunks cost aiconfigurator's batched prefill (n prompts of ``new`` tokens), far less than n
    chunks alone, whose fixed cost per call the table would otherwise count n times."""
    batch = StepBatch(prefill_chunks=((new, 0),) * chunks)
    expected = handles[tp].predict_prefill_latency(chunks, new, 0)
    assert tables[tp].step_ms(batch) == pytest.approx(expected, rel=tolerance)
    alone = tables[tp].parts_ms(prefill(new, 0)).prefill_attention_ms
    together = tables[tp].parts_ms(batch).prefill_attention_ms
    assert alone < together < chunks * alone / 2


@pytest.mark.parametrize("tp", TPS)
def test_roofline_within_30_percent(tables, tp):
    from servematrix.engine.hardware import gpu_spec
    from servematrix.engine.roofline import RooflineStepTime

    roofline = RooflineStepTime(QWEN_7B, gpu_spec(A100), tp, "bf16")
    for batch in (decode(1, 1024), decode(32, 1024), prefill(1024, 0), prefill(4096, 0)):
        assert roofline.step_ms(batch) == pytest.approx(tables[tp].step_ms(batch), rel=ROOFLINE)


def test_second_construction_reads_the_cache(tables, cache, monkeypatch):
    from aiconfigurator_core.sdk.engine import EngineHandle

    def refuse(*args, **kwargs):
        raise AssertionError("aiconfigurator called although the table is cached")

    monkeypatch.setattr(EngineHandle, "compile", refuse)
    cached = AicStepTime(QWEN_7B, A100, 1, "bf16", cache)
    for batch in (decode(37, 1500), prefill(700, 2500)):
        assert cached.step_ms(batch) == tables[1].step_ms(batch)
    assert cached.label == tables[1].label == "aiconfigurator-core 0.12.0 a100_sxm vllm"
    assert not list(cache.glob("*.tmp")), "atomic write left a temporary file"


def test_weight_only_int4_is_faster_at_small_batch_not_at_large(tables, cache):
    awq = AicStepTime(QWEN_7B, A100, 1, "awq", cache)
    assert awq.step_ms(decode(1, 1024)) < 0.6 * tables[1].step_ms(decode(1, 1024))
    assert awq.step_ms(prefill(4096, 0)) > tables[1].step_ms(prefill(4096, 0))
    assert "int4_wo" in awq.label and "approximation" in awq.label


def fake_roofline(arch, gpu, tp, quantization):
    return ("roofline", arch.name, gpu, tp, quantization)


@pytest.mark.parametrize(
    ("arch", "gpu", "tp", "quantization", "why"),
    [
        ("qwen2.5-7b", "A10-24GB", 1, "bf16", "no system file for A10-24GB"),
        ("qwen2.5-7b", "L40S-48GB", 1, "awq", "no system file for L40S-48GB"),
        ("qwen2.5-7b", A100, 8, "bf16", "should be divisible by tp_size 8"),
        ("qwen2.5-7b", A100, 1, "fp8", "fp8 on A100"),
    ],
)
def test_fallback_to_roofline_says_why(arch, gpu, tp, quantization, why, cache, monkeypatch):
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    choice = select_step_time_model(arch, gpu, tp, quantization, roofline=fake_roofline)
    assert choice.model == ("roofline", arch, gpu, tp, quantization)
    assert choice.label.startswith("roofline (") and why in choice.label
    assert choice.fallback is not None and choice.fallback.to == "roofline"
    assert why in choice.fallback.reason and choice.label == f"roofline ({choice.fallback.reason})"


def test_a_sibling_card_runs_on_the_tables_plus_the_rooflines_memory_difference(
    tables, cache, monkeypatch
):
    """The A100 40 GB (the 80 GB's die, slower HBM) has no tables: the 80 GB's plus the
    roofline's difference between the cards. A memory-bound decode is slower than on the 80 GB
    card by that difference; a compute-bound prefill costs what the 80 GB table says."""
    from servematrix.engine.hardware import gpu_spec
    from servematrix.engine.roofline import RooflineStepTime

    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    choice = select_step_time_model(QWEN_7B, "A100-SXM4-40GB", 1, "bf16")
    assert choice.fallback is None
    assert "a100_sxm vllm + the roofline's A100-SXM4-40GB - A100-SXM4-80GB" in choice.label
    roof = {g: RooflineStepTime(QWEN_7B, gpu_spec(g), 1) for g in (A100, "A100-SXM4-40GB")}
    for batch in (decode(32, 1024), prefill(4096, 0)):
        difference = roof["A100-SXM4-40GB"].step_ms(batch) - roof[A100].step_ms(batch)
        assert choice.model.step_ms(batch) == pytest.approx(tables[1].step_ms(batch) + difference)
    slower = choice.model.step_ms(decode(32, 1024)) / tables[1].step_ms(decode(32, 1024))
    assert 1.15 < slower < 2.039 / 1.555
    assert choice.model.step_ms(prefill(4096, 0)) == pytest.approx(
        tables[1].step_ms(prefill(4096, 0))
    )


def test_cohere_is_approximated_as_llama_and_says_so(cache, monkeypatch):
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    choice = select_step_time_model("command-r7b-12-2024", A100, 1, "bf16")
    assert isinstance(choice.model, AicStepTime) and choice.fallback is None
    assert "Cohere2ForCausalLM as Llama of the same dimensions" in choice.label
    assert "sliding-window" in choice.label
    assert 5 < choice.model.step_ms(decode(1, 1024)) < 20


def test_mistral_runs_on_the_tables_of_the_same_llama_without_an_approximation(
    cache, monkeypatch, tmp_path
):
    """Mistral-Nemo (``head_dim`` 128 under a 5,120-wide model) steps as the Llama config of its
    dimensions does in aiconfigurator itself, and its label claims no approximation."""
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    choice = select_step_time_model("mistral-nemo-12b", H100, 1, "bf16")
    assert isinstance(choice.model, AicStepTime) and choice.fallback is None
    assert "approximation" not in choice.label
    config = json.loads(aic_table.resolve_config_json("mistral-nemo-12b").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    llama = AicStepTime(load_architecture(str(tmp_path)), H100, 1, "bf16", cache)
    for batch in (decode(32, 1024), prefill(1024, 0), prefill(512, 2048)):
        assert choice.model.step_ms(batch) == pytest.approx(llama.step_ms(batch), rel=1e-9)


def test_only_more_kv_heads_per_gpu_than_the_tables_hold_get_an_equivalent() -> None:
    """Llama-2-7B has 32 KV heads: 32 per GPU at TP 1 (4x the tables' 8), 16 at TP 2, 8 at TP 4;
    grouped-query models and head counts no multiple of 8 stay as aiconfigurator reads them."""
    llama2 = json.loads(aic_table.resolve_config_json("llama-2-7b").read_text())
    fewer, ratio = aic_table.mha_equivalent(llama2, 1)
    assert ratio == 4
    assert (fewer["num_attention_heads"], fewer["num_key_value_heads"], fewer["head_dim"]) == (
        8,
        8,
        128,
    )
    assert fewer["hidden_size"] == llama2["hidden_size"] == 4096
    assert aic_table.mha_equivalent(llama2, 2)[1] == 2
    assert aic_table.mha_equivalent(llama2, 4) is None
    qwen = json.loads(aic_table.resolve_config_json("qwen2.5-7b").read_text())
    assert aic_table.mha_equivalent(qwen, 1) is None
    assert aic_table.mha_equivalent({**llama2, "num_key_value_heads": 12}, 1) is None


def test_mha_decode_attention_is_the_8_head_table_at_the_wider_batch(cache, monkeypatch):
    """aiconfigurator scales its 8-head decode attention by the head count (4x at 32 heads, its
    per-call floor included); the table takes the 8-head call at 4x the batch instead, the same
    (sequence, KV head) blocks of work, and so reads Llama-2's KV on one H100 below the HBM peak
    of 3.35 TB/s but above aiconfigurator's 2.2 TB/s."""
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    choice = select_step_time_model("llama-2-7b", H100, 1, "bf16")
    assert "32 KV heads per GPU read off the 8-head table at 4x the batch" in choice.label
    config = json.loads(aic_table.resolve_config_json("llama-2-7b").read_text())
    fewer, ratio = aic_table.mha_equivalent(config, 1)
    with aic_table._aic_logs_to_debug():
        plain = aic_table._compile(
            aic_table.AicQuery(config, "h100_sxm", 1, "bf16", ()), "vllm", None
        )
        eight = aic_table._compile(
            aic_table.AicQuery(fewer, "h100_sxm", 1, "bf16", ()), "vllm", None
        )
    attention = aic_table._decode_attention_ms
    for batch, context in ((64, 1024), (1, 1024), (8, 4096)):
        expected = (
            plain.predict_decode_latency(batch, context)
            - attention(plain, batch, context)
            + attention(eight, batch * ratio, context)
        )
        assert choice.model.step_ms(decode(batch, context)) == pytest.approx(expected, rel=1e-9)
    # 64 sequences x 701 tokens x 32 KV heads x 128 x (K, V) x 2 bytes x 32 layers: 23.5 GB
    kv_bytes = 64 * 701 * 32 * 128 * 2 * 2 * 32
    old_tb_s = kv_bytes / attention(plain, 64, 700) / 1e9
    new_tb_s = kv_bytes / attention(eight, 64 * ratio, 700) / 1e9
    assert old_tb_s < 2.5 < new_tb_s < 3.35


# The roofline fallback is never silent: a warning, a field in the trace metadata, the report.


def _setup(gpu: str, tp: int = 1, architecture: str | Architecture = "qwen2.5-7b"):
    return build_engine_setup(
        architecture,
        quantization="bf16",
        tensor_parallel=tp,
        recipe="v1",
        chunked_prefill=None,
        max_model_len=4096,
        gpu_memory_utilization=0.8,
        gpu=gpu,
        model_label="Qwen2.5-7B-Instruct (bf16)",
    )


@pytest.fixture
def warned(monkeypatch, cache) -> set:
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(cache))
    fresh: set = set()
    monkeypatch.setattr(engine_setup, "_warned_fallbacks", fresh)
    return fresh


def test_fallback_warns_once_per_setup_naming_it(warned, caplog):
    caplog.set_level(logging.WARNING, logger="servematrix.engine.setup")
    setup = _setup("A10-24GB")
    assert setup.step_time_fallback == StepTimeFallback(
        "aiconfigurator has no system file for A10-24GB"
    )
    _setup("A10-24GB")  # the same setup again: no second warning
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for part in ("Qwen2.5-7B-Instruct (bf16)", "A10-24GB", "TP 1", "bf16", "no system file"):
        assert part in message, (part, message)
    assert "falling back to the roofline" in message
    _setup("A10-24GB", tp=2)  # another setup: its own warning
    assert [r.getMessage().count("TP 2") for r in caplog.records] == [0, 1]


def test_measured_tables_neither_warn_nor_record_a_fallback(warned, caplog):
    caplog.set_level(logging.WARNING, logger="servematrix.engine.setup")
    setup = _setup(A100)
    assert setup.step_time_fallback is None and setup.step_time_fallback_record is None
    assert setup.step_time_label.startswith("aiconfigurator")
    assert caplog.records == []


def test_a_config_json_of_ones_own_gets_the_measured_tables(warned, tmp_path):
    """Issue 42: a dense Llama-3.1-8B given by its config.json (no such model is shipped) runs
    on aiconfigurator's H100 tables; a shipped model's file copied elsewhere gives the shipped
    step times exactly."""
    llama = {
        "architectures": ["LlamaForCausalLM"],
        **{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32},
        **{"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
        **{"vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0},
    }
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    setup = _setup("H100-SXM5-80GB", architecture=load_architecture(str(tmp_path / "llama")))
    assert setup.step_time_fallback is None
    assert setup.step_time_label.startswith("aiconfigurator-core ")
    shipped = Path(aic_table.resolve_config_json("qwen2.5-7b"))
    (tmp_path / "copy.json").write_text(shipped.read_text())
    copy = _setup(A100, architecture=load_architecture(str(tmp_path / "copy.json")))
    batch = StepBatch(((512, 1024),), (2048,) * 16)
    assert copy.step_time.step_ms(batch) == _setup(A100).step_time.step_ms(batch)
    assert copy.step_time_label == _setup(A100).step_time_label


def test_dimensions_no_config_json_holds_fall_back_and_say_so(warned, caplog):
    """The tables are built from the config.json behind the architecture's name; dimensions
    that file does not hold (a name reused for another model) get the roofline."""
    caplog.set_level(logging.WARNING, logger="servematrix.engine.setup")
    mine = dataclasses.replace(QWEN_7B, num_layers=7)
    setup = _setup(A100, architecture=mine)
    reason = setup.step_time_fallback_record["reason"]
    assert reason.endswith("qwen2.5-7b/config.json holds other dimensions than qwen2.5-7b's")
    assert reason in caplog.records[0].getMessage()
    unnamed = dataclasses.replace(QWEN_7B, name="my-model")
    assert _setup(A100, architecture=unnamed).step_time_fallback.reason.startswith(
        "no config.json to build its tables from (unknown architecture 'my-model'"
    )


def test_the_trace_metadata_records_the_fallback(warned, tmp_path):
    """Through the real cell runner: the trace's engine parameters carry the field."""
    on_a10 = _simulator_cell("A10-24GB")
    run_cell(on_a10, tmp_path / "a10.parquet")
    engine = trace.read_metadata(tmp_path / "a10.parquet")["deployment"]["engine"]
    assert engine["step_time_fallback"] == {
        "to": "roofline",
        "reason": "aiconfigurator has no system file for A10-24GB",
    }
    assert engine["step_time_source"].startswith("roofline (aiconfigurator has no system file")
    run_cell(_simulator_cell(A100), tmp_path / "a100.parquet")
    a100 = trace.read_metadata(tmp_path / "a100.parquet")["deployment"]["engine"]
    assert a100["step_time_fallback"] is None


def _simulator_cell(gpu: str) -> Cell:
    return Cell(
        backend="simulator",
        recipe="v1",
        model=ModelSpec(
            "Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", "bf16", 1, ((0,),)
        ),
        mode=MODES["single"],
        workload=Workload(4.0, 256, 4, 5, 0, "random", 1.0, 1),
        serving=Serving(4096, 0.8),
        engine={"gpu": gpu, "jitter_cv": 0.0},
    )
