"""A window of the Mooncake conversation trace replayed on real vLLM with prefix caching on: the
prompts share token ids exactly where the trace's hash ids do, so vLLM's own prefix cache hits
them, and its reported hit rate stands beside the best the window allows."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from tests.conftest import ROOT
from tests.vllm.conftest import marked_processes, run_cell, vllm_config
from tests.workflow_helpers import copy_workflow

TRACE = ROOT / "config" / "examples" / "data" / "mooncake-conversation-1000.jsonl"


def test_a_trace_window_hits_vllms_prefix_cache_as_the_trace_allows(vllm_cpu, tmp_path):
    _, model = vllm_cpu
    cfg = vllm_config(model, ["single"], [4], num_prompts=12, state_dir=tmp_path / "state")
    cfg["defaults"].update(
        dataset="mooncake", dataset_path=str(TRACE), warmup_requests=0, prefix_caching=True
    )
    cfg["studies"]["cpu"]["input_len"] = [2000]  # the window's requests within the context
    copy_workflow(tmp_path, cfg)
    cell, result, mark = run_cell(tmp_path, cfg, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert marked_processes(mark) == []
    table = pq.read_table(tmp_path / cell)
    assert all(table.column("success").to_pylist())
    reuse = json.loads(next(iter(table.schema.metadata.values())))["prefix_cache"]
    served = reuse["hits_tokens"] / reuse["queries_tokens"]
    best = reuse["best_hits_tokens"] / reuse["best_queries_tokens"]
    print(f"\nvLLM prefix-cache hit rate {served:.2%} of a possible {best:.2%}: {reuse}")
    assert reuse["queries_tokens"] == reuse["best_queries_tokens"]  # every prompt token looked up
    assert reuse["best_hits_tokens"] > 0
    # vLLM hits whole blocks of its own size inside the trace's shared 512-token blocks: at most
    # the bound, and nearly all of it with a cache that never evicts here (1 GiB of KV).
    assert 0.8 * reuse["best_hits_tokens"] <= reuse["hits_tokens"] <= reuse["best_hits_tokens"]
