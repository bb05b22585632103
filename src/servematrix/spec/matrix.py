"""The matrix: the cells, studies and config a YAML file expands into, and their paths.

A cell is (backend, recipe, model, mode, workload) with its serving flags, a study a list of
cells, `Config` a validated config's studies. `servematrix.spec.config` builds them from the file; a
cell job rebuilds its `Cell` from the parameters alone (`Cell.from_dict`), without the YAML
parser or the schema. A cell's trace path is spelled here (`workload_token`, `cell_path`), with
the patterns that match the names in it (the rules' wildcard constraints).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servematrix.recipes import RECIPE_NAMES, recipe_version
from servematrix.spec.slo import Slo
from servematrix.spec.topology import Topology, parse
from servematrix.workload.definition import TRACE_DEFAULTS, Workload
from servematrix.workload.sessions import Sessions

RECIPES = RECIPE_NAMES
PREDICTING_BACKEND = "simulator"
"""The backend whose predictions a measured run is compared with
(`servematrix.reporting.compare`)."""


class ConfigError(ValueError):
    """A config problem, located by its key path (``studies.mooncake.qps[0]``).

    Raised by the loader (`servematrix.spec.config`) and by the lookups here (`Config.cell_at`).
    """

    def __init__(self, key_path: str, message: str):
        self.key_path = key_path
        super().__init__(f"config error at {key_path}: {message}")


@dataclass(frozen=True)
class ModeSpec:
    """How a mode is deployed: instance count, disaggregation and chunked prefill.

    ``chunked_prefill`` None means the recipe's default (off in vLLM 0.6, on in V1).
    ``topology`` is the spelling of a mode that is a topology (`topology_mode`); a named mode
    (`MODES`) leaves it None and is its instances at the model's tensor-parallel size
    (`Cell.topology`).
    """

    name: str
    instances: int
    disaggregated: bool
    chunked_prefill: bool | None
    kv_protocol: str | None = None
    topology: str | None = None


def topology_mode(topology: Topology, kv_protocol: str = "rdma") -> ModeSpec:
    """The mode that deploys a topology, named by its spelling (a disaggregated one moves KV
    over ``kv_protocol``)."""
    spelling = topology.spelling
    return ModeSpec(
        spelling,
        topology.instances,
        topology.disaggregated,
        None,
        kv_protocol if topology.disaggregated else None,
        spelling,
    )


MODES: dict[str, ModeSpec] = {
    "nondisagg": ModeSpec("nondisagg", 2, False, False),
    "chunked": ModeSpec("chunked", 2, False, True),
    "mooncake-rdma": ModeSpec("mooncake-rdma", 2, True, None, "rdma"),
    "mooncake-tcp": ModeSpec("mooncake-tcp", 2, True, None, "tcp"),
    "single": ModeSpec("single", 1, False, None),
    "single-plain": ModeSpec("single-plain", 1, False, False),
    "single-chunked": ModeSpec("single-chunked", 1, False, True),
}
"""The modes, in their canonical order (aggregated first); docs/configuration.md "Modes"
defines each."""


def mode_spec(name: str) -> ModeSpec:
    """A named mode (`MODES`), else the mode of the topology the name spells."""
    return MODES.get(name) or topology_mode(parse(name))


def chunks_prefill(recipe: str, chunked_prefill: bool | None, max_model_len: int) -> bool:
    """Whether the recipe's vLLM chunks prefills: the mode's choice, else its default (off in
    vLLM 0.6 unless ``max_model_len`` exceeds 32768, on in V1)."""
    if chunked_prefill is not None:
        return chunked_prefill
    version = recipe_version(recipe)
    above = version.auto_chunked_above_tokens
    return version.chunked_prefill_by_default or (above is not None and max_model_len > above)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_id: str
    architecture: str
    quantization: str
    tensor_parallel: int
    gpus: tuple[tuple[int, ...], ...]
    recipe: str | None = None


@dataclass(frozen=True)
class Serving:
    """Server flags shared by every instance of a deployment.

    ``max_num_batched_tokens`` None keeps the recipe's default (see
    ``servematrix.engine.scheduler.scheduler_config``); ``enforce_eager`` is vLLM's
    ``--enforce-eager`` (no CUDA graphs); ``prefix_caching`` is ``--enable-prefix-caching``
    (False: off in both recipes, for parity with the published vLLM 0.6 studies);
    ``max_num_seqs`` is ``--max-num-seqs`` (None: the recipe's default, 256, or 1024 for v1 on
    H100/H200); ``kv_offloading_gib`` is ``--kv-offloading-size`` (vLLM's native CPU KV
    offloading, GiB in all TP ranks; v1 only, None: off).
    """

    max_model_len: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    prefix_caching: bool = False
    max_num_seqs: int | None = None
    kv_offloading_gib: float | None = None


@dataclass(frozen=True)
class Cell:
    """One measurement: (backend, recipe, model, mode, workload)."""

    backend: str
    recipe: str
    model: ModelSpec
    mode: ModeSpec
    workload: Workload
    serving: Serving
    engine: Mapping[str, Any] = field(default_factory=dict)
    deploy: Mapping[str, Any] = field(default_factory=dict)
    """How the backend reaches a server: `deploy` settings, `ports`, `base_url` (not simulator)."""

    @property
    def path(self) -> str:
        return cell_path(
            self.backend,
            self.recipe,
            self.model.name,
            self.mode.name,
            self.workload,
            self.serving.prefix_caching,
        )

    @property
    def chunked_prefill(self) -> bool:
        """Whether the cell's servers chunk prefills (the mode's choice or the recipe's default)."""
        return chunks_prefill(self.recipe, self.mode.chunked_prefill, self.serving.max_model_len)

    @property
    def topology(self) -> Topology:
        """The mode's topology: its own, or a named mode's instances at the model's TP (one
        prefill and one decode instance when disaggregated)."""
        if self.mode.topology is not None:
            return parse(self.mode.topology)
        tp = self.model.tensor_parallel
        if self.mode.disaggregated:
            return Topology.xpyd(1, tp, self.mode.instances - 1, tp)
        return Topology.aggregated(self.mode.instances, tp)

    @property
    def instance_gpus(self) -> tuple[tuple[int, ...], ...]:
        """GPU ids pinned by each instance this cell's topology starts (per role, in order,
        from the model's GPU list)."""
        return self.topology.pins(tuple(g for pins in self.model.gpus for g in pins))

    def to_dict(self) -> dict[str, Any]:
        data = json.loads(json.dumps(asdict(self)))
        if not self.serving.prefix_caching:
            # Left out at its default: the setting's arrival changed no existing cell's
            # parameters (no rerun) nor its trace metadata.
            del data["serving"]["prefix_caching"]
        for key, default in TRACE_DEFAULTS.items():  # the same for the mooncake dataset's
            if data["workload"][key] == default:
                del data["workload"][key]
        if self.serving.max_num_seqs is None:
            del data["serving"]["max_num_seqs"]  # the same: no existing cell changes
        if self.serving.kv_offloading_gib is None:
            del data["serving"]["kv_offloading_gib"]
        if self.workload.prefix_groups == 1:
            del data["workload"]["prefix_groups"]
        if self.workload.sessions is None:
            del data["workload"]["sessions"]
        if self.mode.topology is None:
            del data["mode"]["topology"]  # a named mode's parameters stay as they were
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cell:
        model = dict(data["model"])
        model["gpus"] = tuple(tuple(g) for g in model["gpus"])
        workload = dict(data["workload"])
        if workload.get("sessions") is not None:
            workload["sessions"] = Sessions(**workload["sessions"])
        return cls(
            backend=data["backend"],
            recipe=data["recipe"],
            model=ModelSpec(**model),
            mode=ModeSpec(**data["mode"]),
            workload=Workload(**workload),
            serving=Serving(**data["serving"]),
            engine=dict(data.get("engine", {})),
            deploy=dict(data.get("deploy", {})),
        )


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    recipe: str
    models: tuple[str, ...]
    modes: tuple[str, ...]
    qps: tuple[float, ...]
    input_lens: tuple[int, ...]
    x: str
    cells: tuple[Cell, ...]
    question: str | None = None
    """What the study compares (``modes``, ``models``, ``input_len``) when the config names it;
    otherwise the findings derive it from what varies (``findings.recommend.study_question``)."""
    confirm_top: int | None = None
    """On a measured backend, a ``gpu_budget`` study deploys only this many topologies: those
    its simulator twin ranks highest by capacity per GPU (`servematrix.capacity.confirm`)."""


