"""Scheduler behaviour on small hand-checked cases (V0 prefill-first, V1 decode-first)."""

from __future__ import annotations

import pytest

from servematrix.engine.kvcache import BlockPool
from servematrix.engine.scheduler import Request, Scheduler, SchedulerConfig, scheduler_config


def make(policy="decode_first", chunked=True, budget=2048, seqs=256, blocks=10_000, watermark=0.0):
    config = SchedulerConfig(policy, chunked, budget, seqs, watermark, policy == "decode_first")
    return Scheduler(config, BlockPool(blocks, watermark=watermark))


def decoding(scheduler: Scheduler, request_id: int, prompt: int = 100, max_tokens: int = 10):
    """Admit a request and run its prefill so it is decoding."""
    request = Request(request_id, prompt, max_tokens)
    scheduler.add(request)
    step = scheduler.schedule()
    scheduler.complete(step)
    assert request.num_generated == 1
    return request


def test_v0_and_v1_defaults_from_source():
    v0 = scheduler_config("v0", None, 10_000, "A100-SXM4-80GB")
    assert (v0.policy, v0.chunked_prefill, v0.max_num_batched_tokens) == (
        "prefill_first",
        False,
        10_000,
    )
    v0c = scheduler_config("v0", True, 10_000, "A100-SXM4-80GB")
    assert (v0c.policy, v0c.max_num_batched_tokens, v0c.max_num_seqs) == ("decode_first", 2048, 256)
    v1 = scheduler_config("v1", None, 10_000, "A100-SXM4-80GB")
    assert (v1.chunked_prefill, v1.max_num_batched_tokens, v1.max_num_seqs) == (True, 2048, 256)
    h100 = scheduler_config("v1", True, 10_000, "H100-SXM5-80GB")
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    plain = scheduler_config("v1", False, 10_000, "A100-SXM4-80GB")
    assert (plain.chunked_prefill, plain.max_num_batched_tokens) == (False, 10_000)


def test_chunked_budget_splits_the_second_prompt():
    s = make(budget=2048)
    a, b = Request(0, 1500, 4), Request(1, 1500, 4)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert step.new_tokens == [1500, 548]
    emitted, _ = s.complete(step)
    assert emitted == [a]  # b's prompt is not complete: no token yet
    step = s.schedule()
    assert step.requests == [a, b] and step.new_tokens == [1, 952]


def test_without_chunking_a_prompt_waits_for_room_in_the_budget():
    s = make(chunked=False, budget=2048)
    s.add(Request(0, 1500, 4))
    s.add(Request(1, 1500, 4))
    assert s.schedule().new_tokens == [1500]


def test_decode_first_mixes_decodes_with_a_new_prefill():
    s = make()
    running = decoding(s, 0)
    s.add(Request(1, 500, 4))
    step = s.schedule()
    assert step.requests[0] is running and step.new_tokens == [1, 500]


def test_prefill_first_runs_prefills_alone_then_decodes():
    s = make(policy="prefill_first", chunked=False, budget=10_000)
    running = decoding(s, 0)
    s.add(Request(1, 500, 4))
    s.add(Request(2, 600, 4))
    step = s.schedule()
    assert [r.request_id for r in step.requests] == [1, 2]  # no decode of request 0
    s.complete(step)
    step = s.schedule()
    assert step.requests[0] is running and step.new_tokens == [1, 1, 1]


def test_prefill_first_token_budget():
    s = make(policy="prefill_first", chunked=False, budget=10_000)
    for k in range(3):
        s.add(Request(k, 4000, 4))
    assert s.schedule().new_tokens == [4000, 4000]


def test_max_num_seqs_counts_running_requests():
    s = make(seqs=3)
    decoding(s, 0)
    for k in (1, 2, 3):
        s.add(Request(k, 10, 4))
    step = s.schedule()
    assert [r.request_id for r in step.requests] == [0, 1, 2]
    assert [r.request_id for r in s.waiting] == [3]


def test_admission_stops_when_blocks_run_out():
    s = make(blocks=10)  # 160 tokens
    s.add(Request(0, 100, 4))  # 7 blocks
    s.add(Request(1, 60, 4))  # 4 blocks: does not fit beside the first
    step = s.schedule()
    assert step.requests == [s.running[0]] and len(s.waiting) == 1
    assert s.pool.free_blocks == 3


def test_recompute_preemption_when_decode_growth_needs_a_block():
    s = make(blocks=4, budget=64)  # 64 tokens
    a = Request(0, 32, 10)  # fills 2 blocks exactly after its first decode
    b = Request(1, 32, 10)
    s.add(a)
    s.add(b)
    s.complete(s.schedule())  # both prefilled: 2 + 2 blocks, pool empty
    assert s.pool.free_blocks == 0
    step = s.schedule()  # a's decode needs a third block: b (last admitted) is preempted
    assert step.preempted == [b]
    assert step.requests == [a]
    assert b.num_computed == 0 and b.num_blocks == 0 and s.waiting[0] is b
    assert b.num_generated == 1  # its streamed token stays; it is prefilled again over 33 tokens
    s.complete(step)
    assert s.pool.free_blocks == 1


def test_finished_requests_free_their_blocks():
    s = make()
    r = decoding(s, 0, prompt=20, max_tokens=2)
    _, finished = s.complete(s.schedule())
    assert finished == [r] and s.pool.free_blocks == s.pool.num_blocks and not s.has_work()


def test_request_larger_than_the_pool_is_rejected():
    s = make(blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(Request(0, 100, 4))
