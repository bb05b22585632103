"""Step times from aiconfigurator-core's measured vLLM operator tables, tabulated once and cached.

aiconfigurator predicts a step from measured GEMM/attention/communication tables, but a query costs
0.01-0.45 ms, far too slow for the simulator's hot loop. So :func:`build_table` queries it once per
(architecture, system, TP, quantization) on fixed grids and :class:`AicStepTime` interpolates.

A step is decomposed the way aiconfigurator's own ``mixed_step_breakdown`` does it:

- ``shared(T)``: every op but attention (GEMMs, norms, activation, all-reduce, logits), a function
  of the total number of tokens ``T`` in the step only (checked: independent of how ``T`` splits
  into prefill and decode tokens);
- ``chunk_attn(c, p)``: prefill attention of one chunk of ``c`` new tokens over ``p`` cached ones,
  taken from ``predict_prefill_latency(1, c + p, p) - shared(c)``. ``mixed_step_breakdown`` itself
  ignores most of the prefix (512 new over 3,584 cached: 0.71 ms there vs 5.69 ms in the prefill
  path, whose value matches the FLOP count), so the prefill path is the source;
- ``decode_extra(B, ctx)``: ``predict_decode_latency(B, ctx) - shared(B)`` (decode attention plus
  whatever the decode path adds), so a pure decode step reproduces aiconfigurator's decode exactly.

A mixed step is ``shared(T) + Σ (chunk_attn(c_i, p_i) - batch_saving(n, c_i)) + decode_extra(B,
mean ctx)``: GEMMs are paid once for all tokens (a 1,024-token chunk with 32 decodes costs 63.5 ms
on A100, against 60.0 + 12.0 for separate steps), and so is the attention call. vLLM runs one
``flash_attn_varlen_func`` per layer over all of a step's prefill chunks (V1: over the whole batch,
``engine/attention.py``; V0: over its prefills, the decodes in a call of their own), so the fixed
cost of a call (launch, scheduling, about 2 ms over a 40-layer model on either card) is paid once
per step, not once per chunk. ``batch_saving(n, c)`` is what a chunk of ``c`` new tokens costs less
in a step of ``n`` such chunks than alone, from aiconfigurator's own batched context attention:
``chunk_attn(c, 0) - (predict_prefill_latency(n, c, 0) - shared(n·c)) / n`` (Qwen3-14B on H100:
64 chunks of 128 tokens take 9.0 ms of attention measured together, 140 ms summed one by one).
Chunks of mixed sizes are each charged at the per-chunk cost of ``n`` chunks of their own size.

Weight-only quantization (AWQ, GPTQ): aiconfigurator has no int4/int8 weight-only GEMM tables for
vLLM. The only measured weight-only GEMMs it ships are TRT-LLM 1.0.0's on a100_sxm, so each GEMM op
of the vLLM bf16 table is scaled by TRT-LLM's measured ``int*_wo / bf16`` ratio for the same op and
token count (≈0.3-0.6 at small batch where weight streaming dominates, ≈1.03-1.05 at thousands of
tokens where dequantisation costs). The ratio comes from A100 for every GPU: an approximation on
H100/H200, stated in the source label.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from servematrix.common.files import cache_root
from servematrix.engine.architecture import (
    Architecture,
    ArchitectureError,
    load_architecture,
    load_architecture_file,
    resolve_config_json,
)
from servematrix.engine.steptime import PlusSiblingDifference, StepBatch, StepTimeModel

logger = logging.getLogger(__name__)

AIC_VERSION = version("aiconfigurator-core")
TABLE_FORMAT = 3  # bump when the grids or the decomposition change: invalidates every cache entry

SYSTEMS: dict[str, str] = {
    "A100-SXM4-80GB": "a100_sxm",
    "H100-SXM5-80GB": "h100_sxm",
    "H200-SXM-141GB": "h200_sxm",
}
SIBLINGS: dict[str, str] = {"A100-SXM4-40GB": "A100-SXM4-80GB"}
"""GPUs without tables whose die a tabulated card shares: the A100 SXM4 40 GB and 80 GB are the
same GA100 die with the same 108 SMs, 1,410 MHz boost clock and 312 TFLOPS of bf16 (NVIDIA's
A100 datasheet) and differ in their HBM (1,555 against 2,039 GB/s, 40 against 80 GB). Such a
card runs on its sibling's tables plus the roofline's difference between the two
(`steptime.PlusSiblingDifference`)."""
WEIGHT_ONLY: dict[str, str] = {"awq": "int4_wo", "gptq-int4": "int4_wo", "gptq-int8": "int8_wo"}
WEIGHT_ONLY_SOURCE = ("a100_sxm", "trtllm")  # the only system/framework with measured *_wo GEMMs
LLAMA_SHAPED = {"CohereForCausalLM", "Cohere2ForCausalLM"}
LLAMA_EXACT = {"MistralForCausalLM"}
"""Architectures aiconfigurator rejects that are a Llama of the same dimensions exactly (the
same decoder: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, ``head_dim`` as given;
`architecture` refuses a sliding-window config), so they run on its Llama tables without the
approximation `LLAMA_SHAPED` models carry."""


TABLE_KV_HEADS = 8
"""The most KV heads per GPU aiconfigurator's vLLM decode-attention tables measure (A100, H100,
H200: 1, 2, 4, 8). Beyond it aiconfigurator scales the 8-head time by the head count, which keeps
the efficiency of that smaller shape: for Llama-2-7B on one H100 (32 KV heads), 64 decodes of 700
tokens read 23.5 GB of KV in 10.6 ms, 2.2 TB/s, where 8-head calls of the same bytes run at
2.7 TB/s. `mha_equivalent` reads such a model off the measured tables instead."""


def mha_equivalent(config: dict[str, Any], tp: int) -> tuple[dict[str, Any], int] | None:
    """For more KV heads per GPU than `TABLE_KV_HEADS`, a config with ``r`` times fewer query and
    KV heads (the same head size and query heads per KV head) whose decode attention at ``r``
    times the batch does the same work: FlashAttention's decode grid runs one block per (sequence,
    KV head), each reading its own context's K and V for its own query heads. None where the
    tables hold the model or the head count is no multiple of theirs."""
    per_gpu = kv_heads_per_gpu(config, tp)
    if per_gpu <= TABLE_KV_HEADS or per_gpu % TABLE_KV_HEADS:
        return None
    ratio = per_gpu // TABLE_KV_HEADS
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fewer = {
        "num_attention_heads": heads // ratio,
        "num_key_value_heads": config.get("num_key_value_heads", heads) // ratio,
    }
    return {**config, **fewer, "head_dim": head_dim}, ratio


def kv_heads_per_gpu(config: dict[str, Any], tp: int) -> int:
    """KV heads on each of ``tp`` GPUs (replicated, one each, where there are fewer than GPUs)."""
    return max(config.get("num_key_value_heads", config["num_attention_heads"]) // tp, 1)


def _grid(lo: int, hi: int, per_octave: int, dense_to: int = 16) -> np.ndarray:
    """Integers ``lo..dense_to`` one by one, then ``per_octave`` log-spaced points up to ``hi``."""
    octaves = np.log2(hi / dense_to)
    logspaced = np.geomspace(dense_to, hi, round(octaves * per_octave) + 1)
    return np.unique(np.concatenate([np.arange(lo, dense_to + 1), np.rint(logspaced)])).astype(
        np.int64
    )


TOKENS = _grid(1, 32768, 8)  # shared(T): T = tokens in the step
CHUNK_NEW = _grid(1, 32768, 4, dense_to=8)
CHUNK_PAST = _grid(0, 65536, 3, dense_to=8)
DECODE_BATCH = _grid(1, 1024, 6)
DECODE_CONTEXT = _grid(1, 65536, 4, dense_to=8)
CHUNK_BATCH = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256], dtype=np.int64)
"""Prefill chunks per step of the batch table; a step of more is read at the last."""
BATCH_TABLE_MAX_TOKENS = 32768
"""The batch table's largest step (``n x c`` new tokens); beyond it a chunk size keeps the saving
of the largest batch measured for it (a chunk's share of the call's fixed cost is small there)."""


class AicUnsupportedError(ValueError):
    """aiconfigurator cannot predict this combination; the reason is meant for the source label."""


@dataclass(frozen=True)
class AicQuery:
    """What one table is built from: the HF config handed to aiconfigurator and how to run it."""

    config: dict[str, Any]
    system: str
    tp: int
    quantization: str
    approximations: tuple[str, ...]

    @property
    def gemm_quant_mode(self) -> str | None:
        return "fp8" if self.quantization == "fp8" else None

    @property
    def weight_only_mode(self) -> str | None:
        return WEIGHT_ONLY.get(self.quantization)

    @property
    def cache_key(self) -> str:
        grids = [TOKENS, CHUNK_NEW, CHUNK_PAST, DECODE_BATCH, DECODE_CONTEXT, CHUNK_BATCH]
        grids = [g.tolist() for g in grids]
        payload = [TABLE_FORMAT, self.config, self.system, self.tp, self.quantization, AIC_VERSION]
        payload.append(grids)
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.system}-tp{self.tp}-{self.quantization}-{digest}"

    @property
    def label(self) -> str:
        base = f"aiconfigurator-core {AIC_VERSION} {self.system} vllm"
        return "; ".join([base, *self.approximations])


def llama_shaped(config: dict[str, Any]) -> dict[str, Any]:
    """A Llama config with the same dimensions, for architectures aiconfigurator rejects."""
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "torch_dtype",
    )
    shaped = {k: config[k] for k in keys if k in config}
    shaped.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    shaped["rms_norm_eps"] = config.get("layer_norm_eps", 1e-5)
    return shaped


def aic_query(arch: Architecture, gpu: str, tp: int, quantization: str) -> AicQuery:
    """Map a servematrix setup to an aiconfigurator query, or say why there is none."""
    system = SYSTEMS.get(gpu)
    if system is None:
        raise AicUnsupportedError(f"aiconfigurator has no system file for {gpu}")
    if quantization == "fp8" and system == "a100_sxm":
        raise AicUnsupportedError("fp8 on A100 (no FP8 tensor cores; aiconfigurator has no data)")
    if quantization not in ("bf16", "fp8", *WEIGHT_ONLY):
        raise AicUnsupportedError(f"quantization {quantization!r} unknown to the table builder")
    config = _config_json(arch)
    approximations: list[str] = []
    if arch.hf_architecture in LLAMA_SHAPED | LLAMA_EXACT:
        config = llama_shaped(config)
    if arch.hf_architecture in LLAMA_SHAPED:
        ignored = "parallel attention+MLP block, LayerNorm"
        if arch.hf_architecture == "Cohere2ForCausalLM":
            ignored += ", sliding-window attention in 3 of 4 layers"
        approximations.append(
            f"approximation: {arch.hf_architecture} as Llama of the same dimensions "
            f"(ignores {ignored})"
        )
    equivalent = mha_equivalent(config, tp)
    if equivalent is not None:
        approximations.append(
            f"decode attention of {kv_heads_per_gpu(config, tp)} KV heads per GPU read off the "
            f"{TABLE_KV_HEADS}-head table at {equivalent[1]}x the batch"
        )
    if quantization in WEIGHT_ONLY:
        mode = WEIGHT_ONLY[quantization]
        approximations.append(
            f"{quantization} as {mode} GEMM ratio from a100_sxm trtllm tables (approximation)"
        )
    return AicQuery(config, system, tp, quantization, tuple(approximations))


def _config_json(arch: Architecture) -> dict[str, Any]:
    """The ``config.json`` aiconfigurator builds ``arch``'s tables from: the file behind its
    name, a shipped one or a user's (a path, a Hub id). Its tables are per operator shape, so
    any architecture aiconfigurator knows gets them, whoever wrote the file."""
    try:
        path = resolve_config_json(arch.name)
        held = load_architecture_file(path, arch.name)
    except ArchitectureError as error:
        raise AicUnsupportedError(f"no config.json to build its tables from ({error})") from None
    if held != arch:
        raise AicUnsupportedError(f"{path} holds other dimensions than {arch.name}'s")
    return json.loads(path.read_text())


@contextmanager
def _aic_logs_to_debug() -> Iterator[None]:
    """Route aiconfigurator's warnings (low-fidelity fallback rows, lane order) to DEBUG here."""
    aic_logger = logging.getLogger("aiconfigurator_core")

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logger.debug("aiconfigurator: %s", record.getMessage())

    handler, propagate = Forward(), aic_logger.propagate
    aic_logger.addHandler(handler)
    aic_logger.propagate = False
    try:
        yield
    finally:
        aic_logger.removeHandler(handler)
        aic_logger.propagate = propagate


