"""The designed probe set, and what each probe's timings say about one engine step.

A probe is a few streamed requests sent together (`Probe`); the client sees, per request,
when it was sent and when each token arrived (`Stream`). Each probe isolates steps of a known
composition, so its times are rows of a linear model in the profile's terms
(``servematrix.engine.profile``):

* **prefill** (one request of n prompt tokens): its TTFT is the API server's work on the
  request plus one step prefilling n tokens; its inter-token gaps are decode steps of one
  sequence reading about n KV tokens;
* **decode** (b requests of c prompt tokens at once): once all b have their first token and
  until the first finishes, every gap is a step of b sequences reading about b·c KV tokens;
* **mixed** (b requests decoding, then one prompt of n tokens): the decoders' longest gap
  begun while the newcomer waits for its first token is a step that prefills n tokens beside
  them (the decoders' token of that step may arrive just before the newcomer's first). That
  is how vLLM V1 (and V0 with chunked prefill) schedules; V0's plain prefill runs the prompt
  in a step of its own, which these rows then overstate (the residuals show it).

Where the server exports vLLM's request histograms on ``/metrics``
(``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``,
``vllm:request_generation_tokens``), their change over a lone request's probe adds the
server's own view: its prefill without the API server, and its mean decode step
(`server_observations`).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PREFILL_LENGTHS = (128, 512, 1024, 2048)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_RUNS = ((256, 32), (1024, 64))
"""(prompt, output tokens) of the decode probes: two output lengths, so the API server's CPU
per request and per streamed token are told apart (with one, a decode probe's tokens are its
requests times that length, and the two move together)."""
MIXED = ((8, 512, 1024), (16, 256, 2048))
"""(decoding requests, their prompt, the newcomer's prompt) of the mixed probes."""
PREFILL_OUTPUT = 8
MIXED_OUTPUT = 48


@dataclass(frozen=True)
class Probe:
    """``concurrency`` requests of ``prompt_tokens`` sent at once, each generating
    ``output_tokens``; a mixed probe then sends one of ``late_prompt_tokens`` once every
    first request is decoding."""

    kind: str
    prompt_tokens: int
    concurrency: int
    output_tokens: int
    late_prompt_tokens: int = 0

    @property
    def name(self) -> str:
        late = f"+{self.late_prompt_tokens}" if self.late_prompt_tokens else ""
        return f"{self.kind} {self.concurrency}x{self.prompt_tokens}{late}"


@dataclass(frozen=True)
class Stream:
    """One request as the client saw it, in seconds on one monotonic clock."""

    sent_s: float
    token_s: tuple[float, ...]


@dataclass(frozen=True)
class Observation:
    """One measured time and the step it times, as counts of the profile's terms."""

    probe: str
    quantity: str
    seconds: float
    prefill_tokens: float
    sequences: float
    kv_tokens_read: float
    api_requests: float = 0.0

    streamed_tokens: float = 0.0
    """Output tokens the API server streams while this time runs (on a shared core its work
    on them is in the time: ``fit.fit_terms`` takes it out with ``api_cpu``)."""

    def features(self) -> tuple[float, ...]:
        """The design-matrix row, in the order of ``engine.profile.TERMS``."""
        return (1.0, self.prefill_tokens, self.sequences, self.kv_tokens_read, self.api_requests)


@dataclass(frozen=True)
class ApiCpuObservation:
    """What one run of a probe cost the API server's process in CPU seconds, with the requests
    it served, the output tokens it streamed and the engine steps whose outputs it handled."""

    probe: str
    cpu_s: float
    requests: float
    output_tokens: float
    steps: float


def design(max_model_len: int, max_num_seqs: int = 256) -> list[Probe]:
    """The probe set for a server of ``max_model_len`` and ``max_num_seqs`` (lengths and batches
    above them are left out): 4 prefills, 8 decode runs, 2 mixed loads."""
    probes = [
        Probe("prefill", n, 1, PREFILL_OUTPUT)
        for n in PREFILL_LENGTHS
        if n + PREFILL_OUTPUT <= max_model_len
    ]
    probes += [
        Probe("decode", c, b, out)
        for c, out in DECODE_RUNS
        for b in DECODE_BATCHES
        if c + out <= max_model_len and b <= max_num_seqs
    ]
    probes += [
        Probe("mixed", c, b, MIXED_OUTPUT, n)
        for b, c, n in MIXED
        if max(c + MIXED_OUTPUT, n + 1) <= max_model_len and b < max_num_seqs
    ]
    return probes


def _step_s(stream: Stream, start: float, end: float) -> float | None:
    """The mean gap between the stream's tokens within [start, end]: the span over the gaps,
    not their median, so tokens the client read together (one gap near zero, the next twice
    as long) still average to the step (None: fewer than two tokens in the window, or all of
    them read at once, as real vLLM's API server hands a busy batch's tokens over together)."""
    times = [t for t in stream.token_s if start <= t <= end]
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def observations(
    probe: Probe, streams: Sequence[Stream], late: Stream | None = None
) -> list[Observation]:
    """The rows one run of ``probe`` gives (none from a run whose streams are too short)."""
    if not streams or any(len(s.token_s) < 2 for s in streams):
        return []
    if probe.kind == "prefill":
        return _prefill_rows(probe, streams[0])
    if probe.kind == "decode":
        return _decode_rows(probe, streams)
    return _mixed_rows(probe, streams, late)


def _prefill_rows(probe: Probe, stream: Stream) -> list[Observation]:
    n = probe.prompt_tokens
    ttft = stream.token_s[0] - stream.sent_s
    rows = [Observation(probe.name, "ttft", ttft, n, 1, 0, 1, streamed_tokens=1)]
    step = _step_s(stream, stream.token_s[0], stream.token_s[-1])
    if step:
        context = n + len(stream.token_s) / 2
        rows.append(Observation(probe.name, "itl", step, 0, 1, context, streamed_tokens=1))
    return rows


def _decode_rows(probe: Probe, streams: Sequence[Stream]) -> list[Observation]:
    start = max(s.token_s[0] for s in streams)
    end = min(s.token_s[-1] for s in streams)
    steps = [step for s in streams if (step := _step_s(s, start, end)) is not None]
    if not steps:
        return []
    b = len(streams)
    generated = statistics.mean(
        sum(1 for t in s.token_s if start <= t <= end) / 2 + sum(1 for t in s.token_s if t < start)
        for s in streams
    )
    kv = b * (probe.prompt_tokens + generated)
    return [Observation(probe.name, "itl", statistics.median(steps), 0, b, kv, streamed_tokens=b)]


def _mixed_rows(probe: Probe, streams: Sequence[Stream], late: Stream | None) -> list[Observation]:
    if late is None or not late.token_s:
        return []
    first = late.token_s[0]
    spanning = [
        b - a
        for s in streams
        for a, b in itertools.pairwise(s.token_s)
        if late.sent_s <= a <= first
    ]
    if not spanning:
        return []
    b = len(streams)
    before = statistics.mean(sum(1 for t in s.token_s if t <= first) for s in streams)
    kv = b * (probe.prompt_tokens + before)
    n = probe.late_prompt_tokens
    return [
        Observation(probe.name, "mixed step", max(spanning), n, b + 1, kv, streamed_tokens=b + 1)
    ]


SERVER_SERIES = (
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_generation_tokens_sum",
    "vllm:request_generation_tokens_count",
)
"""The ``/metrics`` samples whose change over a probe gives the server's view of it."""
STEP_SERIES = "vllm:iteration_tokens_total_count"
"""One sample per engine step: its change over a probe is the probe's steps."""
API_CPU_SERIES = "process_cpu_seconds_total"
"""The CPU seconds of the process answering ``/metrics``: vLLM's API server (its
``prometheus_client`` registry's process collector), whose change over a probe is what the
probe cost the API server."""


def parse_metrics(text: str) -> dict[str, float]:
    """The Prometheus text's samples of ``SERVER_SERIES``, summed over their label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name not in SERVER_SERIES and name not in (STEP_SERIES, API_CPU_SERIES):
            continue
        try:
            value = float(rest.rpartition(" ")[2] if "}" in rest else rest.split()[0])
        except (ValueError, IndexError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def server_observations(
    probe: Probe, before: Mapping[str, float], after: Mapping[str, float], kv_tokens_read: float
) -> list[Observation]:
    """Rows from the change of the server's histograms over one run of a prefill probe: the
    lone request's prefill time (no API server in it) and its mean decode step
    (``kv_tokens_read`` is that step's, from the client's rows). None for the other probes (a
    request's decode time there includes the steps that prefilled the others beside it) or
    when the server does not export them."""
    if not all(name in before and name in after for name in SERVER_SERIES):
        return []
    delta = {name: after[name] - before[name] for name in SERVER_SERIES}
    requests = delta["vllm:request_prefill_time_seconds_count"]
    if requests <= 0:
        return []
    rows = []
    if probe.kind == "prefill":
        prefill_s = delta["vllm:request_prefill_time_seconds_sum"] / requests
        rows.append(Observation(probe.name, "server prefill", prefill_s, probe.prompt_tokens, 1, 0))
    steps = (
        delta["vllm:request_generation_tokens_sum"]
        - delta["vllm:request_decode_time_seconds_count"]
    )
    if probe.kind == "prefill" and steps > 0:
        step_s = delta["vllm:request_decode_time_seconds_sum"] / steps
        rows.append(
            Observation(
                probe.name,
                "server decode step",
                step_s,
                0,
                probe.concurrency,
                kv_tokens_read,
                streamed_tokens=probe.concurrency,
            )
        )
    return rows


def api_cpu_observation(
    probe: Probe, before: Mapping[str, float], after: Mapping[str, float]
) -> ApiCpuObservation | None:
    """The API server's CPU over one run of ``probe`` (None when ``/metrics`` lacks its CPU
    counter or the engine's step count, ``vllm:iteration_tokens_total``, one sample a step).
    A mixed probe's newcomer is one request more, of two tokens (``run._Client.run``)."""
    if not all(name in before and name in after for name in (API_CPU_SERIES, STEP_SERIES)):
        return None
    late = 1 if probe.late_prompt_tokens else 0
    return ApiCpuObservation(
        probe.name,
        after[API_CPU_SERIES] - before[API_CPU_SERIES],
        probe.concurrency + late,
        probe.concurrency * probe.output_tokens + 2 * late,
        after[STEP_SERIES] - before[STEP_SERIES],
    )