@dataclass(frozen=True)
class Config:
    backend: str
    raw: Mapping[str, Any]
    models: Mapping[str, ModelSpec]
    studies: Mapping[str, Study]
    slo: Slo

    @functools.cached_property
    def _cells_by_path(self) -> dict[str, Cell]:
        """Built once: every job's input functions look their cell up here, so planning a
        matrix takes time linear in its cells (a scan per lookup made it quadratic)."""
        seen: dict[str, Cell] = {}
        for study in self.studies.values():
            for cell in study.cells:
                seen.setdefault(cell.path, cell)
        return seen

    def all_cells(self) -> list[Cell]:
        """Every distinct cell of every study, in a stable order (a shared cell once)."""
        return list(self._cells_by_path.values())

    def mode_names(self) -> list[str]:
        """Every mode a path may name: the named modes and the topologies studies spell."""
        spelled = {mode for study in self.studies.values() for mode in study.modes}
        return [*MODES, *sorted(spelled - set(MODES))]

    def cell_at(self, path: str) -> Cell:
        cell = self._cells_by_path.get(path)
        if cell is None:
            raise ConfigError("studies", f"no study in the config has the cell {path}")
        return cell


def gpus_needed(cfg: Config) -> list[int]:
    """Every GPU id some cell of the config pins."""
    return sorted({g for cell in cfg.all_cells() for gpus in cell.instance_gpus for g in gpus})


