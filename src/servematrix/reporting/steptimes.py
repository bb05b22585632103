"""Where a study's simulated step times came from (every run that simulates the study): per
model setup, whether aiconfigurator-core's measured vLLM tables, a hardware profile
(``engine.profile``) or the roofline model gave the step times, and why the roofline stood in
(``step_time_fallback`` in each simulator trace's engine parameters). A roofline step time is
an estimate from datasheet bandwidth and FLOPs; the report says so instead of letting it pass
for a measured one."""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from servematrix.common.files import write_text
from servematrix.results.aggregate import HTML_STYLE
from servematrix.spec import trace


@dataclass(frozen=True)
class CellStepTimes:
    """Where one simulated cell's step times came from (its trace's engine parameters)."""

    model: str
    mode: str
    qps: float
    input_len: int
    gpu: str
    tensor_parallel: int
    quantization: str
    source: str
    fallback_reason: str | None
    """Why the roofline stood in for aiconfigurator's measured tables; None: measured tables."""
    profile: str | None = None
    """The hardware profile file whose terms gave the step times (``engine.profile``)."""


@dataclass(frozen=True)
class SetupStepTimes:
    """The cells of one model setup (model, GPU, TP, quantization) that share a step-time
    source; a setup has one source, whatever the mode or load."""

    model: str
    gpu: str
    tensor_parallel: int
    quantization: str
    source: str
    fallback_reason: str | None
    modes: tuple[str, ...]
    cells: int
    profile: str | None = None
    """The hardware profile file that gave the step times (``engine.profile``)."""


def cell_step_times(path: str | os.PathLike[str]) -> CellStepTimes:
    """Read a simulator trace's step-time source; TraceError (naming the file) for a trace of
    another backend, which records none."""
    metadata = trace.read_metadata(path)
    engine = (metadata.get("deployment") or {}).get("engine")
    cell = metadata.get("cell")
    if not isinstance(engine, dict) or "step_time_source" not in engine or cell is None:
        raise trace.TraceError(path, None, "records no step-time source (only simulator traces do)")
    source = str(engine["step_time_source"])
    if "step_time_fallback" in engine:
        fallback = engine["step_time_fallback"]
        reason = fallback["reason"] if fallback else None
    else:  # written before the field existed: its source label is all it says
        reason = source if source.startswith("roofline") else None
    return CellStepTimes(
        model=cell["model"]["name"],
        mode=cell["mode"]["name"],
        qps=float(cell["workload"]["qps"]),
        input_len=int(cell["workload"]["input_len"]),
        gpu=str(engine["gpu"]),
        tensor_parallel=int(engine["tensor_parallel"]),
        quantization=str(engine["quantization"]),
        source=source,
        fallback_reason=reason,
        profile=engine.get("step_time_profile"),
    )


def group_setups(cells: Iterable[CellStepTimes]) -> list[SetupStepTimes]:
    """One row per (model setup, source), in the order the cells list them."""
    groups: dict[tuple, list[CellStepTimes]] = {}
    for cell in cells:
        key = (
            cell.model,
            cell.gpu,
            cell.tensor_parallel,
            cell.quantization,
            cell.source,
            cell.fallback_reason,
            cell.profile,
        )
        groups.setdefault(key, []).append(cell)
    return [
        SetupStepTimes(
            *key[:-1],
            modes=tuple(dict.fromkeys(c.mode for c in members)),
            cells=len(members),
            profile=key[-1],
        )
        for key, members in groups.items()
    ]


def _setup_name(setup: SetupStepTimes) -> str:
    return f"{setup.model} on {setup.gpu}, TP {setup.tensor_parallel}, {setup.quantization}"


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def _share(part: int, total: int) -> str:
    return f"All {_cells(total)}" if part == total else f"{part} of {_cells(total)}"


