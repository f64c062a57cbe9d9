"""A small Gaussian-process regressor over 0/1 skip vectors, for Bayesian optimization.

Used by the SWIFT baseline (a suggestion every 25 steps, scored by matchness) and the
Draft&Verify baseline (offline, scored by measured tokens/s). RBF kernel on Hamming distance,
upper-confidence-bound acquisition over a pool of random candidates of the right size.
"""

from __future__ import annotations

import random

import numpy as np


def _kernel(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    dist = (a[:, None, :] != b[None, :, :]).sum(-1)
    return np.exp(-(dist**2) / (2 * length**2))


def suggest(
    observed: list[tuple[list[int], float]],
    candidates: list[list[int]],
    beta: float = 2.0,
    noise: float = 1e-3,
) -> list[int]:
    """The candidate with the highest posterior mean + sqrt(beta) * std."""
    if not observed:
        return candidates[0]
    x = np.array([v for v, _ in observed], dtype=float)
    y = np.array([s for _, s in observed], dtype=float)
    mean_y, std_y = y.mean(), y.std() or 1.0
    y = (y - mean_y) / std_y
    c = np.array(candidates, dtype=float)
    length = max(1.0, x.shape[1] / 8)
    k_xx = _kernel(x, x, length) + noise * np.eye(len(x))
    k_cx = _kernel(c, x, length)
    solve = np.linalg.solve(k_xx, np.column_stack([y, k_cx.T]))
    mu = k_cx @ solve[:, 0]
    var = np.clip(1.0 - np.einsum("ij,ji->i", k_cx, solve[:, 1:]), 1e-9, None)
    return candidates[int(np.argmax(mu + np.sqrt(beta * var)))]


def random_vectors(eligible: list[int], length: int, count: int, n: int, rng: random.Random) -> list[list[int]]:
    """n random 0/1 vectors of `length` with exactly `count` ones among `eligible` positions."""
    out = []
    for _ in range(n):
        vec = [0] * length
        for i in rng.sample(eligible, min(count, len(eligible))):
            vec[i] = 1
        out.append(vec)
    return out
