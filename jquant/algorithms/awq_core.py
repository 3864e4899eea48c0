"""AWQ (arXiv 2306.00978) for one linear layer: an activation-aware scale search, then a clip search.

Input channels that see large activations matter most to the output, so AWQ multiplies their weight
columns by ``s > 1`` before quantizing (their relative quantization error shrinks) and divides the
activations by ``s`` (folded into the preceding norm or linear, so inference pays nothing). ``s`` is
``x_mean^α`` for the α on a grid that minimises the layer's output error under the target weight
format; then each (output channel, group)'s range is shrunk to the ratio that minimises that group's
output error. The formulas and defaults follow AutoAWQ's ``_search_best_scale`` / ``_search_best_clip``.

Everything is float32 and jittable; ``qdq`` (quantize-then-dequantize of an ``[N, K]`` weight) is a
static callable, so a stable one (``int_qdq``) compiles once. Layers sharing one input (q/k/v,
gate/up) are searched as one weight concatenated along N, as AutoAWQ does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jquant.formats.integer import quantize_int

QDQ = Callable[[jax.Array], jax.Array]

N_GRID = 20
MAX_SHRINK = 0.5
N_SAMPLE_TOKENS = 512
SCALE_FLOOR = 1e-4  # AutoAWQ's clamp on candidate scales and duo-scaling's denominator epsilon
GROUP_EPS = 1e-6  # AutoAWQ's epsilon on a group's absmax in duo scaling


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scales", "weight", "alpha", "losses",
                                                                  "clip_max"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AWQResult:
    """What ``awq`` found for one layer.

    Attributes:
      scales: ``[K]``; activations are divided by them (``fold_scales_into_norm`` /
        ``fold_into_previous_linear``), the weight was multiplied by them.
      weight: ``[N, K]`` float32, ``W · s`` with the best clipping applied: quantize this one.
      alpha: the chosen grid exponent (0-d).
      losses: ``[n_grid]`` mean squared output error of each α.
      clip_max: ``[N, K / group_size]`` the clipping bound of each group of the scaled weight (its
        absmax where no shrink helped, or where clipping was off).
    """

    scales: jax.Array
    weight: jax.Array
    alpha: jax.Array
    losses: jax.Array
    clip_max: jax.Array


@functools.lru_cache(maxsize=None)
def int_qdq(bits: int = 4, group_size: int = 128, symmetric: bool = False) -> QDQ:
    """Quantize-dequantize of an ``[N, K]`` weight in groups along K; the default is AWQ's own format
    (uint4 with zero points, groups of 128, float16 scales as its checkpoints store). Cached, so the
    same settings give the same callable and ``awq`` compiles once per shape."""
    @jax.jit
    def qdq(w):
        return quantize_int(w, bits=bits, symmetric=symmetric, group_size=group_size,
                            scale_dtype=jnp.float16).dequantize(jnp.float32)
    return qdq


def activation_mean(x) -> jax.Array:
    """``mean|X_j|`` per input channel over every leading axis of ``x [..., K]`` (float32 ``[K]``)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.mean(jnp.abs(x.reshape(-1, x.shape[-1])), axis=0)


def weight_mean(w, group_size: int) -> jax.Array:
    """Duo scaling's weight statistic ``[K]``: ``|W|`` over its group's absmax, averaged over N."""
    w = jnp.abs(jnp.asarray(w, jnp.float32))
    groups = w.reshape(w.shape[0], -1, group_size)
    normalised = groups / (jnp.max(groups, axis=-1, keepdims=True) + GROUP_EPS)
    return jnp.mean(normalised.reshape(w.shape), axis=0)


def grid_alphas(n_grid: int = N_GRID) -> jax.Array:
    """``i / n_grid`` for ``i`` in ``0 .. n_grid-1``: α = 0 (plain RTN) first, 1 excluded."""
    return jnp.arange(n_grid, dtype=jnp.float32) / n_grid


def grid_scales(x_mean, n_grid: int = N_GRID, w_mean=None) -> jax.Array:
    """Candidate scales ``[n_grid, K]``: ``x_mean^α`` (or ``x_mean^α / (w_mean^(1−α) + 1e-4)`` with duo
    scaling), clamped to ≥ 1e-4, then divided by ``sqrt(max · min)`` so they straddle 1."""
    alpha = grid_alphas(n_grid)[:, None]
    s = x_mean[None, :] ** alpha
    if w_mean is not None:
        s = s / (w_mean[None, :] ** (1.0 - alpha) + SCALE_FLOOR)
    s = jnp.maximum(s, SCALE_FLOOR)
    return s / jnp.sqrt(jnp.max(s, axis=1, keepdims=True) * jnp.min(s, axis=1, keepdims=True))


