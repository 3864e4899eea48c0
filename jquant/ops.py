"""Products with quantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.qtensor import QTensor


def qdot(x: jax.Array, w: QTensor, *, preferred_element_type=None) -> jax.Array:
    """``jnp.dot(x, w)`` for a QTensor ``w`` with logical shape ``[K, N]`` (a Flax kernel's orientation).

    Dequantizes ``w`` to ``x``'s dtype and accumulates in fp32; the result has ``x``'s dtype unless
    ``preferred_element_type`` says otherwise. For ``[N, K]`` weights with a kernel path use
    ``Scheme.apply``.
    """
    if not isinstance(w, QTensor):
        raise TypeError(f"qdot expects a QTensor weight, got {type(w).__name__}")
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"qdot: x with shape {tuple(x.shape)} cannot multiply a weight of shape {w.shape} "
                         f"(need x[..., K] and w[K, N])")
    y = jnp.dot(x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(preferred_element_type or x.dtype)