def _compile(query: AicQuery, backend: str, gemm_quant_mode: str | None) -> Any:
    from aiconfigurator_core.sdk.engine import EngineHandle

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(query.config))
        return EngineHandle.compile(
            model_dir, query.system, backend, tp_size=query.tp, gemm_quant_mode=gemm_quant_mode
        )


def _gemm_ms(handle: Any, tokens: int) -> dict[str, float]:
    ops = handle.mixed_step_breakdown_per_op(tokens, 0, tokens, 2)[0]
    return {name: ms for name, ms, _, _ in ops if name.endswith("_gemm")}


def _weight_only_delta(vllm: Any, query: AicQuery, mode: str) -> np.ndarray:
    """Per T: Σ over GEMM ops of vLLM bf16 time × (TRT-LLM *_wo / bf16 − 1)."""
    system, backend = WEIGHT_ONLY_SOURCE
    source = AicQuery(query.config, system, query.tp, "bf16", ())
    bf16, quant = _compile(source, backend, None), _compile(source, backend, mode)
    deltas = []
    for t in TOKENS:
        base, ref, wo = _gemm_ms(vllm, t), _gemm_ms(bf16, t), _gemm_ms(quant, t)
        deltas.append(sum(ms * (wo[op] / ref[op] - 1.0) for op, ms in base.items()))
    return np.array(deltas)


