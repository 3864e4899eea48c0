"""Lloyd-Max scalar quantizer for N(0, 1/d) coordinates.

``unit_centroids``: the exact-integral optimum of N(0, 1) (distortion figures; expected distortion per
unit vector, arXiv 2504.19874: b=1..4 -> 0.3634, 0.1175, 0.0346, 0.0095).
``centroids``: the table the cache encodes and decodes with, solved as vLLM solves it
(turboquant/centroids.py solve_lloyd_max): 200-interval trapezoid integrals, outer cells cut at
+-10.5 sigma, start uniform on +-3.5 sigma, at most 200 iterations (tol 1e-10). That solver is not
converged at 4 bits; its centroids differ from the exact ones by up to 7e-4 relative, enough to move
boundary coordinates to another index, so the vLLM table is the one used.
"""

from __future__ import annotations

import functools
import math

import numpy as np

_SQRT2 = math.sqrt(2.0)


def _pdf(x):
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x):
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / _SQRT2))


@functools.lru_cache(maxsize=None)
def unit_centroids(bits: int, iters: int = 500) -> tuple[float, ...]:
    """Sorted Lloyd-Max centroids of N(0, 1) with 2**bits levels (cached)."""
    n = 2**bits
    c = np.linspace(-2.5, 2.5, n)
    for _ in range(iters):
        edges = np.concatenate([[-np.inf], 0.5 * (c[1:] + c[:-1]), [np.inf]])
        a, b = edges[:-1], edges[1:]
        c = (_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a))
    return tuple(float(v) for v in c)


def unit_distortion(bits: int) -> float:
    """E[(x - Q(x))^2] for x ~ N(0, 1), i.e. the MSE per unit vector after rotation."""
    c = np.asarray(unit_centroids(bits))
    edges = np.concatenate([[-np.inf], 0.5 * (c[1:] + c[:-1]), [np.inf]])
    a, b = edges[:-1], edges[1:]
    pa, pb = _pdf(a), _pdf(b)
    af = np.where(np.isfinite(a), a, 0.0)
    bf = np.where(np.isfinite(b), b, 0.0)
    m0 = _cdf(b) - _cdf(a)
    m1 = pa - pb
    m2 = m0 + af * pa - bf * pb
    return float(np.sum(m2 - 2 * c * m1 + c * c * m0))


@functools.lru_cache(maxsize=None)
def _vllm_table(head_dim: int, bits: int) -> np.ndarray:
    n = 2**bits
    var = 1.0 / head_dim
    sigma = math.sqrt(var)
    coef = 1.0 / math.sqrt(2 * math.pi * var)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = np.array([lo + (hi - lo) * (i + 0.5) / n for i in range(n)])
    steps = np.arange(1, 200)
    for _ in range(200):
        edges = np.concatenate([[lo * 3], (c[:-1] + c[1:]) / 2.0, [hi * 3]])
        a, b = edges[:-1, None], edges[1:, None]
        h = (b - a) / 200
        x = np.concatenate([a, b, a + steps * h], axis=1)   # [cells, 201]: ends first, then interior
        pdf = coef * np.exp(-x * x / (2 * var))

        def trapz(f):
            # cumsum adds strictly left to right: the same order as a Python loop over the points
            f = np.concatenate([0.5 * (f[:, :1] + f[:, 1:2]), f[:, 2:]], axis=1)
            return np.cumsum(f, axis=1)[:, -1] * h[:, 0]

        num, den = trapz(x * pdf), trapz(pdf)
        new = np.where(den > 1e-15, num / np.where(den > 1e-15, den, 1.0), c)
        if np.max(np.abs(new - c)) < 1e-10:
            break
        c = new
    c = c.astype(np.float32)
    c.setflags(write=False)
    return c


def centroids(head_dim: int, bits: int) -> np.ndarray:
    """vLLM's float32 centroids for N(0, 1/head_dim) (see the module docstring; cached, read-only)."""
    return _vllm_table(head_dim, bits)