def format_number(value: float) -> str:
    """2.0 -> '2', 2.5 -> '2.5': the spelling of a number in a path."""
    return f"{value:g}"


WORKLOAD_TOKEN_PATTERN = r"qps([0-9.e+-]+|inf)_in\d+_out\d+_n\d+_s\d+(_[A-Za-z0-9.+-]+)*"
"""Every name `workload_token` can spell, with `cell_path`'s ``_apc``: the constraint of the
cell rule's ``workload`` wildcard, kept here next to the function it matches."""


def workload_token(w: Workload) -> str:
    """A workload's trace file name without its extension.

    The design's ``qps{qps}_in{input_len}_out{output_len}_n{num_prompts}_s{seed}``, then one
    suffix per setting that differs from its default, in this order, so that two different
    workloads never share a path while the default paths stay as they were:
    ``_{dataset}-{file stem}`` (sonnet, jsonl, mooncake), ``_t{trace_start_s}``, ``_retimed``
    (``trace_timing: qps``), ``_trunc`` (``input_overflow: truncate``), ``_p{prefix_len}``,
    ``_g{prefix_groups}``, ``_r{range_ratio}``, ``_b{burstiness}``, ``_c{max_concurrency}``,
    ``_w{warmup_requests}`` (default 1), ``_eos`` (``ignore_eos`` off) and
    ``_sess{users}x{turns}`` (``-{min_turns}`` when turn counts vary) ``-t{think_time_s}``
    (``f`` after it when fixed). ``qps: .inf`` is
    spelled ``qpsinf``.
    """
    token = (
        f"qps{format_number(w.qps)}_in{w.input_len}_out{w.output_len}_n{w.num_prompts}_s{w.seed}"
    )
    if w.dataset_path is not None:  # a dataset read from a file (the config requires one)
        stem = re.sub(r"[^A-Za-z0-9.-]+", "-", Path(w.dataset_path or "").stem) or "file"
        token += f"_{w.dataset}-{stem}"
    if w.trace_start_s:
        token += f"_t{format_number(w.trace_start_s)}"
    if w.trace_timing != "timestamps":
        token += "_retimed"
    if w.input_overflow != "drop":
        token += "_trunc"
    if w.prefix_len:
        token += f"_p{w.prefix_len}"
    if w.prefix_groups != 1:
        token += f"_g{w.prefix_groups}"
    if w.range_ratio:
        token += f"_r{format_number(w.range_ratio)}"
    if w.burstiness != 1.0:
        token += f"_b{format_number(w.burstiness)}"
    if w.max_concurrency is not None:
        token += f"_c{w.max_concurrency}"
    if w.warmup_requests != 1:
        token += f"_w{w.warmup_requests}"
    if not w.ignore_eos:
        token += "_eos"
    if w.sessions is not None:
        s = w.sessions
        varying = f"-{s.min_turns}" if s.min_turns and s.min_turns != s.turns else ""
        fixed = "f" if s.think_time == "fixed" else ""
        token += f"_sess{s.users}x{s.turns}{varying}-t{format_number(s.think_time_s)}{fixed}"
    return token


def cell_path(
    backend: str, recipe: str, model: str, mode: str, w: Workload, prefix_caching: bool = False
) -> str:
    """A cell's trace: its workload's name, then ``_apc`` when the servers cache prefixes (the
    one serving flag in the name, so that a study may compare caching on and off)."""
    token = workload_token(w) + ("_apc" if prefix_caching else "")
    return f"results/{backend}/cells/{recipe}/{model}/{mode}/{token}.parquet"


def wildcard_pattern(values: Iterable[str]) -> str:
    """A regex alternation matching exactly these names (for wildcard_constraints)."""
    names = sorted(set(values), key=len, reverse=True)
    return "|".join(re.escape(v) for v in names) or "(?!x)x"
