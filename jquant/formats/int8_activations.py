"""Dynamic and static INT8 activation quantization, as vLLM's W8A8 INT8 path does it (symmetric).

* per token (``quantize_int8_per_token``): ``s = amax / 127`` per row in float32, codes
  ``sat(rint(x · (127 / amax)))``: vLLM multiplies by the reciprocal it computes once per token
  (``dynamic_scaled_int8_quant``); an all-zero row gets scale 0 and codes 0 (its ``0 · Inf`` is NaN,
  which the CUDA conversion ``cvt.rni.sat.s8.f32`` turns into 0, as here); NaN elements are left out
  of the row's amax (``fmaxf``) and get code 0.
* per tensor, static (``quantize_int8_static``): codes ``sat(rint(x / s))`` with a checkpoint's
  ``input_scale``.

``rint``: round half to even; ``sat``: clamp to [-128, 127] (PTX ``cvt.rni.sat.s8.f32``); NaN → 0.
The QTensor is ``"int8"``: uint8 codes ``q + 128`` and float32 scales, so it dequantizes like any
int8 tensor; ``signed_int8`` gives the GEMM its signed codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.formats.exact import exact_divide
from jquant.qtensor import QTensor

__all__ = ["quantize_int8_per_token", "quantize_int8_static", "signed_int8"]


def _codes(scaled):
    """vLLM's ``float_to_int8_rn``: round half to even, saturate, NaN → 0 (as uint8 ``q + 128``)."""
    q = jnp.clip(jnp.rint(scaled), -128, 127)
    return (jnp.where(jnp.isnan(q), 0, q) + 128).astype(jnp.uint8)


def _check(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be a float array [..., K] with K ≥ 1, got {x.dtype} of shape {tuple(x.shape)}")
    return x


def quantize_int8_per_token(x) -> QTensor:
    """Symmetric INT8 codes with one float32 scale per row of the last axis (vLLM's dynamic per-token
    activation quantization).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.formats.int8_activations import quantize_int8_per_token, signed_int8
      >>> qt = quantize_int8_per_token(jnp.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]]))
      >>> signed_int8(qt).tolist(), qt.scale.ravel().tolist()  # 127 · 0.25 = 31.75 → 32
      ([[127, -64, 32], [0, 0, 0]], [0.007874015718698502, 0.0])
    """
    x = _check(x)
    xf = x.astype(jnp.float32)
    # fmaxf in vLLM's reduction skips NaN: a NaN element leaves the row's scale alone (its code is 0).
    amax = jnp.max(jnp.where(jnp.isnan(xf), 0.0, jnp.abs(xf)), axis=-1, keepdims=True)
    # vLLM: scale = amax / 127 stored, codes from x · (127 / amax), both in float32.
    # Correctly rounded divisions (XLA would turn ``amax / 127`` into a multiply an ulp off).
    codes = _codes(xf * exact_divide(jnp.full_like(amax, 127.0), amax))
    block = (1,) * (x.ndim - 1) + (x.shape[-1],)
    return QTensor(data=codes, scale=exact_divide(amax, 127.0), fmt="int8", shape=x.shape, dtype=x.dtype,
                   block=block, k_axis=x.ndim - 1, options=(("granularity", "token"),))


def quantize_int8_static(x, scale) -> QTensor:
    """Symmetric INT8 codes with a given per-tensor scale (a checkpoint's ``input_scale``).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.formats.int8_activations import quantize_int8_static, signed_int8
      >>> signed_int8(quantize_int8_static(jnp.array([[0.5, 1.5, 2.5, 300.0]]), 1.0)).tolist()  # half to even, saturating
      [[0, 2, 2, 127]]
    """
    x = _check(x)
    s = jnp.asarray(scale, jnp.float32)
    if s.size != 1:
        raise ValueError(f"a static INT8 activation scale is one value (per tensor), got shape {tuple(s.shape)}")
    s = s.reshape((1,) * x.ndim)
    codes = _codes(exact_divide(x.astype(jnp.float32), s))
    return QTensor(data=codes, scale=s, fmt="int8", shape=x.shape, dtype=x.dtype, block=tuple(x.shape),
                   k_axis=x.ndim - 1, options=(("granularity", "static"),))


def signed_int8(qt: QTensor) -> jax.Array:
    """The signed codes (``int8``) of an ``"int8"`` QTensor.

    Examples:
      >>> import jax.numpy as jnp, jquant
      >>> from jquant.formats.int8_activations import signed_int8
      >>> signed_int8(jquant.quantize(jnp.array([[1.0, -1.0]]), "int8")).tolist()
      [[127, -127]]
    """
    if qt.fmt != "int8":
        raise ValueError(f"signed_int8 takes an int8 QTensor, got fmt={qt.fmt!r}")
    return (qt.data.astype(jnp.int16) - 128).astype(jnp.int8)
