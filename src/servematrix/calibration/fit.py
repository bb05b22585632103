"""Fit a profile's terms to probe observations: pure, numpy only.

Each observation is one measured time and the counts of the terms in the step it times
(``probes.Observation``). The fit minimises the *relative* error (a 10 ms decode step and a
300 ms prefill weigh alike), robustly: iteratively reweighted least squares with Huber weights
(k = 1.345 robust standard deviations, the 95 %-efficiency constant), the scale re-estimated
each pass from the median absolute deviation. Terms are kept non-negative (a negative cost
has no physical meaning): a term the unconstrained fit drives below zero is fixed at zero and
the others refitted. Standard errors are the weighted fit's covariance at the end; a term
fixed at zero reports zero.

The API server's CPU over each probe run (`fit_api_cpu`) is fitted the same way but on
absolute errors (the counter ticks in 10 ms, so a short probe's CPU may read 0). On a CPU
host, where the API server shares the engine's core, a probe's times include the API
server's work on what it streams meanwhile; `fit_terms` takes that out first, so the terms
are the engine's own (``engine.profile.SharedCoreStepTime`` adds it back step by step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servematrix.calibration.probes import ApiCpuObservation, Observation
from servematrix.engine.profile import API_CPU_TERMS, TERMS, ApiServerCpu, ProfileTerms, Residuals

HUBER_K = 1.345
MIN_OBSERVATIONS_PER_TERM = 2
MAX_ITERATIONS = 50
ENGINE_SHARE_FLOOR = 0.05
"""Taking the API server's CPU out of a time leaves at least this share of it (a time the
API's CPU seems to fill is noise)."""
SEPARATES = {
    "per_step_s": "probes of any kind",
    "per_prefill_token_s": "prefill probes at two or more prompt lengths",
    "per_sequence_s": "decode probes at two or more batch sizes",
    "per_kv_token_read_s": "decode probes at two or more context lengths",
    "per_request_api_s": "time-to-first-token rows (prefill probes timed from the client)",
}
"""Which probes identify each term (named in the error when a term is not identified)."""


class FitError(ValueError):
    """Observations that cannot determine the terms; says which probes are missing."""


@dataclass(frozen=True)
class Fit:
    terms: ProfileTerms
    stderr: ProfileTerms
    residuals: Residuals


def fit_terms(observations: Sequence[Observation], api_cpu: ApiServerCpu | None = None) -> Fit:
    """The terms that best explain ``observations`` (see the module docstring), with
    ``api_cpu`` (the API server on the engine's core) taken out of each time first; FitError
    when there are too few of them or they do not separate the terms."""
    needed = MIN_OBSERVATIONS_PER_TERM * len(TERMS)
    if len(observations) < needed:
        raise FitError(
            f"{len(observations)} observations for {len(TERMS)} terms: the fit needs at least "
            f"{needed} (run the whole probe set, or more repeats)"
        )
    x = np.array([o.features() for o in observations], dtype=float)
    y = np.array([o.seconds for o in observations], dtype=float)
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise FitError("an observation's time is not a positive number of seconds")
    if api_cpu is not None:
        y = np.maximum(y - [_api_share(o, api_cpu) for o in observations], ENGINE_SHARE_FLOOR * y)
    _check_identified(x)
    # Relative errors: divide every row by its measured time.
    coef, stderr, relative, weights = _robust(x / y[:, None], np.ones_like(y))
    residuals = Residuals(
        observations=len(y),
        median_abs_relative=float(np.median(np.abs(relative))),
        max_abs_relative=float(np.max(np.abs(relative))),
        outliers=int(np.sum(weights < 1.0)),
        by_observation=tuple(
            f"{o.probe} {o.quantity}: {o.seconds * 1e3:.2f} ms, fit {r:+.1%}"
            + (" (down-weighted)" if w < 1.0 else "")
            for o, r, w in zip(observations, relative, weights, strict=True)
        ),
    )
    return Fit(ProfileTerms.of_vector(coef), ProfileTerms.of_vector(stderr), residuals)


