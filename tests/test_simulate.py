"""The virtual-time driver: records, determinism, topologies."""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

import servematrix.simulate as simulate_module
import servematrix.simulate.v1 as simulate_v1
from servematrix.backends.cell import run_cell
from servematrix.engine.kvcache import ModelDoesNotFitError
from servematrix.results import aggregate
from servematrix.simulate import round_robin_targets, simulate
from servematrix.spec import config, trace
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload
from tests.conftest import ROOT

GPTQ_7B = ModelSpec(
    "Qwen2.5-7B-Instruct-GPTQ-Int4",
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-7b",
    "gptq-int4",
    1,
    ((0,), (4,)),
)


def cell(mode="nondisagg", recipe="v0", qps=4.0, n=40, jitter=0.0, model=GPTQ_7B) -> Cell:
    return Cell(
        backend="simulator",
        recipe=recipe,
        model=model,
        mode=MODES[mode],
        workload=Workload(qps, 1024, 6, n, 0, "random", 1.0, 1),
        serving=Serving(10_000, 0.8),
        engine={"gpu": "A100-SXM4-80GB", "jitter_cv": jitter},
    )


def ttft_ms(result) -> np.ndarray:
    return np.array([(r.first_token_s - r.sent_s) * 1e3 for r in result.records if not r.warmup])


def test_records_follow_the_trace_contract():
    c = cell()
    records = simulate(c).records
    assert [r.request_id for r in records] == list(range(41))
    warm, first = records[0], records[1]
    assert warm.warmup and warm.sent_s < 0 and warm.end_s <= 0 < warm.end_s + 1
    assert not first.warmup and first.scheduled_s == first.sent_s == 0.0
    for r in records:
        assert r.completion_tokens == 6 == len(r.chunk_s) and r.chunk_tokens == [1] * 6
        assert r.first_token_s == r.chunk_s[0] and r.end_s == r.chunk_s[-1]
        assert r.chunk_s == sorted(r.chunk_s) and r.first_token_s > r.sent_s
        assert r.success and r.prompt_tokens == 1024


@pytest.mark.parametrize("mode", ["single", "chunked", "mooncake-tcp"])
@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_deterministic_for_a_seed(mode, recipe):
    c = cell(mode, recipe, jitter=0.05)
    assert simulate(c).records == simulate(c).records
    other = dataclasses.replace(c, workload=dataclasses.replace(c.workload, seed=1))
    assert simulate(other).records != simulate(c).records


def test_round_robin_warmup_takes_the_first_slot():
    assert round_robin_targets(5, 2) == [0, 1, 0, 1, 0]


def test_two_instances_halve_the_load():
    single = simulate(cell("single", qps=8, n=100)).records
    pair = simulate(cell("nondisagg", qps=8, n=100)).records
    assert ttft_ms_of(pair).mean() < ttft_ms_of(single).mean()


def ttft_ms_of(records) -> np.ndarray:
    return np.array([(r.first_token_s - r.sent_s) * 1e3 for r in records if not r.warmup])


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_disaggregated_ttft_includes_the_transfer(recipe):
    low = 0.2  # requests never overlap
    agg = ttft_ms(simulate(cell("nondisagg", recipe, qps=low, n=10)))
    rdma = simulate(cell("mooncake-rdma", recipe, qps=low, n=10))
    tcp = ttft_ms(simulate(cell("mooncake-tcp", recipe, qps=low, n=10)))
    link = rdma.engine_parameters["kv_link"]
    nbytes = rdma.engine_parameters["kv_bytes_per_prompt_token"] * 1024
    transfer_ms = link["setup_ms"] + nbytes / (link["nic_gb_s"] * link["nics"] * 1e9) * 1e3
    # The prefill instance's TTFT, two proxy hops, the transfer and a decode step.
    assert ttft_ms(rdma).min() > agg.min() + transfer_ms
    assert tcp.min() > ttft_ms(rdma).min()


def test_v1_disaggregated_decode_is_not_stalled_by_prefills():
    """V1 moves KV asynchronously: the decode instance never runs a prompt. V0 receives the KV
    inside the decode instance's forward pass, so at 8 QPS of 1k prompts the receives (about
    0.2 s each over the CPU path) starve its decodes."""

    def tpot(records):
        return np.mean([(r.end_s - r.first_token_s) / 5 for r in records if not r.warmup])

    agg = simulate(cell("nondisagg", "v1", qps=8, n=100)).records
    v1 = simulate(cell("mooncake-rdma", "v1", qps=8, n=100)).records
    v0 = simulate(cell("mooncake-rdma", "v0", qps=8, n=100)).records
    assert tpot(v1) < tpot(agg) < tpot(v0)