@dataclass(frozen=True)
class StepTable:
    """The tabulated step-time components (ms) on the module's grids, plus their source label."""

    shared_ms: np.ndarray  # over TOKENS
    chunk_attn_ms: np.ndarray  # CHUNK_NEW × CHUNK_PAST
    decode_extra_ms: np.ndarray  # DECODE_BATCH × DECODE_CONTEXT
    chunk_batch_saving_ms: np.ndarray  # CHUNK_BATCH × CHUNK_NEW
    label: str

    def save(self, path: Path) -> None:
        """Write atomically: a concurrent reader sees the old file or the whole new one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(
                    out,
                    shared_ms=self.shared_ms,
                    chunk_attn_ms=self.chunk_attn_ms,
                    decode_extra_ms=self.decode_extra_ms,
                    chunk_batch_saving_ms=self.chunk_batch_saving_ms,
                    label=np.array(self.label),
                )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> StepTable:
        with np.load(path) as data:
            return cls(
                data["shared_ms"],
                data["chunk_attn_ms"],
                data["decode_extra_ms"],
                data["chunk_batch_saving_ms"],
                str(data["label"]),
            )


def build_table(query: AicQuery) -> StepTable:
    """Query aiconfigurator on every grid point (0.15-1.5 s for one table, see the engine doc)."""
    from aiconfigurator_core.sdk.errors import PerfDataNotAvailableError

    try:
        with _aic_logs_to_debug():
            return _query_grids(query)
    except KeyError as error:
        raise AicUnsupportedError(f"aiconfigurator needs {error} in config.json") from error
    except (AssertionError, ValueError, PerfDataNotAvailableError) as error:
        # The database's message goes on with the lanes it tried and its install path.
        why = str(error).split(": tried lane_order", 1)[0]
        raise AicUnsupportedError(f"aiconfigurator rejects it: {why}".strip()) from error


def _shared(handle: Any, tokens: int) -> float:
    return handle.mixed_step_breakdown(tokens, 0, tokens, 2)[1]


def _decode_attention_ms(handle: Any, batch: int, context: int) -> float:
    ops = handle.decode_step_per_op(batch, context, 2)
    return sum(ms for name, ms, _, _ in ops if name == "generation_attention")


def _query_grids(query: AicQuery) -> StepTable:
    handle = _compile(query, "vllm", query.gemm_quant_mode)
    shared = np.array([_shared(handle, t) for t in TOKENS])
    chunk = np.array(
        [
            [handle.predict_prefill_latency(1, c + p, p) - _shared(handle, c) for p in CHUNK_PAST]
            for c in CHUNK_NEW
        ]
    )
    decode = np.array(
        [
            [handle.predict_decode_latency(b, ctx) - _shared(handle, b) for ctx in DECODE_CONTEXT]
            for b in DECODE_BATCH
        ]
    )
    equivalent = mha_equivalent(query.config, query.tp)
    if equivalent is not None:
        config, ratio = equivalent
        fewer_heads = _compile(replace(query, config=config), "vllm", query.gemm_quant_mode)
        decode += np.array(
            [
                [
                    _decode_attention_ms(fewer_heads, b * ratio, ctx)
                    - _decode_attention_ms(handle, b, ctx)
                    for ctx in DECODE_CONTEXT
                ]
                for b in DECODE_BATCH
            ]
        )
    if query.weight_only_mode:
        shared = shared + _weight_only_delta(handle, query, query.weight_only_mode)
    saving = _batch_saving(handle, chunk[:, 0])
    return StepTable(shared, chunk, decode, saving, query.label)


def _batch_saving(handle: Any, alone_ms: np.ndarray) -> np.ndarray:
    """``batch_saving(n, c)`` on CHUNK_BATCH × CHUNK_NEW (module docstring), from the chunks'
    attention alone at no prefix (``alone_ms``, over CHUNK_NEW)."""
    rows = [np.zeros(len(CHUNK_NEW))]
    for n in CHUNK_BATCH[1:].tolist():
        row = rows[-1].copy()
        for j, c in enumerate(CHUNK_NEW.tolist()):
            if n * c <= BATCH_TABLE_MAX_TOKENS:
                together_ms = handle.predict_prefill_latency(n, c, 0) - _shared(handle, n * c)
                row[j] = max(alone_ms[j] - together_ms / n, 0.0)
        rows.append(row)
    return np.array(rows)


def cache_dir() -> Path:
    """``$SERVEMATRIX_CACHE/steptime``, by default ``~/.cache/servematrix/steptime``."""
    return cache_root() / "steptime"


def load_or_build_table(query: AicQuery, directory: Path | None = None) -> StepTable:
    path = (directory or cache_dir()) / f"{query.cache_key}.npz"
    if path.is_file():
        return StepTable.load(path)
    table = build_table(query)
    table.save(path)
    return table


class _Axis:
    """O(1) lookup of the grid segment holding an integer, for piecewise-linear interpolation.

    ``segment[x]`` is precomputed for every integer up to the last grid point; beyond it, the last
    segment extrapolates linearly.
    """

    def __init__(self, points: np.ndarray):
        self.points = points.tolist()
        self.last = len(self.points) - 2
        self.max = self.points[-1]
        index = np.searchsorted(points, np.arange(self.max + 1), side="right") - 1
        self.segment = np.clip(index, 0, self.last).tolist()
        self.inv_span = (1.0 / np.diff(points)).tolist()

    def locate(self, x: int) -> tuple[int, float]:
        i = self.segment[x] if 0 <= x <= self.max else (0 if x < 0 else self.last)
        return i, (x - self.points[i]) * self.inv_span[i]


class _Bilinear:
    def __init__(self, rows: np.ndarray, cols: np.ndarray, values: np.ndarray):
        self.rows, self.cols = _Axis(rows), _Axis(cols)
        self.values = values.tolist()

    def __call__(self, row: int, col: int) -> float:
        i, u = self.rows.locate(row)
        j, v = self.cols.locate(col)
        top, bottom = self.values[i], self.values[i + 1]
        upper = top[j] + (top[j + 1] - top[j]) * v
        lower = bottom[j] + (bottom[j + 1] - bottom[j]) * v
        return upper + (lower - upper) * u


class AicStepParts(NamedTuple):
    """One step's terms as `AicStepTime` tabulates them (module docstring): ``shared_ms``, every
    op but attention (GEMMs, norms, activation, logits; a function of the step's tokens), the
    prefill chunks' attention and the decodes' ``decode_extra`` (their attention)."""

    shared_ms: float
    prefill_attention_ms: float
    decode_attention_ms: float


class AicStepTime:
    """:class:`StepTimeModel` interpolating aiconfigurator's vLLM predictions (see module doc)."""

    def __init__(
        self,
        arch: Architecture,
        gpu: str,
        tp: int,
        quantization: str,
        directory: Path | None = None,
    ):
        table = load_or_build_table(aic_query(arch, gpu, tp, quantization), directory)
        self.label = table.label
        self._shared = np.interp(np.arange(TOKENS[-1] + 1), TOKENS, table.shared_ms).tolist()
        self._shared_slope = float(
            (table.shared_ms[-1] - table.shared_ms[-2]) / (TOKENS[-1] - TOKENS[-2])
        )
        self._chunk_attn = _Bilinear(CHUNK_NEW, CHUNK_PAST, table.chunk_attn_ms)
        self._decode_extra = _Bilinear(DECODE_BATCH, DECODE_CONTEXT, table.decode_extra_ms)
        self._batch_saving = _Bilinear(CHUNK_BATCH, CHUNK_NEW, table.chunk_batch_saving_ms)

    def _shared_ms(self, tokens: int) -> float:
        last = len(self._shared) - 1
        if tokens <= last:
            return self._shared[tokens]
        return self._shared[last] + self._shared_slope * (tokens - last)

    def step_ms(self, batch: StepBatch) -> float:
        parts = self.parts_ms(batch)
        return parts.prefill_attention_ms + parts.decode_attention_ms + parts.shared_ms

    def parts_ms(self, batch: StepBatch) -> AicStepParts:
        """The step's three tabulated terms (module docstring); `step_ms` is their sum."""
        tokens = len(batch.decode_contexts)
        prefill_ms = 0.0
        together = min(len(batch.prefill_chunks), int(CHUNK_BATCH[-1]))
        for new, past in batch.prefill_chunks:
            tokens += new
            chunk_ms = self._chunk_attn(new, past)
            if together > 1:
                chunk_ms = max(chunk_ms - self._batch_saving(together, new), 0.0)
            prefill_ms += chunk_ms
        decode_ms = 0.0
        if batch.decode_contexts:
            size = len(batch.decode_contexts)
            decode_ms = self._decode_extra(size, sum(batch.decode_contexts) // size)
        return AicStepParts(self._shared_ms(tokens), prefill_ms, decode_ms)


@functools.lru_cache(maxsize=64)
def _aic_step_time(arch: Architecture, gpu: str, tp: int, quantization: str) -> AicStepTime:
    """One model per setup in this process: it is immutable, and building its lookup lists
    takes milliseconds that a capacity search, simulating one setup hundreds of times, repeats."""
    return AicStepTime(arch, gpu, tp, quantization)


def _roofline(arch: Architecture, gpu: str, tp: int, quantization: str) -> StepTimeModel:
    from servematrix.engine.hardware import gpu_spec
    from servematrix.engine.roofline import RooflineStepTime

    return RooflineStepTime(arch, gpu_spec(gpu), tp, quantization)


@dataclass(frozen=True)
class StepTimeFallback:
    """The roofline model stands in for aiconfigurator's measured tables, and why: recorded in
    the trace metadata as ``step_time_fallback`` (``{"to": "roofline", "reason": ...}``)."""

    reason: str
    to: str = "roofline"


@dataclass(frozen=True)
class StepTimeChoice:
    """A setup's step-time model, its source label, and the fallback (None: measured tables)."""

    model: StepTimeModel
    label: str
    fallback: StepTimeFallback | None = None


def roofline_fallback(model: StepTimeModel, reason: str) -> StepTimeChoice:
    return StepTimeChoice(model, f"roofline ({reason})", StepTimeFallback(reason))


def select_step_time_model(
    arch_name: str | Architecture,
    gpu: str,
    tp: int,
    quantization: str,
    roofline: Callable[[Architecture, str, int, str], StepTimeModel] = _roofline,
) -> StepTimeChoice:
    """aiconfigurator's tables where they cover the setup (a card in `SIBLINGS`: its sibling's
    tables plus the roofline's difference), else the roofline, saying why. ``arch_name`` may
    also be an architecture already loaded (a user's ``config.json``)."""
    arch = load_architecture(arch_name) if isinstance(arch_name, str) else arch_name
    sibling = SIBLINGS.get(gpu)
    try:
        model = _aic_step_time(arch, sibling or gpu, tp, quantization)
    except AicUnsupportedError as why:
        return roofline_fallback(roofline(arch, gpu, tp, quantization), str(why))
    if sibling is None:
        return StepTimeChoice(model, model.label)
    card = roofline(arch, gpu, tp, quantization)
    its_sibling = roofline(arch, sibling, tp, quantization)
    label = f"{model.label} + the roofline's {gpu} - {sibling} difference (same die, other HBM)"
    return StepTimeChoice(PlusSiblingDifference(model, card, its_sibling), label)
