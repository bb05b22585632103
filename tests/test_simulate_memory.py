"""Modelled memory: the simulator's exact KV peak and layout, and the emulator's same layout."""

from __future__ import annotations

import dataclasses
import http.server
import threading

import pytest

from servematrix.backends import simulator
from servematrix.backends.emulator import modelled_layout
from servematrix.deploy.memory import sampled
from servematrix.deploy.processes import Health, Plan, Process
from servematrix.deploy.recipes import plan
from servematrix.emulator import cli as emulator_cli
from servematrix.engine.hardware import gpu_spec
from servematrix.engine.kvcache import BlockPool
from servematrix.simulate import simulate
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload

GPTQ_7B = ModelSpec(
    "Qwen2.5-7B-Instruct-GPTQ-Int4",
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-7b",
    "gptq-int4",
    1,
    ((0,), (4,)),
)
A100_MIB = gpu_spec("A100-SXM4-80GB").memory_gib * 1024


def cell(qps: float, mode: str = "single", recipe: str = "v0", util: float = 0.8) -> Cell:
    return Cell(
        backend="simulator",
        recipe=recipe,
        model=GPTQ_7B,
        mode=MODES[mode],
        workload=Workload(qps, 2048, 256, 120, 0, "random", 1.0, 1),
        serving=Serving(10_000, util),
        engine={"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0},
    )


def test_pool_peak_is_the_most_blocks_ever_in_use() -> None:
    pool = BlockPool(100)
    assert pool.peak_used_blocks == 0
    assert pool.allocate(30) and pool.allocate(20)
    pool.free(40)
    assert pool.allocate(25)
    assert (pool.used_blocks, pool.peak_used_blocks) == (35, 50)
    assert pool.allocate(65) and not pool.allocate(1)
    assert pool.peak_used_blocks == 100


def test_peak_kv_usage_is_a_share_of_the_pool_and_grows_with_load() -> None:
    peaks = []
    for qps in (1.0, 8.0, 32.0):
        memory_use = simulator.run(cell(qps)).deployment["memory"]
        usage = memory_use["peak_kv_cache_usage"]
        assert 0 < usage <= 1
        [blocks] = memory_use["peak_kv_blocks"]
        assert usage == blocks / memory_use["kv_pool_blocks"]
        peaks.append(usage)
    assert peaks[0] < peaks[1] < peaks[2], peaks


def test_a_small_pool_is_filled_but_never_exceeded() -> None:
    """At a low gpu_memory_utilization the pool holds fewer than the 120 requests of 144
    blocks each: the load fills it completely (and preempts), and usage stops at 1."""
    memory_use = simulator.run(cell(64.0, util=0.2)).deployment["memory"]
    assert memory_use["kv_pool_blocks"] < 120 * 144
    assert memory_use["peak_kv_cache_usage"] == 1.0


def test_simulator_reports_the_modelled_layout() -> None:
    c = cell(4.0)
    memory_use = simulator.run(c).deployment["memory"]
    kv = simulate(c).kv
    assert memory_use["gpu_memory_source"] == "modelled (A100-SXM4-80GB, gpu_memory_utilization)"
    assert memory_use["peak_gpu_memory_mib"] == pytest.approx(A100_MIB * 0.8, abs=0.1)
    assert memory_use["weights_mib_per_gpu"] == pytest.approx(kv.weights_gib * 1024, abs=0.1)
    assert memory_use["kv_pool_mib_per_gpu"] == pytest.approx(kv.kv_cache_gib * 1024, abs=0.1)
    assert memory_use["kv_pool_blocks"] == kv.num_blocks
    assert memory_use["kv_block_size_tokens"] == 16
    # weights + KV pool fit inside the claim (activations and runtime reserve take the rest)
    total = memory_use["weights_mib_per_gpu"] + memory_use["kv_pool_mib_per_gpu"]
    assert 0.8 * memory_use["peak_gpu_memory_mib"] < total < memory_use["peak_gpu_memory_mib"]


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_disaggregated_peaks_per_instance(recipe: str) -> None:
    memory_use = simulator.run(cell(8.0, "mooncake-tcp", recipe)).deployment["memory"]
    prefill, decode = memory_use["peak_kv_blocks"]
    assert prefill > 0 and decode > 0
    assert memory_use["peak_kv_cache_usage"] == max(prefill, decode) / memory_use["kv_pool_blocks"]


@pytest.mark.parametrize(("mode", "recipe"), [("single", "v0"), ("mooncake-tcp", "v1")])
def test_emulator_layout_is_the_one_its_servers_build(
    mode: str, recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout the cell records for the emulator is the engine every emulated server of the
    deployment builds from its own argv and environment."""
    c = dataclasses.replace(cell(4.0, mode, recipe), backend="emulator")
    layout = modelled_layout(c)
    servers = [p for p in plan(c).processes if p.gpus]
    assert servers
    for process in servers:
        with monkeypatch.context() as env:
            for name, value in process.env.items():
                env.setenv(name, value)
            args = emulator_cli.parse_args(list(process.argv[1:]))
            model = emulator_cli.resolve_model(
                args.model, args.quantization, args.architecture, args.modelled_quantization
            )
            max_model_len = emulator_cli._max_model_len(args, model)
            setup = emulator_cli.engine_setup(args, model, max_model_len)
        assert layout["kv_pool_blocks"] == setup.kv.num_blocks, process.name
        assert layout["weights_mib_per_gpu"] == pytest.approx(setup.kv.weights_gib * 1024, abs=0.1)


class _MetricsOnly(http.server.BaseHTTPRequestHandler):
    """A server with vLLM's /metrics and nothing of the emulator's own routes."""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


def test_emulator_without_its_kv_route_falls_back_to_the_samples_and_says_why() -> None:
    """An instance that cannot say its exact peak (no /servematrix/kv_cache) leaves the
    sampled peak in place, with the reason, rather than failing the cell or hiding it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        process = Process("single", ("x",), {}, 0, Health(url + "/health"), (0,))
        deployment = Plan("emulator", "v1", "m", "single", (process,), url, "f")
        with sampled(
            deployment, real_gpus=False, modelled_gpu="A100-SXM4-80GB", gpu_memory_utilization=0.8
        ) as memory_use:
            pass
    finally:
        server.shutdown()
        server.server_close()
    assert memory_use["peak_kv_error"].startswith("HTTPError: HTTP Error 404")
    assert memory_use["peak_kv_cache_usage"] == 0.25
    assert "peak_kv_blocks" not in memory_use