def profile_sentences(setups: Sequence[SetupStepTimes]) -> list[str]:
    """Which cells' step times came from a hardware profile (``engine.profile``), and which."""
    profiled = [s for s in setups if s.profile]
    if not profiled:
        return []
    files = ", ".join(dict.fromkeys(str(s.profile) for s in profiled))
    share = _share(sum(s.cells for s in profiled), sum(s.cells for s in setups))
    return [
        f"{share} took their step times from the hardware profile {files}, not from "
        "aiconfigurator-core's measured tables or the roofline (docs/simulator.md, "
        '"Calibrated profiles").'
    ] + [f"{_setup_name(s)} ({_cells(s.cells)}): {s.source}." for s in profiled]


def step_time_sentences(setups: Sequence[SetupStepTimes]) -> list[str]:
    """Which cells' step times came from a hardware profile, which from the roofline and why,
    or that all came from measured tables."""
    total = sum(s.cells for s in setups)
    profiled = profile_sentences(setups)
    fallbacks = [s for s in setups if s.fallback_reason is not None]
    if not fallbacks:
        return profiled or [
            f"All {_cells(total)} took their step times from aiconfigurator-core's measured vLLM "
            "operator tables; none fell back to the roofline model."
        ]
    share = _share(sum(s.cells for s in fallbacks), total)
    sentences = [
        *profiled,
        f"{share} took their step times from the roofline model (an "
        "estimate from datasheet bandwidth and FLOPs, docs/engine-model.md), not from measured "
        "tables:",
    ]
    sentences += [
        f"{_setup_name(s)} ({_cells(s.cells)}; modes {', '.join(s.modes)}): {s.fallback_reason}."
        for s in fallbacks
    ]
    return sentences


def step_times_markdown(title: str, setups: Sequence[SetupStepTimes]) -> str:
    lines = [f"# Step-time sources: {title}", ""]
    lines += [f"- {sentence}" for sentence in step_time_sentences(setups)]
    lines += ["", "| model | GPU | TP | quantization | modes | cells | step-time source |"]
    lines.append("|---|---|---|---|---|---|---|")
    lines += [
        f"| {s.model} | {s.gpu} | {s.tensor_parallel} | {s.quantization} | "
        f"{', '.join(s.modes)} | {s.cells} | {s.source} |"
        for s in setups
    ]
    return "\n".join(lines) + "\n"


def step_times_html(title: str, setups: Sequence[SetupStepTimes]) -> str:
    """A self-contained page: the sentences, then every setup with its source."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("model", "GPU", "TP", "quantization", "modes", "cells", "step-time source")
    )
    rows = "\n".join(
        f"<tr{' class=out' if s.fallback_reason else ''}>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                s.model,
                s.gpu,
                s.tensor_parallel,
                s.quantization,
                ", ".join(s.modes),
                s.cells,
                s.source,
            )
        )
        + "</tr>"
        for s in setups
    )
    items = "".join(f"<li>{html.escape(s)}</li>" for s in step_time_sentences(setups))
    table = f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>"
    body = f"<ul>{items}</ul>\n{table}"
    return report_page(f"Step-time sources: {title}", body)


def write_step_times(
    trace_paths: Iterable[str | os.PathLike[str]],
    title: str,
    markdown_path: str | os.PathLike[str],
    html_path: str | os.PathLike[str],
) -> list[SetupStepTimes]:
    setups = group_setups(cell_step_times(path) for path in trace_paths)
    write_text(markdown_path, step_times_markdown(title, setups))
    write_text(html_path, step_times_html(title, setups))
    return setups


def report_page(title: str, body: str) -> str:
    """A self-contained page of the simulator's judged predictions (rows of class ``out``:
    a roofline stand-in, a ratio outside the band)."""
    escaped = html.escape(title)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escaped}</title>\n<style>{HTML_STYLE}tr.out td{{background:#fde2e1}}"
        f"h2{{margin-top:1.5em}}</style>\n</head>\n<body>\n<h1>{escaped}</h1>\n{body}\n"
        "</body>\n</html>\n"
    )
