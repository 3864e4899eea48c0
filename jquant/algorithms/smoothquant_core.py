"""SmoothQuant scale migration (arXiv 2211.10438): per input channel ``s_j = max|X_j|^α / max|W_j|^(1−α)``.

Activation outlier channels make per-token int8 activations coarse. Dividing X by ``s`` and multiplying
the weight's K axis by ``s`` leaves ``X @ W.T`` unchanged while moving part of each channel's range
from the activations (hard to quantize) into the weight (easy); ``X / s`` is then folded into the
preceding norm's scale (``awq_core.fold_scales_into_norm``) so it costs nothing at inference.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

MIN_SCALE = 1e-5


def activation_absmax(x) -> jax.Array:
    """``max|X_j|`` per input channel over every leading axis of ``x [..., K]`` (float32 ``[K]``)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.max(jnp.abs(x.reshape(-1, x.shape[-1])), axis=0)


def smooth_scales(act_absmax, weights, alpha: float = 0.5) -> jax.Array:
    """The SmoothQuant migration scales ``[K]``.

    Args:
      act_absmax: ``max|X_j|`` per input channel ``[K]`` (``activation_absmax`` over calibration data).
      weights: one ``[N, K]`` weight, or several sharing the input (q/k/v): their column maxima are
        pooled, as one scale must serve all of them.
      alpha: migration strength in [0, 1]; 0 leaves activations alone up to the weight's range, 1 moves
        all of their range into the weight.

    A channel whose weight column is all zero uses ``MIN_SCALE`` as its maximum (no division by zero);
    a non-finite scale (NaN or Inf statistics) becomes 1 (that channel is left alone); every scale is
    clamped to at least ``MIN_SCALE``, as SmoothQuant's reference does.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    weights = [weights] if not isinstance(weights, Sequence) else list(weights)
    k = jnp.shape(act_absmax)[-1] if jnp.ndim(act_absmax) == 1 else None
    for w in weights:
        if jnp.ndim(w) != 2 or jnp.shape(w)[1] != k:
            raise ValueError(f"weights must be [N, K] with K = len(act_absmax) = {k}, got shape "
                             f"{tuple(jnp.shape(w))} (act_absmax shape {tuple(jnp.shape(act_absmax))})")
    w_absmax = jnp.max(jnp.stack([jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=0) for w in weights]),
                       axis=0)
    a = jnp.asarray(act_absmax, jnp.float32)
    s = a ** alpha / jnp.maximum(w_absmax, MIN_SCALE) ** (1.0 - alpha)
    s = jnp.where(jnp.isfinite(s), s, 1.0)
    return jnp.maximum(s, MIN_SCALE)


def smooth_activations(x, scales) -> jax.Array:
    """``X / s`` along the last (K) axis, in float32."""
    return jnp.asarray(x, jnp.float32) / scales


def smooth_weight(w, scales) -> jax.Array:
    """``W · s`` along K of a ``[N, K]`` weight, in float32."""
    return jnp.asarray(w, jnp.float32) * scales


def smooth(x, w, alpha: float = 0.5) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(s, X / s, W · s)`` for one linear layer, with ``s`` from ``x``'s own channel maxima."""
    s = smooth_scales(activation_absmax(x), w, alpha)
    return s, smooth_activations(x, s), smooth_weight(w, s)
