"""Scheduler behaviour on small hand-checked cases (V0 prefill-first, V1 decode-first)."""

from __future__ import annotations

import pytest

from servematrix.engine.kvcache import BlockPool, KvOffload
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


@pytest.mark.parametrize("policy", ["prefill_first", "decode_first"])
def test_a_preempted_request_is_readmitted_and_finishes_without_prefix_caching(policy):
    """Recompute preemption in both policies: the victim waits at the head of the queue, is
    prefilled again over its prompt and the tokens it had generated, and finishes with every
    token, counted once; the pool is whole again at the end."""
    s = make(policy=policy, chunked=policy == "decode_first", blocks=4, budget=64)
    a, b = Request(0, 32, 10), Request(1, 32, 10)
    s.add(a)
    s.add(b)
    emitted: dict[int, int] = {0: 0, 1: 0}
    recomputed = []
    while s.has_work():
        step = s.schedule()
        for request, new in zip(step.requests, step.new_tokens, strict=True):
            if request is b and b.num_preemptions and new > 1:
                recomputed.append(new)
        for request in s.complete(step)[0]:
            emitted[request.request_id] += 1
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert not s.pool.retained  # without prefix caching nothing of the victim stays
    assert emitted == {0: 10, 1: 10}
    assert b.num_generated == b.max_tokens and recomputed[0] > b.prompt_tokens
    assert s.pool.free_blocks == s.pool.num_blocks


def test_finished_requests_free_their_blocks():
    s = make()
    r = decoding(s, 0, prompt=20, max_tokens=2)
    _, finished = s.complete(s.schedule())
    assert finished == [r] and s.pool.free_blocks == s.pool.num_blocks and not s.has_work()


