"""Fit a profile's terms to probe observations: pure, numpy only.

Each observation is one measured time and the counts of the terms in the step it times
(``probes.Observation``). The fit minimises the *relative* error (a 10 ms decode step and a
300 ms prefill weigh alike), robustly: iteratively reweighted least squares with Huber weights
(k = 1.345 robust standard deviations, the 95 %-efficiency constant), the scale re-estimated
each pass from the median absolute deviation. Terms are kept non-negative (a negative cost
has no physical meaning): a term the unconstrained fit drives below zero is fixed at zero and
the others refitted. Standard errors are the weighted fit's covariance at the end; a term
fixed at zero reports zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servematrix.calibration.probes import Observation
from servematrix.engine.profile import TERMS, ProfileTerms, Residuals

HUBER_K = 1.345
MIN_OBSERVATIONS_PER_TERM = 2
MAX_ITERATIONS = 50
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


def fit_terms(observations: Sequence[Observation]) -> Fit:
    """The terms that best explain ``observations`` (see the module docstring); FitError when
    there are too few of them or they do not separate the terms."""
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
    _check_identified(x)
    # Relative errors: divide every row by its measured time; columns scaled to unit size.
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    a = a / scale
    ones = np.ones_like(y)
    weights = ones
    coef = np.zeros(len(TERMS))
    for _ in range(MAX_ITERATIONS):
        new = _nonnegative_lstsq(a, ones, weights)
        relative = a @ new - ones
        spread = max(1.4826 * float(np.median(np.abs(relative - np.median(relative)))), 1e-4)
        weights = np.minimum(1.0, HUBER_K * spread / np.maximum(np.abs(relative), 1e-12))
        converged = np.allclose(new, coef, rtol=1e-7, atol=1e-12)
        coef = new
        if converged:
            break
    relative = a @ coef - ones
    stderr = _stderr(a, relative, weights, coef > 0)
    terms = coef / scale
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
    return Fit(
        ProfileTerms.of_vector(terms),
        ProfileTerms.of_vector(stderr / scale),
        residuals,
    )


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
