"""bitsandbytes LLM.int8() (arXiv 2208.07339): ``"int8_bnb"`` weights and the mixed int8 / float matmul.

Checked against bitsandbytes 0.50.2 on a CPU (its torch operators, with ``torch._int_mm`` for the int8
product on AVX-512 machines: exact int32 sums, as on GPUs; the float32 fallback elsewhere is exact only
while |sums| < 2^24, K ≲ 1040), as ``Linear8bitLt`` / ``Int8Params`` quantize and vLLM's
``_apply_8bit_weight`` multiplies (a ``MatmulLtState`` with ``is_training=False``):

* Weight ``[N, K]``: cast to float16 first (values past 65504 become ±Inf), ``SCB`` = the row's float32
  absmax (a NaN makes it NaN), int8 codes ``round_half_even(w · (127 / SCB))`` in float32, with
  ``127 / SCB`` computed as torch does, ``(1 / SCB) · 127``. A row of zeros, or one holding NaN or
  Inf, gets codes 0 (its ``0 · Inf`` / NaN products, which torch's int8 conversion makes 0 on x86).
* Dequantization: ``(code · SCB) · 0.007874016`` (1/127 as a float32), two roundings.
* The matmul (``bitsandbytes.matmul``), for activations ``x [M, K]``: x is quantized from its float16
  copy. With a threshold ``t > 0``, every element with ``|x| ≥ t`` (``t`` rounded to float16, as torch
  compares) is an outlier and its whole column of x an outlier column. The rest is quantized per row
  as the weight is (outlier elements zeroed before the row's absmax), outlier columns' codes zeroed,
  and multiplied with int32 sums: ``((acc · (row · SCB)) · 6.200124e-05)`` rounded to x's dtype.
  Outlier columns, in x's dtype, meet the dequantized weight columns (rounded to x's dtype) in a
  float32 sum added to that product: one rounding for 16-bit x (torch's ``addmm``), two for float32
  x (its BLAS rounds the sum first). The float32 sum's order is XLA's, not torch's: float32 products
  agree to a few ulp, and a 16-bit one differs in its last bit where the sum lands within float32
  rounding of a 16-bit midpoint (1 of 8192 outputs of a float16 layer with 6 outlier columns; none in
  two bfloat16 layers through vLLM's path). The outlier columns are the whole call's: a token's
  product depends on the other tokens multiplied with it, as in bitsandbytes. vLLM passes bfloat16 x
  (``Scheme.apply`` does too).

The QTensor holds int8 codes ``[N, K]`` and ``SCB`` as its float32 scale ``[N, 1]``. On CUDA
bitsandbytes runs its own kernels for the same formulas; those were not compared here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats.base import register_preset, register_quantizer
from jquant.formats.blocking import check_float_input
from jquant.formats.exact import exact_abs_max, exact_reciprocal, to_float32_exact
from jquant.qtensor import QTensor, register_format

FORMAT = "int8_bnb"
DEFAULT_THRESHOLD = 6.0   # bitsandbytes' and transformers' llm_int8_threshold
_INV_127 = np.float32(7.874015718698502e-3)        # bitsandbytes' 1 / 127
_INV_127_SQUARED = np.float32(6.200124e-05)          # ... and 1 / 127²


def _row_codes(x16, absmax):
    """``round_half_even(x · (127 / absmax))`` as int8, NaN → 0 (x float16 as float32, absmax [rows, 1]).

    torch computes ``127.0 / absmax`` as ``absmax.reciprocal() * 127`` (two roundings; the correctly
    rounded quotient moved 3 of 6144 bfloat16 weights' codes)."""
    scaled = x16 * (exact_reciprocal(absmax) * np.float32(127.0))
    q = jnp.rint(scaled)
    return jnp.where(jnp.isnan(q), 0, q).astype(jnp.int8)


def quantize_int8_bnb(x, axis: int = -1) -> QTensor:
    """LLM.int8() weight quantization of a 2-D ``x`` along ``axis`` (``Int8Params``: float16, row absmax).

    Examples:
      >>> import numpy as np, jquant
      >>> w = np.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], np.float32)
      >>> qt = jquant.quantize(w, "int8_bnb")
      >>> qt.data.tolist(), qt.scale.ravel().tolist()  # 0.25 · 127 = 31.75 → 32; a zero row codes 0
      ([[64, -127, 32], [0, 0, 0]], [1.0, 0.0])
      >>> qt.dequantize().tolist()[0]  # (code · SCB) · float32(1 / 127)
      [0.5039370059967041, -1.0, 0.25196850299835205]
    """
    x = check_float_input(x, FORMAT)
    if x.ndim != 2:
        raise ValueError(f"{FORMAT} quantizes a 2-D weight [N, K] row by row, got shape {tuple(x.shape)}")
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"{FORMAT}: axis must be an axis of a 2-D weight (0, 1, -1 or -2), got {axis!r}")
    axis = axis % 2
    w = jnp.moveaxis(x, axis, 1).astype(jnp.float16).astype(jnp.float32)
    # From the bits: XLA's CPU max drops NaN from rows of ~4096 and more, torch's keeps it.
    absmax = exact_abs_max(w, axis=1)[:, None]
    codes = _row_codes(w, absmax)
    if axis == 0:
        codes, absmax = codes.T, absmax.T
    block = (x.shape[0], 1) if axis == 0 else (1, x.shape[1])
    return QTensor(data=codes, scale=absmax, fmt=FORMAT, shape=x.shape, dtype=x.dtype, block=block, k_axis=axis)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(qt: QTensor, dtype) -> jax.Array:
    return ((qt.data.astype(jnp.float32) * qt.scale.astype(jnp.float32)) * _INV_127).astype(dtype)