def scale_search(w, x, qdq: QDQ, n_grid: int = N_GRID, w_mean=None, n_loss_tokens: int | None = None):
    """The AWQ grid search: ``(scales [K], alpha, losses [n_grid])``.

    ``loss(α) = mean((X Wᵀ − X (Q(W·s)/s)ᵀ)²)`` over all tokens and outputs (or every
    ``max(1, T // n_loss_tokens)``-th token: the loss costs ``n_grid`` GEMMs over them, the
    activation statistic ``x_mean`` always reads every token); the first minimum wins (AutoAWQ keeps
    a candidate only when strictly better).
    """
    w, x = _check(w, x)
    candidates = grid_scales(activation_mean(x), n_grid, w_mean)
    if n_loss_tokens is not None:
        x = x[:: max(1, x.shape[0] // n_loss_tokens)]
    reference = x @ w.T

    def loss(s):
        return jnp.mean((reference - x @ (qdq(w * s) / s).T) ** 2)

    losses = jax.lax.map(loss, candidates)
    best = jnp.argmin(losses)
    return candidates[best], grid_alphas(n_grid)[best], losses


def clip_search(w, x, qdq: QDQ, group_size: int, n_grid: int = N_GRID, max_shrink: float = MAX_SHRINK,
                n_sample_tokens: int = N_SAMPLE_TOKENS) -> jax.Array:
    """The AWQ clip search: the bound ``[N, K / group_size]`` for each group of ``w``.

    Each group's absmax is shrunk by ``1 − i / n_grid`` for ``i < int(max_shrink · n_grid)``; the weight
    clamped to ``±bound`` is quantized with ``qdq`` (whose groups must be these groups, so that every
    group's error is its own), and the group's error is the mean over sampled tokens of its squared
    partial output error ``(Σ_{k∈g} X_tk (Q_nk − W_nk))²``. Tokens are sampled every
    ``max(1, T // n_sample_tokens)``-th.
    """
    w, x = _check(w, x, group_size)
    x = x[:: max(1, x.shape[0] // n_sample_tokens)]
    n, k = w.shape
    xg = x.reshape(x.shape[0], k // group_size, group_size)
    absmax = jnp.max(jnp.abs(w.reshape(n, -1, group_size)), axis=-1)
    ratios = 1.0 - jnp.arange(int(max_shrink * n_grid), dtype=jnp.float32) / n_grid

    def group_errors(ratio):
        bound = absmax * ratio
        diff = qdq(apply_clip(w, bound)) - w
        partial = jnp.einsum("tgj,ngj->ngt", xg, diff.reshape(n, -1, group_size))
        return jnp.mean(partial ** 2, axis=-1)

    errors = jax.lax.map(group_errors, ratios)
    return absmax * ratios[jnp.argmin(errors, axis=0)]


def apply_clip(w, bound) -> jax.Array:
    """``w [N, K]`` clamped to ``±bound`` per group (``bound`` is ``[N, K / group_size]``)."""
    b = jnp.repeat(bound, w.shape[1] // bound.shape[1], axis=1)
    return jnp.clip(w, -b, b)


@functools.partial(jax.jit, static_argnames=("qdq", "group_size", "n_grid", "max_shrink", "n_sample_tokens",
                                             "duo_scaling", "clip"))
def awq(w, x, qdq: QDQ, *, group_size: int = 128, n_grid: int = N_GRID, max_shrink: float = MAX_SHRINK,
        n_sample_tokens: int = N_SAMPLE_TOKENS, duo_scaling: bool = False, clip: bool = True) -> AWQResult:
    """AWQ for one linear layer ``y = x @ w.T``.

    Args:
      w: ``[N, K]`` weight.
      x: calibration activations ``[..., K]`` (all tokens are used by the scale search).
      qdq: quantize-dequantize of an ``[N, K]`` float32 weight in the target format (``int_qdq()``).
      group_size: the format's group size along K (clip groups; duo scaling's weight groups).
      n_grid: α grid points in [0, 1) and the clip ratio step ``1 / n_grid``.
      max_shrink: the largest fraction of a group's range the clip search may cut.
      n_sample_tokens: about how many tokens the clip search uses.
      duo_scaling: AutoAWQ's default since 0.2: also divide by ``w_mean^(1−α)``; off gives the paper's
        ``x_mean^α``.
      clip: run the clip search (AutoAWQ skips it for q/k projections, whose dot products it upsets).
    """
    w, x = _check(w, x, group_size)
    w_mean = weight_mean(w, group_size) if duo_scaling else None
    scales, alpha, losses = scale_search(w, x, qdq, n_grid, w_mean)
    scaled = w * scales
    if clip:
        bound = clip_search(scaled, x / scales, qdq, group_size, n_grid, max_shrink, n_sample_tokens)
        scaled = apply_clip(scaled, bound)
    else:
        bound = jnp.max(jnp.abs(scaled.reshape(scaled.shape[0], -1, group_size)), axis=-1)
    return AWQResult(scales=scales, weight=scaled, alpha=alpha, losses=losses, clip_max=bound)


def fold_scales_into_norm(norm_scale, scales) -> jax.Array:
    """The preceding RMSNorm / LayerNorm scale ``[K]`` with the activations' ``1/s`` folded in (a
    LayerNorm bias ``[K]`` folds the same way)."""
    return jnp.asarray(norm_scale, jnp.float32) / scales


def fold_into_previous_linear(w_prev, scales) -> jax.Array:
    """The preceding linear ``[K, K_in]`` (its outputs are this layer's K inputs; e.g. v_proj before
    o_proj, up_proj before down_proj) with its output rows divided by ``s``; its bias ``[K]`` folds
    like a norm scale (``fold_scales_into_norm``)."""
    w_prev = jnp.asarray(w_prev, jnp.float32)
    if w_prev.ndim != 2 or w_prev.shape[0] != scales.shape[0]:
        raise ValueError(f"w_prev must be [K, K_in] with K = {scales.shape[0]}, got shape {tuple(w_prev.shape)}")
    return w_prev / scales[:, None]


def _check(w, x, group_size: int | None = None):
    w = jnp.asarray(w, jnp.float32)
    x = jnp.asarray(x, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., K] must have K = {w.shape[1]} (w's), got shape {tuple(x.shape)}")
    if group_size is not None and (group_size <= 0 or w.shape[1] % group_size):
        raise ValueError(f"group_size must be a positive divisor of K = {w.shape[1]}, got {group_size}")
    return w, x.reshape(-1, x.shape[-1])