def _api_share(row: Observation, api: ApiServerCpu) -> float:
    """The API server's CPU inside ``row``'s time: a step's outputs (one message, a token per
    streamed sequence) and, in a TTFT, the request itself (its CPU is charged where the
    request starts: ``SharedCoreStepTime``)."""
    outputs = api.per_step_s + api.per_output_token_s * row.streamed_tokens
    return (outputs if row.streamed_tokens else 0.0) + api.per_request_s * row.api_requests


def fit_api_cpu(rows: Sequence[ApiCpuObservation]) -> tuple[ApiServerCpu, ApiServerCpu] | None:
    """The API server's CPU per request, output token and engine step over the probe runs,
    with a constant per run (the ``/metrics`` reads around it), and their standard errors; None
    when the runs are too few or do not separate the three."""
    if len(rows) < MIN_OBSERVATIONS_PER_TERM * (len(API_CPU_TERMS) + 1):
        return None
    x = np.array([(1.0, r.requests, r.output_tokens, r.steps) for r in rows], dtype=float)
    y = np.array([r.cpu_s for r in rows], dtype=float)
    if np.linalg.matrix_rank(x) < x.shape[1] or not np.all(np.isfinite(y)) or y.mean() <= 0:
        return None
    coef, stderr, _, _ = _robust(x / y.mean(), y / y.mean())
    return ApiServerCpu(*map(float, coef[1:])), ApiServerCpu(*map(float, stderr[1:]))


def _robust(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Huber-weighted non-negative least squares of ``a @ coef ≈ b``: the coefficients, their
    standard errors, the residuals ``a @ coef - b`` and the final weights."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns scaled to unit size
    a = a / scale
    weights = np.ones_like(b)
    coef = np.zeros(a.shape[1])
    for _ in range(MAX_ITERATIONS):
        new = _nonnegative_lstsq(a, b, weights)
        residual = a @ new - b
        spread = max(1.4826 * float(np.median(np.abs(residual - np.median(residual)))), 1e-4)
        weights = np.minimum(1.0, HUBER_K * spread / np.maximum(np.abs(residual), 1e-12))
        converged = np.allclose(new, coef, rtol=1e-7, atol=1e-12)
        coef = new
        if converged:
            break
    residual = a @ coef - b
    stderr = _stderr(a, residual, weights, coef > 0)
    return coef / scale, stderr / scale, residual, weights


def _check_identified(x: np.ndarray) -> None:
    """Every term's column varies independently of the others'."""
    unit = x / np.maximum(np.abs(x).max(axis=0), 1e-300)
    # per_step_s last: the constant is confounded with whichever term lacks its probes, and
    # the error should name that one.
    for index in (*range(1, len(TERMS)), 0):
        name = TERMS[index]
        others = np.delete(unit, index, axis=1)
        column = unit[:, index]
        if not column.any():
            raise FitError(f"no observation involves {name}: add {SEPARATES[name]}")
        rest, *_ = np.linalg.lstsq(others, column, rcond=None)
        if np.linalg.norm(others @ rest - column) < 1e-6 * np.linalg.norm(column):
            raise FitError(
                f"the observations do not separate {name} from the other terms: "
                f"add {SEPARATES[name]}"
            )


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with the terms >= 0: drop the most negative term, refit, until
    none is negative (an active set that only shrinks; five terms at most)."""
    root = np.sqrt(weights)
    free = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    while free.any():
        solution, *_ = np.linalg.lstsq(a[:, free] * root[:, None], b * root, rcond=None)
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[free] = solution
            return coef
        free[np.flatnonzero(free)[int(np.argmin(solution))]] = False
    return coef


def _stderr(
    a: np.ndarray, relative: np.ndarray, weights: np.ndarray, free: np.ndarray
) -> np.ndarray:
    """Standard errors of the free terms (zero for terms fixed at zero)."""
    stderr = np.zeros(a.shape[1])
    dof = len(relative) - int(free.sum())
    if dof <= 0 or not free.any():
        return stderr
    sigma2 = float(np.sum(weights * relative**2) / dof)
    af = a[:, free]
    cov = sigma2 * np.linalg.pinv(af.T @ (af * weights[:, None]))
    stderr[free] = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return stderr