def llm_int8_matmul(x: jax.Array, qweight: QTensor, threshold: float = DEFAULT_THRESHOLD) -> jax.Array:
    """``x [..., K] · Wᵀ`` as bitsandbytes' ``matmul`` (``MatMul8bitLt``, inference: ``is_training=False``,
    as vLLM sets it) computes it for an ``"int8_bnb"`` weight ``[N, K]`` (K its last axis): ``[..., N]``
    in x's dtype, no bias.

    x is quantized from its float16 copy; the product is rounded to x's dtype, and the outlier columns
    are multiplied in x's dtype (vLLM passes bfloat16). ``threshold`` 0 turns the decomposition off.

    Examples:
      >>> import numpy as np, jquant
      >>> from jquant.formats.bnb_int8 import llm_int8_matmul
      >>> w = jquant.quantize(np.eye(4, dtype=np.float32), "int8_bnb")
      >>> x = np.array([[1.0, 2.0, 3.0, 40.0]], np.float16)  # 40 ≥ 6: column 3 is multiplied in float16
      >>> llm_int8_matmul(x, w).tolist()  # the others in int8 with the row scale 3 / 127
      [[0.9921875, 2.0078125, 3.0, 40.0]]
    """
    if qweight.fmt != FORMAT or qweight.ndim != 2 or qweight.k_axis != 1:
        raise ValueError(f"llm_int8_matmul takes an {FORMAT!r} weight [N, K] with K last, got fmt={qweight.fmt!r} "
                         f"shape {qweight.shape} k_axis={qweight.k_axis}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating, np.integer)):
        raise TypeError(f"threshold must be a Python number (it decides the program's shape), got "
                        f"{type(threshold).__name__}")
    if not np.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be finite and >= 0, got {threshold!r}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1 or x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"llm_int8_matmul: x must be a float array [..., K] with K = {qweight.shape[1]} (the "
                         f"weight's {qweight.shape}), got {x.dtype} of shape {tuple(x.shape)}")
    lead, k = x.shape[:-1], x.shape[-1]
    y = _matmul(x.reshape(-1, k), qweight.data, qweight.scale.reshape(-1), float(threshold))
    return y.reshape(*lead, qweight.shape[0])


@functools.partial(jax.jit, static_argnums=3)
def _matmul(x, codes, scb, threshold):
    dtype = x.dtype
    a = x.astype(jnp.float16).astype(jnp.float32)
    if threshold > 0:
        with np.errstate(over="ignore"):   # a threshold past 65504 is +Inf in float16, as in torch
            outlier = jnp.abs(a) >= float(np.float16(threshold))     # torch compares in float16
        columns = jnp.any(outlier, axis=0)
        a = jnp.where(outlier, 0.0, a)
    else:
        columns = jnp.zeros(a.shape[1], bool)
    row = exact_abs_max(a, axis=1)[:, None]
    a_codes = jnp.where(columns, 0, _row_codes(a, row))
    acc = jax.lax.dot_general(a_codes, codes, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    scb = scb.astype(jnp.float32)
    out = ((acc.astype(jnp.float32) * (row * scb[None, :])) * _INV_127_SQUARED).astype(dtype)
    if threshold == 0:
        return out
    # The barrier keeps the product rounded to x's dtype before the sum is added, and out of an FMA with
    # it (float32 x: one fused rounding moved a nearly cancelling output by ~2900 ulp).
    out = jax.lax.optimization_barrier(out)
    # Rounded to x's dtype and read back by to_float32_exact: under jit XLA's excess-precision rewrite
    # drops a plain round trip (the unrounded weight gave 0.0634765625 against bitsandbytes' 0.0625 at
    # K = 4096).
    w = to_float32_exact(((codes.astype(jnp.float32) * scb[:, None]) * _INV_127).astype(dtype))
    sub = jnp.where(columns, x, jnp.zeros_like(x)).astype(jnp.float32)
    extra = jax.lax.dot_general(sub, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=jax.lax.Precision.HIGHEST)
    # Without outlier columns bitsandbytes adds nothing (a 0 · Inf weight would otherwise add NaN).
    return jnp.where(jnp.any(columns), (out.astype(jnp.float32) + extra).astype(dtype), out)


register_quantizer(FORMAT, quantize_int8_bnb)
register_format(FORMAT, _dequantize)
register_preset("bitsandbytes", FORMAT, {})
