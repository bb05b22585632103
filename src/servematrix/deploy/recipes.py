"""Recipes: (model, mode, recipe, backend) -> the processes of a deployment, as data.

A recipe is a table of argv segments, each kept or dropped by a named condition of the mode
(aggregated, disaggregated, chunked prefill on/off, ...). The segments reproduce, token for
token, the command lines of ``shared/reference/vllm-mooncake-spec.md`` §4 (v0: the published
vLLM 0.6 studies; v1: current vLLM with the in-tree MooncakeConnector); each version's table is
its ``commands`` in ``servematrix.recipes``. What servematrix adds
to those lines always comes *after* them, so the published line stays a prefix of ours:

* ``--host H`` (services bind 127.0.0.1 unless ``deploy.host`` says otherwise, or their
  node's address with ``deploy.nodes``: :mod:`servematrix.deploy.nodes`; vLLM's own default is
  every interface);
* ``--max-num-batched-tokens N`` / ``--enforce-eager`` when the config sets them;
* for backend ``emulator`` the emulator-only flags (:data:`EMULATOR_FLAGS`), which describe
  the simulated hardware and model that vLLM would learn from the GPU and the checkpoint.

For backend ``emulator`` the executable part (``vllm serve`` or
``python3 -m vllm.entrypoints.openai.api_server``) is replaced by ``servematrix-emulator serve``;
every other token, the environment and the ports are identical to backend ``vllm`` (a config's
``engine.kv_link`` overrides of the modelled KV link reach emulator instances as
``SERVEMATRIX_EMULATOR_KV_LINK``; ``engine.kv_buffer_size`` is the v0 ``kv_buffer_size`` of both).

Argv lists only: nothing here builds a shell string from config values (the dry run quotes
them for display with :func:`shlex.join`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servematrix.deploy import nodes
from servematrix.deploy.layout import Slot, slots
from servematrix.deploy.mooncake import MOONCAKE_DECODE_OFFSET, etcd, mooncake_json, mooncake_ports
from servematrix.deploy.nodes import Place
from servematrix.deploy.processes import Health, Plan, Process, fingerprint
from servematrix.engine.hardware import DEFAULT_GPU
from servematrix.recipes import RECIPE_VERSIONS
from servematrix.recipes.base import Recipe
from servematrix.spec.matrix import Cell

EMULATED_BACKEND = "emulator"  # vLLM's deployment with the emulator in vLLM's place
DEPLOYED_BACKENDS = ("vllm", EMULATED_BACKEND)  # the registry's DEPLOYS (tests/test_backends.py)
EMULATOR_EXECUTABLE = ("servematrix-emulator", "serve")
EMULATOR_KV_LINK_ENV = "SERVEMATRIX_EMULATOR_KV_LINK"
PROXY_EXECUTABLE = ("python3", "-m", "servematrix.proxy")
RECIPES: dict[str, Recipe] = {name: v.commands for name, v in RECIPE_VERSIONS.items()}
"""The command lines of each recipe version (``servematrix.recipes``)."""

EMULATOR_FLAGS = (
    "--gpu",
    "--recipe",
    "--seed",
    "--architecture",
    "--modelled-quantization",
    "--jitter-cv",
    "--straggler-probability",
    "--step-time-profile",
)
"""Appended for backend ``emulator`` only (see :func:`emulator_flags`): what vLLM learns from
the GPU and the checkpoint, told to the emulator (the config's architecture, so a model of
one's own is served as the simulator models it, not resolved from its ``hf_id``)."""

DEFAULT_PORTS = {
    "proxy": 8090,
    "prefill": 8100,
    "decode": 8200,
    "single": 8997,
    "etcd": 2379,
    "bootstrap": 8998,
    "mooncake": 13003,
}
DEFAULT_DEPLOY = {
    "host": "127.0.0.1",
    "kv_host": "127.0.0.1",
    "rdma_device": "",
    "startup_timeout_s": 1200.0,
    "stop_timeout_s": 30.0,
    "idle_timeout_s": 600.0,
    "gpu_lock_timeout_s": 86400.0,
    "warm": True,
    "state_dir": None,
    "base_url": None,
}


def _conditions(cell: Cell, executable: tuple[str, ...]) -> dict[str, bool]:
    mode = cell.mode
    positional = executable[-1] == "serve"  # `vllm serve M`; the module form takes --model M
    return {
        "model_positional": positional,
        "model_flag": not positional,
        "aggregated": not mode.disaggregated,
        "disaggregated": mode.disaggregated,
        "chunked_on": mode.chunked_prefill is True,
        "chunked_off": mode.chunked_prefill is False,
        "prefix_caching_on": cell.serving.prefix_caching,
        "prefix_caching_off": not cell.serving.prefix_caching,
    }


def _fill(template: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(template, str):
        return template.format(**values)
    if isinstance(template, Mapping):
        return {k: _fill(v, values) for k, v in template.items()}
    return template


def _kv_json(config: Mapping[str, Any], buffer_size: str) -> str:
    """The flag's JSON exactly as the published lines spell it (compact; 2e9 unquoted)."""
    text = json.dumps(config, separators=(",", ":"))
    return text.replace(f'"{buffer_size}"', buffer_size)


def _scientific(value: float) -> str:
    """2e9 -> '2e9', 1.5e9 -> '1.5e9': bytes as the published kv_buffer_size spells them."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _number(value: float) -> str:
    return f"{value:g}"


def _architecture_argument(architecture: str) -> str:
    """A shipped name as is; a local file or a Hub id as its config.json's absolute path
    (the emulator runs in the deployment's directory, and needs no Hub look-up)."""
    from servematrix.engine.architecture import resolve_config_json, shipped

    if architecture in shipped():
        return architecture
    return str(resolve_config_json(architecture).resolve())


def emulator_flags(cell: Cell) -> list[str]:
    """What vLLM learns from the host (the GPU) or its own defaults, told to the emulator."""
    engine = dict(cell.engine)
    flags = [
        "--gpu",
        str(engine.get("gpu", DEFAULT_GPU)),
        "--recipe",
        cell.recipe,
        "--seed",
        str(cell.workload.seed),
        "--architecture",
        _architecture_argument(cell.model.architecture),
        "--modelled-quantization",
        cell.model.quantization,
    ]
    for key in ("jitter_cv", "straggler_probability"):
        if key in engine:
            flags += [f"--{key.replace('_', '-')}", _number(float(engine[key]))]
    if engine.get("profile"):
        # Absolute: the emulator runs in the deployment's directory.
        flags += ["--step-time-profile", str(Path(engine["profile"]).resolve())]
    if "api_server_apart" in engine:
        flags.append(f"--{'' if engine['api_server_apart'] else 'no-'}api-server-apart")
    return flags


def server_command(recipe: Recipe, cell: Cell) -> tuple[str, ...]:
    """What starts a vLLM server: ``deploy.server_command`` (``~`` expanded), else the
    recipe's own executable."""
    command = cell.deploy.get("server_command")
    if not command:
        return recipe.executable
    return (os.path.expanduser(command[0]), *command[1:])


def node_kind(cell: Cell) -> str:
    """``gpu`` (the default) or ``cpu`` (config ``node.kind``): what the pins name."""
    return str((cell.deploy.get("node") or {}).get("kind", "gpu"))


def api_server_cores(cell: Cell) -> tuple[int, ...]:
    """A CPU node's ``node.api_server_cores`` (empty: unset, or a GPU node)."""
    return tuple((cell.deploy.get("node") or {}).get("api_server_cores") or ())


def cpu_bind(cores: tuple[int, ...], tensor_parallel: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an instance's cores: ranges per tensor-parallel rank,
    ranks separated by ``|`` (vLLM's format, e.g. ``0-3|4-7``)."""
    per_rank = max(1, len(cores) // tensor_parallel)
    ranks = [sorted(cores[i : i + per_rank]) for i in range(0, len(cores), per_rank)]
    return "|".join(_ranges(rank) for rank in ranks)


def _ranges(cores: list[int]) -> str:
    parts: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def _server_argv(recipe: Recipe, cell: Cell, emulated: bool, slot: Slot, host: str) -> list[str]:
    command = server_command(recipe, cell)
    # The emulator takes the model where the recipe's own executable does.
    conditions = _conditions(cell, recipe.executable if emulated else command)
    values: dict[str, Any] = {
        "model": cell.model.hf_id,
        "port": slot.port,
        "tp": slot.tp,
        "max_model_len": cell.serving.max_model_len,
        "gpu_memory_utilization": _number(cell.serving.gpu_memory_utilization),
        "protocol": cell.mode.kv_protocol,
        # engine.kv_buffer_size: the v0 producer's lookup buffer, for vLLM and the emulator alike
        "kv_buffer_size": _scientific(float(cell.engine.get("kv_buffer_size", 2e9))),
    }
    if slot.kv_role is not None:
        config = _fill(recipe.kv_transfer_config[slot.kv_role], values)
        values["kv_transfer_config"] = _kv_json(config, values["kv_buffer_size"])
    argv = list(EMULATOR_EXECUTABLE if emulated else command)
    for segment in recipe.args:
        if segment.when is None or conditions[segment.when]:
            argv += [token.format(**values) for token in segment.tokens]
    argv += ["--host", host]
    if cell.serving.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cell.serving.max_num_batched_tokens)]
    if cell.serving.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(cell.serving.max_num_seqs)]
    if cell.serving.kv_offloading_gib is not None:
        size = f"{cell.serving.kv_offloading_gib:g}"
        argv += ["--kv-offloading-size", size, "--kv-offloading-backend", "native"]
    if cell.serving.enforce_eager:
        argv.append("--enforce-eager")
    if emulated:
        argv += emulator_flags(cell)
    return argv


def _settings(cell: Cell) -> tuple[dict[str, int], dict[str, Any]]:
    deploy = {**DEFAULT_DEPLOY, **dict(cell.deploy)}
    ports = {**DEFAULT_PORTS, **dict(deploy.get("ports") or {})}
    return ports, deploy


def _server(cell: Cell, emulated: bool, slot: Slot) -> Process:
    """One vLLM (or emulator) instance: its argv, environment, pins and extra ports."""
    recipe = RECIPES[cell.recipe]
    ports, deploy = _settings(cell)
    env: dict[str, str] = {}
    extra: tuple[int, ...] = ()
    tp, role, pins, port = slot.tp, slot.kv_role, slot.pins, slot.port
    if role is not None:
        values = {"bootstrap_port": slot.bootstrap}
        env.update({k: v.format(**values) for k, v in recipe.disaggregated_env.items()})
        if role == "kv_producer":
            env.update({k: v.format(**values) for k, v in recipe.producer_env.items()})
            if recipe.producer_env:
                extra = tuple(slot.bootstrap + rank for rank in range(tp))
        if recipe.etcd:
            base = ports["mooncake"] + (0 if role == "kv_producer" else MOONCAKE_DECODE_OFFSET)
            extra += mooncake_ports(base, tp)
    if emulated and role is not None and cell.engine.get("kv_link"):
        # engine.kv_link overrides of the modelled KV link (emulator only; vLLM has a wire)
        env[EMULATOR_KV_LINK_ENV] = json.dumps(dict(cell.engine["kv_link"]), sort_keys=True)
    if cell.serving.prefix_caching and recipe.prefix_cache_reset_env:
        env.update(recipe.prefix_cache_reset_env)
    if node_kind(cell) == "cpu":
        # vLLM's CPU build: the pins are cores, the KV cache is sized in GiB of host memory.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(pins, tp)
        env["VLLM_CPU_KVCACHE_SPACE"] = _number(float(cell.deploy["node"]["kvcache_space_gib"]))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in pins)
    where = nodes.place(deploy, slot.node)
    if where.node is not None:
        # The address vLLM advertises to its peers (the Mooncake side channel), not its guess.
        env["VLLM_HOST_IP"] = where.reach
    argv = _server_argv(recipe, cell, emulated, slot, where.bind)
    api_cores = () if emulated else api_server_cores(cell)  # the emulator is one process
    health = Health(where.url(port) + "/health")
    bind = None if where.node is None else where.bind
    return Process(
        slot.name, tuple(argv), env, port, health, pins, extra, bind, where.node, api_cores
    )


def _proxy(cell: Cell, instances: list[Slot], ports: Mapping[str, int]) -> Process:
    """The proxy in front of the instances: round-robin over them all, or the recipe's
    disaggregated one over the lists of prefillers and decoders, each named by its node."""
    deploy = _settings(cell)[1]

    def url(slot: Slot) -> str:
        return nodes.place(deploy, slot.node).url(slot.port)

    argv = [*PROXY_EXECUTABLE]
    if not cell.mode.disaggregated:
        argv.append("round-robin")
        for slot in instances:
            argv += ["--upstream", url(slot)]
    else:
        kind = RECIPES[cell.recipe].disagg_proxy
        argv.append(kind)
        for slot in instances:
            if slot.kv_role == "kv_producer":
                argv += ["--prefill", url(slot)]
                argv += [str(slot.bootstrap)] if kind == "disagg-v1" else []
        for slot in instances:
            if slot.kv_role == "kv_consumer":
                argv += ["--decode", url(slot)]
    where = nodes.entry(deploy)
    argv += ["--port", str(ports["proxy"]), "--host", where.bind]
    health = Health(where.url(ports["proxy"]) + "/health")
    bind = None if where.node is None else where.bind
    return Process("proxy", tuple(argv), {}, ports["proxy"], health, (), (), bind, where.node)


def _mooncake_places(deploy: Mapping[str, Any], instances: list[Slot]) -> dict[str, Place]:
    """Where the v0 deployment's prefill, decode and etcd run (named 1P1D modes only)."""
    kinds = {"kv_producer": "prefill", "kv_consumer": "decode"}
    places = {kinds[s.kv_role]: nodes.place(deploy, s.node) for s in instances if s.kv_role}
    return {**places, "etcd": nodes.entry(deploy)}


def plan(cell: Cell, backend: str | None = None) -> Plan:
    """The deployment a cell needs on ``backend`` (default: the cell's own)."""
    backend = backend or cell.backend
    if backend not in DEPLOYED_BACKENDS:
        raise ValueError(f"backend {backend!r} starts no deployment")
    emulated = backend == EMULATED_BACKEND
    recipe = RECIPES[cell.recipe]
    ports, deploy = _settings(cell)
    mode = cell.mode
    instances = slots(cell, ports)
    files: dict[str, str] = {}
    processes: list[Process] = []
    if len(instances) == 1:
        processes.append(_server(cell, emulated, instances[0]))
        entry = ports["single"]
    else:
        if mode.disaggregated and recipe.etcd:
            places = _mooncake_places(deploy, instances)
            processes.append(etcd(places["etcd"], ports["etcd"]))
            files["mooncake.json"] = mooncake_json(mode.kv_protocol, ports, deploy, places)
        processes += [_server(cell, emulated, slot) for slot in instances]
        processes.append(_proxy(cell, instances, ports))
        entry = ports["proxy"]
    return Plan(
        backend=backend,
        recipe=recipe.name,
        model=cell.model.name,
        mode=mode.name,
        processes=tuple(processes),
        base_url=nodes.entry(deploy).url(entry) + "/v1",
        fingerprint=fingerprint(backend, recipe.name, processes, files),
        files=files,
    )