def test_request_larger_than_the_pool_is_rejected():
    s = make(blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(Request(0, 100, 4))


# --- Automatic prefix caching (V1) -------------------------------------------------------------


def cached(budget=2048, blocks=10_000, caching=True, offload=None) -> Scheduler:
    config = SchedulerConfig("decode_first", True, budget, 256, 0.0, True, prefix_caching=caching)
    return Scheduler(config, BlockPool(blocks, offload=offload))


def run_to_end(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        scheduler.complete(scheduler.schedule())


def conserved(scheduler: Scheduler) -> bool:
    """Every block is free, held by a request, or held by the prefix cache."""
    pool = scheduler.pool
    held = sum(r.num_blocks - r.shared_blocks for r in [*scheduler.running, *scheduler.waiting])
    return pool.free_blocks + held + sum(pool.cached_blocks.values()) == pool.num_blocks


def test_v1_caches_prefixes_by_default_and_v0_does_not():
    assert scheduler_config("v1", None, 10_000, "A100-SXM4-80GB").prefix_caching
    assert not scheduler_config("v0", None, 10_000, "A100-SXM4-80GB").prefix_caching


def test_a_shared_prefix_hits_the_cache_and_random_prompts_do_not():
    s = cached()
    first = Request(0, 400, 2, prefix_chain=(7,), prefix_tokens=200)
    s.add(first)
    assert s.schedule().new_tokens == [400]  # nothing cached yet: the whole prompt
    run_to_end(s)
    assert s.pool.cached_blocks == {7: 200 // 16} and conserved(s)
    same = Request(1, 400, 2, prefix_chain=(7,), prefix_tokens=200)
    other = Request(2, 400, 2, prefix_chain=(8,), prefix_tokens=200)
    random = Request(3, 400, 2)
    for request in (same, other, random):
        s.add(request)
    step = s.schedule()
    # 12 full blocks (192 tokens) of the 200-token prefix are cached; the rest is computed.
    assert step.requests == [same, other, random]
    assert step.new_tokens == [400 - 192, 400, 400]
    assert same.num_computed == 192 and same.shared_blocks == 12
    run_to_end(s)
    assert conserved(s)


def test_without_prefix_caching_a_shared_prefix_is_computed_again():
    s = cached(caching=False)
    s.add(Request(0, 400, 2, prefix_chain=(7,), prefix_tokens=200))
    run_to_end(s)
    s.add(Request(1, 400, 2, prefix_chain=(7,), prefix_tokens=200))
    assert s.schedule().new_tokens == [400] and not s.pool.cached_blocks


def test_at_least_the_last_prompt_token_is_computed():
    s = cached()
    s.add(Request(0, 64, 2, prefix_chain=(1,), prefix_tokens=64))
    run_to_end(s)
    s.add(Request(1, 64, 2, prefix_chain=(1,), prefix_tokens=64))
    assert s.schedule().new_tokens == [16]  # 3 of the 4 blocks hit: vLLM recomputes the last


def test_a_preempted_request_is_readmitted_past_the_cached_prefix_and_finishes():
    # 32 blocks: the cached prefix (20) leaves 12 for two requests growing to 7 own blocks each.
    s = cached(budget=4096, blocks=32)
    s.add(Request(0, 320, 1, prefix_chain=(3,), prefix_tokens=320))
    run_to_end(s)
    assert s.pool.cached_blocks == {3: 20}
    a = Request(1, 330, 100, prefix_chain=(3,), prefix_tokens=320)
    b = Request(2, 330, 100, prefix_chain=(3,), prefix_tokens=320)
    s.add(a)
    s.add(b)
    preempted: list[Request] = []
    readmitted_new: list[int] = []
    while s.has_work():
        step = s.schedule()
        preempted += step.preempted
        for request, new in zip(step.requests, step.new_tokens, strict=True):
            if request in preempted and request.num_generated and new > 1:
                readmitted_new.append(new)
        assert conserved(s)
        s.complete(step)
    victim = preempted[0]
    assert victim.num_preemptions >= 1 and victim.num_generated == victim.max_tokens
    # As V1's exported counters: the victim's lookups after its preemption are not counted.
    assert s.prefix_queries_tokens == 320 + 330 + 330
    assert s.prefix_hits_tokens == 320 + 320  # a and b: the 20 cached blocks
    # Recomputed after preemption: prompt + generated tokens beyond the 20 cached blocks.
    assert readmitted_new and all(new < victim.prompt_tokens for new in readmitted_new)
    assert conserved(s)


def test_a_preempted_request_hits_the_blocks_it_left_cached_when_readmitted():
    """With prefix caching, V1 frees a victim's blocks with their hashes: allocations take the
    other free blocks first and then the victim's from its tail; what is left of them is a hit
    when the victim is admitted again. A failed admission attempt takes nothing."""
    s = cached(blocks=4, budget=64)
    a, b = Request(0, 32, 10), Request(1, 32, 10)
    s.add(a)
    s.add(b)
    s.complete(s.schedule())  # both prefilled: 2 + 2 blocks
    step = s.schedule()  # a's decode needs a third block: b is preempted, 2 blocks computed
    assert step.preempted == [b]
    # The pool was full, so a's new block is one of b's 2, taken from its tail; 1 stays cached.
    assert s.pool.retained == {1: 1} and s.pool.retained_blocks == 1
    s.complete(step)
    step = s.schedule()  # b would need 3 blocks (its 33 tokens), 1 is free: not admitted
    assert step.requests == [a] and b.num_computed == 0 and s.pool.retained == {1: 1}
    s.complete(step)
    readmitted: list[int] = []
    while s.has_work():
        step = s.schedule()
        readmitted += [new for r, new in zip(step.requests, step.new_tokens, strict=True) if r is b]
        s.complete(step)
    assert readmitted[0] == 33 - 16  # its first block was a hit: prompt + 1 generated - 16
    assert b.num_generated == b.max_tokens and not s.pool.retained
    assert s.pool.free_blocks == s.pool.num_blocks


def test_retained_blocks_go_oldest_preemption_first_each_from_its_tail():
    pool = BlockPool(10)
    assert pool.allocate(10)
    pool.free(6)
    pool.retain(1, 3)
    pool.retain(2, 3)
    assert pool.allocate(2)  # the 6 free blocks are all retained: 2 of the oldest go
    assert (pool.retained, pool.retained_blocks) == ({1: 1, 2: 3}, 4)
    assert pool.allocate(2)
    assert (pool.retained, pool.retained_blocks) == ({2: 2}, 2)
    pool.take_retained(2)
    assert (pool.retained, pool.retained_blocks, pool.free_blocks) == ({}, 0, 2)


def test_an_unused_cached_prefix_is_evicted_when_blocks_run_out():
    s = cached(blocks=30)
    s.add(Request(0, 320, 1, prefix_chain=(3,), prefix_tokens=320))
    run_to_end(s)
    assert s.pool.cached_blocks == {3: 20} and s.pool.free_blocks == 10
    big = Request(1, 400, 2)  # 25 blocks: only after evicting the unused prefix
    s.add(big)
    assert s.schedule().requests == [big]
    assert not s.pool.cached_blocks and conserved(s)


def test_a_chain_hits_the_segments_an_earlier_request_computed_up_to_the_first_miss():
    # Segments of 2 blocks (32 tokens): a conversation whose second turn extends the first.
    s = cached()
    first = Request(0, 96, 1, prefix_chain=(1, 2, 3), prefix_tokens=96, prefix_segment_blocks=2)
    s.add(first)
    run_to_end(s)
    assert s.pool.cached_blocks == {1: 2, 2: 2, 3: 2} and conserved(s)
    turn = Request(1, 160, 1, prefix_chain=(1, 2, 3, 4, 5), prefix_tokens=160)
    turn.prefix_segment_blocks = 2
    branch = Request(2, 96, 1, prefix_chain=(1, 6, 3), prefix_tokens=96, prefix_segment_blocks=2)
    s.add(turn)
    s.add(branch)
    step = s.schedule()
    assert step.new_tokens == [160 - 96, 96 - 32]  # all three segments; then the first only
    assert s.prefix_queries_tokens == 96 + 160 + 96 and s.prefix_hits_tokens == 96 + 32
    run_to_end(s)
    # The turn's new segments and the branch's own one are cached too (the branch's key 3 is
    # another chain's: it stays the branch's own copy).
    assert s.pool.cached_blocks == {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2} and conserved(s)
    assert not any(s.pool.prefix_users.values())


def test_eviction_takes_the_least_recently_used_segment_first():
    s = cached(blocks=20)  # 3 prefixes of 4 blocks cached, 8 free
    for k, key in enumerate((1, 2, 3)):
        s.add(Request(k, 64, 1, prefix_chain=(key,), prefix_tokens=64))
        run_to_end(s)
    s.add(Request(3, 64, 1, prefix_chain=(1,), prefix_tokens=64))  # 1 used again: newest
    run_to_end(s)
    assert list(s.pool.cached_blocks) == [2, 3, 1]
    s.add(Request(4, 150, 1))  # 10 blocks: evicts key 2 only
    s.schedule()
    assert list(s.pool.cached_blocks) == [3, 1] and conserved(s)


def test_a_prefix_the_gpu_evicted_is_loaded_back_from_the_cpu_tier():
    """--kv-offloading-size: the evicted prefix's 20 blocks come back from host memory (their
    load time on the request) instead of being recomputed; without the tier they are not."""
    for offload, new_tokens, load_ms in ((None, 330, 0.0), (KvOffload(64, 0.05), 10, 1.0)):
        s = cached(blocks=30, offload=offload)
        s.add(Request(0, 320, 1, prefix_chain=(3,), prefix_tokens=320))
        run_to_end(s)
        s.add(Request(1, 400, 2))  # 25 blocks: evicts the unused prefix from the GPU
        run_to_end(s)
        assert not s.pool.cached_blocks
        again = Request(2, 330, 2, prefix_chain=(3,), prefix_tokens=320)
        s.add(again)
        assert s.schedule().new_tokens == [new_tokens]
        assert again.load_ms == pytest.approx(load_ms)
        run_to_end(s)
        assert conserved(s)


def test_the_cpu_tier_keeps_the_most_recently_used_prefixes_it_has_room_for():
    s = cached(offload=KvOffload(40, 0.05))
    for group in (1, 2, 3):  # 20 blocks each: the tier holds two
        s.add(Request(group, 320, 1, prefix_chain=(group,), prefix_tokens=320))
        run_to_end(s)
    assert dict(s.pool.cpu.blocks) == {2: 20, 3: 20}
    assert s.pool.reset_prefix_cache() and not s.pool.cpu.blocks