def test_a_model_that_does_not_fit_fails_like_vllm():
    big = ModelSpec(
        "Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b", "bf16", 1, ((0,),)
    )
    with pytest.raises(ModelDoesNotFitError, match=r"gpu_memory_utilization 0\.8"):
        simulate(cell("single", model=big))


def test_engine_parameters_describe_the_setup():
    params = simulate(cell("mooncake-rdma", "v1", n=5)).engine_parameters
    assert params["scheduler"]["max_num_batched_tokens"] == 2048
    assert params["kv_cache"]["num_blocks"] > 0
    assert params["topology"] == "disaggregated-v1"


def test_engine_parameters_record_the_step_time_source():
    params = simulate(cell("single", "v0", n=3)).engine_parameters
    assert params["step_time_source"].startswith("aiconfigurator")
    a10 = dataclasses.replace(cell("single", "v0", n=3), engine={"gpu": "A10-24GB", "jitter_cv": 0})
    assert simulate(a10).engine_parameters["step_time_source"].startswith("roofline (")


def test_max_num_batched_tokens_override_reaches_the_scheduler():
    c = cell("chunked", "v0", n=3)
    c = dataclasses.replace(c, serving=Serving(10_000, 0.8, max_num_batched_tokens=512))
    assert simulate(c).engine_parameters["scheduler"]["max_num_batched_tokens"] == 512
    unchunked = dataclasses.replace(c, mode=MODES["nondisagg"])
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        simulate(unchunked)


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_chunked_prefill_on_one_instance_trades_ttft_for_shorter_stalls(tmp_path, recipe):
    """The chunked-prefill example at QPS 0.5 (steady): 8192-token prompts on one instance.
    Plain prefill runs a whole prompt in one step, and every request decoding meanwhile waits
    for it; chunked prefill caps a step at 2048 tokens, so the longest inter-token gap is under
    half of plain's, and each prompt takes several steps, so the mean TTFT is higher. The
    summary says which mode chunked."""
    study = "chunked-prefill" if recipe == "v0" else "chunked-prefill-v1"
    cfg = config.load(config.read_yaml(ROOT / "config" / "examples" / "chunked-prefill.yaml"))
    cells = [c for c in cfg.studies[study].cells if c.workload.qps == 0.5]
    paths, budgets, longest_gap_s = [], {}, {}
    for c in cells:
        paths.append(tmp_path / f"{c.mode.name}.parquet")
        table = run_cell(c, paths[-1])
        engine = trace.metadata_of(table.schema, paths[-1])["deployment"]["engine"]
        budgets[c.mode.name] = engine["scheduler"]["max_num_batched_tokens"]
        chunks = [r["chunk_s"] for r in table.to_pylist() if not r["warmup"]]
        longest_gap_s[c.mode.name] = max(np.diff(times).max() for times in chunks)
    summary = {row["mode"]: row for row in aggregate.summarize(paths).iter_rows(named=True)}
    plain, chunked = summary["single-plain"], summary["single-chunked"]
    assert budgets == {"single-plain": 10_000, "single-chunked": 2048}
    assert (plain["chunked_prefill"], chunked["chunked_prefill"]) == (False, True)
    assert longest_gap_s["single-chunked"] < 0.5 * longest_gap_s["single-plain"]
    assert chunked["mean_ttft_ms"] > plain["mean_ttft_ms"]


def test_max_num_seqs_caps_the_running_batch():
    """--max-num-seqs 4: at most four requests decode at once, so a burst of 16 queues and its
    TTFTs spread over four admission waves, where the default (256) runs all 16 together."""
    burst = dataclasses.replace(
        cell("single", "v1", qps=float("inf"), n=16),
        workload=Workload(float("inf"), 128, 100, 16, 0, "random", 1.0, 0),
    )
    capped = dataclasses.replace(burst, serving=Serving(10_000, 0.8, max_num_seqs=4))
    result = simulate(capped)
    assert result.engine_parameters["scheduler"]["max_num_seqs"] == 4
    assert ttft_ms(result).max() > 3 * ttft_ms(simulate(burst)).max()


