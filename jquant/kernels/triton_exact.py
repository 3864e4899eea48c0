"""Elementwise pieces Triton-backend Pallas kernels share to write the same bits as XLA's reference.

* Triton's ``/`` on float32 is the approximate ``div.full.f32``; ``ieee_divide`` uses PTX's correctly
  rounded ``div.rn.f32``, which ``jquant.formats.exact.exact_divide`` matches on every platform.
* Triton's min/max drop NaN where XLA's propagate it, so NaN is carried explicitly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.formats.exact import exact_divide


def ieee_divide(a, b, interpret: bool):
    """a / b correctly rounded, as ``exact_divide`` (interpret mode: ``exact_divide`` itself)."""
    if interpret:
        return exact_divide(a, b)
    from jax.experimental.pallas import triton as plt

    [q] = plt.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, jnp.broadcast_to(b, a.shape)], constraints="=f,f,f",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return q


def clip_keep_nan(y, lo: float, hi: float):
    """jnp.clip with NaN kept, as XLA's clamp keeps it."""
    return jnp.where(jnp.isnan(y), y, jnp.minimum(jnp.maximum(y, lo), hi))


def max_keep_nan(y, floor):
    """jnp.maximum(y, floor) with a NaN y kept, as XLA's max keeps it."""
    return jnp.where(jnp.isnan(y), y, jnp.maximum(y, floor))


def row_has_nan(x):
    """[rows] whether a row of the 2-D x holds a NaN."""
    return jnp.max(jnp.where(jnp.isnan(x), 1, 0), axis=1) > 0


def row_abs_max(x):
    """[rows] max |x| of each row of the 2-D x, NaN where the row holds one (as ``nan_max``)."""
    return jnp.where(row_has_nan(x), jnp.float32(jnp.nan), jnp.max(jnp.abs(x), axis=1))