def test_cpu_kv_offloading_serves_system_prompts_the_gpu_cache_cannot_hold():
    """200 system prompts of 2,048 tokens (23 GB of KV) against a 7B model's 9,530-block GPU
    cache: with 16 GiB of CPU offloading most hits come back over PCIe instead of being
    recomputed, so TTFT falls; 4 GiB, a fraction of the working set, thrashes and does not help."""
    model = ModelSpec("Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", "bf16", 1, ((0,),))
    workload = Workload(4.0, 2560, 32, 300, 0, "random", 1.0, 1, prefix_len=2048, prefix_groups=200)
    mean_ttft = {}
    for size in (None, 4.0, 16.0):
        serving = Serving(8192, 0.3, prefix_caching=True, kv_offloading_gib=size)
        c = dataclasses.replace(
            cell("single", "v1"), model=model, workload=workload, serving=serving
        )
        mean_ttft[size] = ttft_ms(simulate(c)).mean()
    assert mean_ttft[16.0] < 0.85 * mean_ttft[None]
    assert mean_ttft[4.0] > 0.95 * mean_ttft[None]


def test_v0_receive_stalls_decodes_on_the_consumer():
    """A V0 receive is part of the decode instance's step: with a slow CPU chain, requests that
    are decoding when another request's KV arrives see an inter-token gap of about the receive."""
    slow = {"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0, "kv_link": {"rank_cpu_gb_s": 0.05}}
    c = dataclasses.replace(cell("mooncake-rdma", "v0", qps=8, n=40), engine=slow)
    result = simulate(c)
    receive_s = result.engine_parameters["v0_receive_ms"] * 1e-3
    gaps = [
        b - a for r in result.records for a, b in zip(r.chunk_s[:-1], r.chunk_s[1:], strict=True)
    ]
    assert receive_s > 1.0 and max(gaps) > receive_s


def test_v0_receive_step_waits_for_the_producer_only_in_its_share():
    """Hand-checked: two received requests of 30 ms each, 10 ms of it the producer's share,
    then 5 ms of compute (65 ms in all). The producer runs a step from 5 ms to 25 ms: the
    first share stops at 5 ms and resumes at 25 ms, so the step ends 20 ms late, at 85 ms."""
    from servematrix.engine.instance import StepResult
    from servematrix.simulate.v0 import ReceiveStep

    step = ReceiveStep(0.0, StepResult(0.065, [], [], 0, 2), [(0.030, 0.010)] * 2, 0.0)
    assert step.end_s(producer_busy=False) == pytest.approx(0.065)
    step.advance(0.005, producer_busy=False)
    assert step.end_s(producer_busy=True) == float("inf")
    step.advance(0.025, producer_busy=True)  # nothing moves while the producer steps
    assert step.end_s(producer_busy=False) == pytest.approx(0.085)
    # Once past the gated parts, a busy producer no longer matters.
    step.advance(0.080, producer_busy=False)
    assert step.end_s(producer_busy=True) == pytest.approx(0.085)


@pytest.mark.parametrize("qps, slower", [(0.05, False), (8.0, True)])
def test_v0_producer_share_of_the_receive_waits_while_the_producer_steps(monkeypatch, qps, slower):
    """Gating the producer's share of each receive changes nothing when requests never overlap
    (the producer is idle whenever the decoder receives) and delays first tokens under load."""
    import servematrix.engine.transfer as transfer

    engine = {"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0, "kv_link": {"rank_cpu_gb_s": 0.2}}
    c = dataclasses.replace(cell("mooncake-rdma", "v0", qps=qps, n=30), engine=engine)
    gated = ttft_ms(simulate(c))
    monkeypatch.setattr(transfer, "V0_PRODUCER_CHAIN_SHARE", 0.0)  # the whole chain ungated
    ungated = ttft_ms(simulate(c))
    if slower:
        assert gated.mean() > 1.05 * ungated.mean()
    else:
        np.testing.assert_allclose(gated, ungated)


def test_v0_buffer_full_stalls_the_prefill_instance():
    small = {
        "gpu": "A100-SXM4-80GB",
        "jitter_cv": 0.0,
        "kv_buffer_size": 6e8,  # nine 1k-token entries of 66 MB per rank: one full V0 batch
        "kv_link": {"rank_cpu_gb_s": 0.1},
    }
    base = cell("mooncake-rdma", "v0", qps=8, n=30)
    roomy = simulate(base)
    stalled = simulate(dataclasses.replace(base, engine=small))
    assert roomy.engine_parameters["prefill_buffer_stall_s"] == 0.0
    assert stalled.engine_parameters["prefill_buffer_stall_s"] > 0.0
    tiny = dataclasses.replace(base, engine={**small, "kv_buffer_size": 1.0})
    with pytest.raises(RuntimeError, match="cannot hold one prefill batch"):
        simulate(tiny)


def test_more_nics_make_the_v1_transfer_faster():
    base = cell("mooncake-tcp", "v1", qps=0.2, n=5)
    one = ttft_ms(
        simulate(dataclasses.replace(base, engine={"jitter_cv": 0, "kv_link": {"nics": 1}}))
    )
    four = ttft_ms(
        simulate(dataclasses.replace(base, engine={"jitter_cv": 0, "kv_link": {"nics": 4}}))
    )
    assert four.max() < one.min()


def raw_config(mode: str, gpus: list[list[int]]) -> dict:
    """A one-cell v0 config, as a user would write it, for the config-loading tests."""
    return {
        "models": {
            "m": {"hf_id": "x/y", "architecture": "qwen2.5-7b", "tensor_parallel": 1, "gpus": gpus}
        },
        "studies": {
            "s": {
                "recipe": "v0",
                "models": ["m"],
                "modes": [mode],
                "qps": [1],
                "input_len": [8],
            }
        },
    }


def test_engine_and_serving_knobs_are_validated_with_key_paths():
    from servematrix.spec.config import load
    from servematrix.spec.matrix import ConfigError

    raw = raw_config("single", [[0]])
    raw["engine"] = {"kv_link": {"nics": 0}}
    with pytest.raises(ConfigError, match=r"engine\.kv_link\.nics"):
        load(raw)
    raw["engine"] = {"kv_link": {"bandwidth": 1}}
    with pytest.raises(ConfigError, match=r"engine\.kv_link"):
        load(raw)
    raw["engine"] = {}
    raw["defaults"] = {"enforce_eager": "yes"}
    with pytest.raises(ConfigError, match=r"defaults\.enforce_eager"):
        load(raw)
    # Below max_model_len only with chunked prefill (vLLM refuses it otherwise).
    raw["defaults"] = {"max_num_batched_tokens": 512, "max_model_len": 512}
    cell = load(raw).all_cells()[0]
    assert cell.serving.max_num_batched_tokens == 512 and cell.serving.enforce_eager is False


def test_every_kv_link_override_passes_the_schema_and_reaches_the_link():
    from servematrix.engine.transfer import LINK_OVERRIDES
    from servematrix.spec.config import load

    overrides = {key: 7 for key in LINK_OVERRIDES}
    raw = raw_config("mooncake-rdma", [[0], [1]])
    raw["defaults"] = {"num_prompts": 2}
    raw["engine"] = {"kv_link": overrides}
    result = simulate(load(raw).all_cells()[0])
    link = result.engine_parameters["kv_link"]
    assert {key: link[key] for key in LINK_OVERRIDES} == overrides


def with_workload(c: Cell, **changes) -> Cell:
    return dataclasses.replace(c, workload=dataclasses.replace(c.workload, **changes))


def max_in_flight(records) -> int:
    """Most measured requests between send and last chunk at once, from the trace alone (a
    request ending at the instant another is sent has freed its slot first)."""
    events = sorted(
        [(r.sent_s, 1) for r in records if not r.warmup]
        + [(r.end_s, -1) for r in records if not r.warmup]
    )
    level = peak = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    return peak


TOPOLOGIES = [
    ("single", "v0"),
    ("nondisagg", "v1"),
    ("mooncake-rdma", "v0"),
    ("mooncake-tcp", "v1"),
]


@pytest.mark.parametrize(("mode", "recipe"), TOPOLOGIES)
def test_concurrency_cap_holds_requests_like_vllm_bench_serve(mode, recipe):
    """qps inf with a cap of 3: never more than 3 in flight, and request k goes out exactly
    when the (k - 2)-th earliest of the earlier requests has completed (a FIFO semaphore)."""
    c = with_workload(cell(mode, recipe, n=30, jitter=0.05), qps=float("inf"), max_concurrency=3)
    records = [r for r in simulate(c).records if not r.warmup]
    assert max_in_flight(records) == 3
    assert {r.scheduled_s for r in records} == {0.0}
    for k, r in enumerate(records):
        ends = sorted(e.end_s for e in records[:k])
        expected = 0.0 if k < 3 else ends[k - 3]
        assert r.sent_s == expected
        assert r.first_token_s > r.sent_s
    uncapped = [r for r in simulate(with_workload(c, max_concurrency=None)).records]
    assert max_in_flight(uncapped) == 30


@pytest.mark.parametrize(("mode", "recipe"), TOPOLOGIES)
def test_a_cap_that_never_binds_changes_nothing(mode, recipe):
    c = cell(mode, recipe, qps=2, n=30, jitter=0.05)
    free = simulate(c).records
    assert simulate(with_workload(c, max_concurrency=30)).records == free
    # 29 < 30 takes the capped path, whose event loop must agree with the free-running one.
    loose = simulate(with_workload(c, max_concurrency=29)).records
    assert [r.sent_s for r in loose] == [r.sent_s for r in free]
    np.testing.assert_allclose(
        np.concatenate([r.chunk_s for r in loose]),
        np.concatenate([r.chunk_s for r in free]),
        rtol=0,
        atol=1e-9,
    )


@pytest.mark.parametrize(("mode", "recipe"), TOPOLOGIES)
def test_variable_lengths_reach_the_engine_and_the_trace(mode, recipe):
    from servematrix.workload import request_lengths

    c = with_workload(cell(mode, recipe, n=40), range_ratio=0.5, output_len=8, qps=8)
    records = simulate(c).records
    lengths = request_lengths(c.workload)
    assert [r.request_input_len for r in records] == lengths.input_lens
    assert [r.request_output_len for r in records] == lengths.output_lens
    assert len(set(lengths.input_lens)) > 10 and len(set(lengths.output_lens)) > 3
    for r in records:
        assert r.prompt_tokens == r.request_input_len
        assert r.completion_tokens == len(r.chunk_s) == r.request_output_len


def test_longer_prompts_take_longer_to_prefill():
    """At a light load, TTFT follows each request's own prompt length."""
    c = with_workload(cell("single", "v0", qps=0.2, n=30), range_ratio=0.9, input_len=4000)
    records = [r for r in simulate(c).records if not r.warmup]
    lengths = [r.request_input_len for r in records]
    ttfts = [r.first_token_s - r.sent_s for r in records]
    assert np.corrcoef(lengths, ttfts)[0, 1] > 0.95


def test_qps_inf_sends_everything_at_once():
    records = simulate(with_workload(cell("nondisagg", n=20), qps=float("inf"))).records
    assert {(r.scheduled_s, r.sent_s) for r in records if not r.warmup} == {(0.0, 0.0)}
    assert max_in_flight(records) == 20


def test_a_jsonl_workload_replays_its_lengths(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"input_len": 300, "output_len": 2}\n{"input_len": 2000, "output_len": 9}\n')
    c = with_workload(cell("mooncake-rdma", "v1", n=6), dataset="jsonl", dataset_path=str(path))
    result = simulate(c)
    measured = [r for r in result.records if not r.warmup]
    assert [r.request_input_len for r in measured] == [300, 2000] * 3
    assert [r.completion_tokens for r in measured] == [2, 9] * 3
    assert result.engine_parameters["token_counter"].startswith("approximation")


# --- Requests the server does not serve, preemptions, the sonnet prefix -----------------------


def client_error(recipe: str, prompt: int, max_tokens: int, limit: int, text: bool) -> str:
    """What the load generator records when the emulator refuses the request: vLLM's check
    (shared by emulator and simulator), the emulator's error body and the client's reading of
    it (the simulator must write the same)."""
    from servematrix.client import sse
    from servematrix.emulator import wire
    from servematrix.engine.admission import ContextLengthError, granted_max_tokens

    try:
        granted_max_tokens(recipe, prompt, max_tokens, limit, text)
    except ContextLengthError as error:
        body = wire.error_body(recipe, error.message, "BadRequestError", 400, error.param)
        return str(sse.status_message(400, body))
    raise AssertionError("the server serves this request")


def oversized_jsonl(tmp_path) -> str:
    """A fitting request, one that fits only with fewer output tokens (9,990 + 20 > 10,000),
    a token prompt and a text prompt each longer than max_model_len on its own."""
    path = tmp_path / "oversized.jsonl"
    rows = [
        {"input_len": 300, "output_len": 4},
        {"input_len": 9990, "output_len": 20},
        {"input_len": 10001, "output_len": 2},
        {"prompt": "word " * 10001, "output_len": 3},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(("mode", "recipe"), [*TOPOLOGIES, ("single", "v1")])
@pytest.mark.parametrize("cap", [None, 2])
def test_a_request_beyond_max_model_len_is_a_failed_row_and_the_cell_goes_on(
    tmp_path, mode, recipe, cap
):
    c = with_workload(
        cell(mode, recipe, n=8),
        dataset="jsonl",
        dataset_path=oversized_jsonl(tmp_path),
        max_concurrency=cap,
    )
    records = simulate(c).records
    measured = [r for r in records if not r.warmup]
    assert len(records) == 9 and [r.request_input_len for r in measured[:4]] == [
        300,
        9990,
        10001,
        10001,
    ]
    fits, tight, long_ids, long_text = measured[:4]
    assert fits.success and fits.completion_tokens == 4 and fits.error is None
    if recipe == "v1":  # 0.33 clamps max_tokens to what the context leaves
        assert tight.success and tight.completion_tokens == 10 and tight.request_output_len == 20
    else:
        assert not tight.success
        assert tight.error == client_error("v0", 9990, 20, 10_000, False)
        assert tight.error == (
            "HTTP 400: This model's maximum context length is 10000 tokens. However, you "
            "requested 10010 tokens (9990 in the messages, 20 in the completion). Please reduce "
            "the length of the messages or completion."
        )
    assert long_ids.error == client_error(recipe, 10001, 2, 10_000, False)
    assert long_text.error == client_error(recipe, 10001, 3, 10_000, True)
    if recipe == "v1":
        assert long_text.error == (
            "HTTP 400: This model's maximum context length is 10000 tokens. However, your "
            "prompt contains at least 10001 input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=10001)"
        )
    for refused in (r for r in records if r.error):
        assert not refused.success and refused.chunk_s == refused.chunk_tokens == []
        assert refused.first_token_s is refused.end_s is None
        assert refused.completion_tokens == 0 and refused.prompt_tokens == refused.request_input_len
        assert refused.preemptions == 0
    # The rest of the cell is served: the file's rows repeat, and so do their outcomes.
    assert [r.error for r in measured[4:]] == [r.error for r in measured[:4]]
    assert sum(r.success for r in measured) == (2 if recipe == "v0" else 4)


def test_a_prompt_no_free_v0_cache_could_hold_is_ignored_without_a_token():
    from servematrix.engine.kvcache import BlockPool
    from servematrix.simulate import serve_or_refuse
    from servematrix.workload import RequestLengths

    pool = BlockPool(200, watermark=0.01)  # 2 watermark blocks: at most 198 * 16 = 3168 tokens
    lengths = RequestLengths([3168, 3169, 100], [4, 4, 4])
    served = serve_or_refuse("v0", 10_000, pool, lengths)
    assert served.errors == {
        1: "stream ended without a token; the server logged: Input prompt (3169 tokens) + "
        "lookahead slots (0) is too long and exceeds the capacity of block_manager"
    }
    assert served.max_tokens == [4, 4, 4]
    # V1 has no watermark (and refuses at start-up a cache shorter than max_model_len).
    assert serve_or_refuse("v1", 10_000, BlockPool(200), lengths).errors == {}


def test_v1_clamps_a_request_that_fits_only_with_fewer_output_tokens():
    from servematrix.engine.kvcache import BlockPool
    from servematrix.simulate import serve_or_refuse
    from servematrix.workload import RequestLengths

    lengths = RequestLengths([90, 95, 100], [10, 10, 10])
    v1 = serve_or_refuse("v1", 100, BlockPool(100), lengths)
    assert v1.max_tokens == [10, 5, 10] and set(v1.errors) == {2}
    assert (
        v1.errors[2]
        == "HTTP 400: max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    v0 = serve_or_refuse("v0", 100, BlockPool(100), lengths)
    assert v0.max_tokens == [10, 10, 10] and set(v0.errors) == {1, 2}


def tight_kv_cell(mode="single", recipe="v0") -> Cell:
    """Everything at once into a KV pool of ~4,300 blocks (~69,000 tokens) where 100 requests
    grow to 112,400 tokens: the engine must preempt."""
    return dataclasses.replace(
        with_workload(cell(mode, recipe, n=100), qps=float("inf"), output_len=100),
        serving=Serving(10_000, 0.15),
    )


@pytest.mark.parametrize(
    ("mode", "recipe"), [("single", "v0"), ("single", "v1"), ("mooncake-rdma", "v0")]
)
def test_preemptions_per_request_come_from_the_engine(mode, recipe):
    records = simulate(tight_kv_cell(mode, recipe)).records
    counts = [r.preemptions for r in records]
    assert all(isinstance(n, int) and n >= 0 for n in counts)
    preempted = [r for r in records if r.preemptions]
    assert preempted and len(preempted) < len(records)
    assert all(r.success and r.completion_tokens == 100 for r in records)
    # A preempted request is prefilled again: it ends later than the median request.
    end = np.median([r.end_s - r.sent_s for r in records if not r.warmup])
    assert all(r.end_s - r.sent_s > end for r in preempted)
    roomy = simulate(with_workload(tight_kv_cell(mode, recipe), num_prompts=10)).records
    assert [r.preemptions for r in roomy] == [0] * 11


def test_recipes_run_without_prefix_caching_as_their_servers_do():
    from servematrix.deploy.recipes import plan
    from servematrix.simulate import engine_setup

    c = cell("single", "v1")
    assert "--no-enable-prefix-caching" in plan(c, "emulator").processes[0].argv
    assert not c.serving.prefix_caching
    assert not engine_setup(c).scheduler.prefix_caching
    assert not engine_setup(cell("single", "v0")).scheduler.prefix_caching


def sonnet_cell(tmp_path, recipe="v1", prefix_len=600) -> Cell:
    path = tmp_path / "sonnet.txt"
    lines = [
        f"Line {k} of the poem, with words that differ: {'abc' * (k % 7)} end.\n" for k in range(80)
    ]
    path.write_text("".join(lines))
    return with_workload(
        cell("single", recipe, qps=2, n=30),
        dataset="sonnet",
        dataset_path=str(path),
        input_len=1024,
        prefix_len=prefix_len,
    )


def test_sonnet_requests_share_the_prefix_random_ones_none(tmp_path):
    from servematrix.workload import (
        SONNET_BASE_PROMPT,
        TokenCounter,
        build_requests,
        request_lengths,
    )

    c = sonnet_cell(tmp_path)
    counter = TokenCounter.approximate()
    lengths = request_lengths(c.workload, counter)
    prompts = [r.prompt for r in build_requests(c.workload, 1000, counter)]
    common = prompts[0]
    for prompt in prompts[1:]:
        same = next(
            (i for i, (a, b) in enumerate(zip(common, prompt, strict=False)) if a != b), len(common)
        )
        common = common[:same]
    assert common.startswith(SONNET_BASE_PROMPT)
    # The shared tokens are those of the common text up to its last whole prefix line.
    assert lengths.shared_prefix_tokens == counter.count(common[: common.rindex("\n") + 1])
    assert 550 <= lengths.shared_prefix_tokens <= 650
    assert lengths.text_prompt == [True] * 31
    random = request_lengths(cell().workload)
    assert random.shared_prefix_tokens == 0 and random.text_prompt == []


def test_sonnet_prompts_hit_a_prefix_cache_and_random_prompts_do_not(tmp_path):
    """With the engine's prefix caching on (V1's own default), a sonnet cell's requests after
    the first start past the cached prefix; a random cell's never do; with caching off, as
    the recipes run vLLM, the sonnet cell computes every prefix again."""
    from servematrix.engine.kvcache import BlockPool
    from servematrix.simulate import serve_or_refuse
    from servematrix.simulate.requests import Requests
    from servematrix.workload import TokenCounter, request_lengths

    sonnet = sonnet_cell(tmp_path)
    lengths = request_lengths(sonnet.workload, TokenCounter.approximate())
    served = serve_or_refuse("v1", 10_000, BlockPool(10_000), lengths)
    requests = Requests(lengths, served)
    setup = dataclasses.replace(
        engine_setup_of(sonnet),
        scheduler=dataclasses.replace(engine_setup_of(sonnet).scheduler, prefix_caching=True),
    )

    def first_chunks(reqs, count) -> list[int]:
        instance = setup.instance(0)
        computed = []
        for k in range(count):
            request = reqs.new(k)
            instance.scheduler.add(request)  # straight to the engine, past the API server
            step = instance.scheduler.schedule()
            computed.append(step.new_tokens[0])
            instance.scheduler.complete(step)
            while instance.has_work():
                instance.step()
        return computed

    hit = (lengths.shared_prefix_tokens // 16) * 16
    computed = first_chunks(requests, 3)
    assert computed[0] == min(lengths.input_lens[0], 2048)
    assert computed[1:] == [lengths.input_lens[1] - hit, lengths.input_lens[2] - hit]
    random_lengths = request_lengths(
        with_workload(sonnet, dataset="random", dataset_path=None, prefix_len=0).workload
    )
    random_served = serve_or_refuse("v1", 10_000, BlockPool(10_000), random_lengths)
    assert first_chunks(Requests(random_lengths, random_served), 3) == [1024] * 3

    # End to end: the simulator with caching on answers sonnet prompts sooner.
    off = ttft_ms(simulate(sonnet))
    on = ttft_ms(
        simulate(dataclasses.replace(sonnet, serving=Serving(10_000, 0.8, prefix_caching=True)))
    )
    assert on.mean() < 0.6 * off.mean()


def engine_setup_of(c: Cell):
    from servematrix.simulate import engine_setup

    return engine_setup(c)


def v1_disaggregated_cells() -> list[Cell]:
    """V1 disaggregated cells the pipelined driver runs: busy and idle instances, long and
    varied outputs (decode runs), everything at once, and a pool tight enough to preempt."""
    tcp, rdma = cell("mooncake-tcp", "v1", qps=8, n=300), cell("mooncake-rdma", "v1", n=200)
    return [
        tcp,
        with_workload(tcp, output_len=40, range_ratio=0.5, seed=3),
        with_workload(rdma, qps=0.5, output_len=20),
        with_workload(rdma, qps=float("inf"), num_prompts=80),
        dataclasses.replace(tcp, engine={**tcp.engine, "jitter_cv": 0.05}),
        tight_kv_cell("mooncake-tcp", "v1"),
    ]


@pytest.mark.parametrize("index", range(6))
def test_v1_pipelined_driver_gives_the_one_queue_result(index):
    c = v1_disaggregated_cells()[index]
    assert simulate(c, one_queue=True) == simulate(c)


def test_an_order_tie_in_the_pipelined_driver_reruns_the_cell_on_one_queue(monkeypatch):
    c = v1_disaggregated_cells()[1]
    expected = simulate(c)

    class EveryTime(set):
        def __contains__(self, time):  # every decoder event meets an upstream one
            return True

    monkeypatch.setattr(simulate_v1.UpstreamRecording, "times", lambda self: EveryTime())
    drivers = []

    class Recorded(simulate_module.Disaggregated):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            drivers.append(self.pipelined)

    monkeypatch.setattr(simulate_module, "Disaggregated", Recorded)
    assert simulate(c) == expected
    assert drivers == [True, False]  # the pipelined pass gave up, one queue ran the cell


def test_a_cells_objects_end_in_the_oldest_generation_without_a_scan():
    assert gc.isenabled() and not gc.get_freeze_count()
    records = simulate(cell(n=500)).records
    assert gc.isenabled() and not gc.get_freeze_count()
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert id(records[0]) in oldest and id(records[-1].chunk_s) in oldest


def test_objects_the_process_froze_stay_frozen():
    marker = [object()]
    gc.freeze()
    try:
        simulate(cell(n=50))
        assert gc.isenabled() and gc.get_freeze_count()  # gc.unfreeze would empty it
        assert not any(obj is marker for obj in gc.get_objects())  # still frozen
    finally:
        gc.unfreeze()


def test_given_send_times_replace_the_seeded_schedule():
    c = cell(qps=4.0, n=5)
    sends = [0.0, 0.05, 0.05, 1.0, 2.5]
    records = [r for r in simulate(c, send_times_s=sends).records if not r.warmup]
    assert [r.sent_s for r in records] == pytest.approx(sends)
    seeded = [r.sent_s for r in simulate(c).records if not r.warmup]
    assert seeded != pytest.approx(sends)


@pytest.mark.parametrize(
    ("sends", "message"),
    [
        ([0.0, 1.0], "has 2 times for a workload of 5 requests"),
        ([0.0, 1.0, 0.5, 2.0, 3.0], "non-decreasing"),
        ([0.0, 1.0, float("nan"), 2.0, 3.0], "finite"),
    ],
)
def test_given_send_times_are_checked(sends, message):
    with pytest.raises(ValueError, match=message):
        simulate(cell(n=5), send_times_s=sends)
