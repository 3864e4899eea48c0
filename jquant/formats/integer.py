"""Integer weight formats: ``int2``..``int8`` (symmetric) and ``uint2``..``uint8`` (zero points).

Storage (one convention for every bit width, so layouts only re-pack bytes):

* ``data``: unsigned codes packed along ``axis`` with ``pack_bits`` (low bits first; ``pack_axis``
  is None for 8 bits, one code per byte). Symmetric codes are stored biased, ``u = q + 2**(b-1)``
  (vLLM's ``uint4b8`` / ``uint8b128``, GPTQ's symmetric zero point, compressed-tensors' pack offset).
* ``scale``: one float per block in ``scale_dtype`` (default float32; GPTQ/AWQ store float16).
* ``zero`` (``uint*`` only): one integer zero point per block, uint8, *not* packed (it is as small
  as the scales and keeps their shape, so it shards and indexes like them).
* ``group_index`` (``quantize_int_with_params`` only): GPTQ act-order ``g_idx``.

Arithmetic (``arithmetic="float32"``, the default: float32 whatever the input dtype, true IEEE
divisions as PyTorch / numpy compute them, see ``exact_divide``):

* symmetric: ``s = amax / d`` with ``d = 2**(b-1) - 1`` (``symmetric_range="restricted"``, the
  default: codes stay in ``±(2**(b-1)-1)`` so ``-x`` quantizes to ``-q``; torchao / vLLM int8 / llama.cpp)
  or ``d = 2**(b-1) - 0.5`` (``"full"``: amax lands on the half-way point of the full signed range
  ``[-2**(b-1), 2**(b-1)-1]``, which is what GPTQ's ``(2·amax)/maxq`` and compressed-tensors'
  ``amax / (bit_range/2)`` compute); ``q = clamp(round(x/s), -2**(b-1), 2**(b-1)-1)``.
* asymmetric: the range always contains 0 (``min ≤ 0 ≤ max``, as GPTQ and compressed-tensors do,
  so 0 is exact); ``s = (max-min)/(2**b-1)``, ``z = clamp(round(-min/s), 0, 2**b-1)``,
  ``q = clamp(round(x/s) + z, 0, 2**b-1)``; ``x ≈ (q - z)·s``.
* rounding: half to even (torch/numpy) unless ``rounding="half_away"`` (ggml's ``roundf``).
* an all-zero block gets scale 0 and codes equal to the zero point, so it dequantizes to exact 0.
* ``arithmetic="compressed-tensors"`` instead replays compressed-tensors op for op in x's dtype
  (bfloat16 weights: every intermediate rounded to bfloat16), its zero point formula
  ``round(-2**(b-1) - min/s)`` and its eps for zero scales; float32 inputs give the same bytes as
  the default arithmetic except on ulp-level ties. Its zero point divides by the scale *before* a zero
  scale becomes eps, so an all-zero group has zero point NaN → int8 0 (stored ``2**(b-1)``, codes too).
* tiny magnitudes: XLA flushes float32 subnormals (inputs and results); blocks with amax < 2**-60 are
  computed lifted by 2**64 and a subnormal scale is rounded on the integer grid (``exact.py``), so
  scales and codes equal PyTorch / numpy's IEEE ones down to the smallest subnormal. Stored subnormal
  scales are real bit patterns, but ``dequantize`` (XLA arithmetic) flushes their products to 0.
* near float32's max: ``hi - lo`` can overflow to Inf, and then the scale is Inf as in every reference.

Non-finite inputs (checked at 256×4096 for tensor / channel / group blocks, tests/test_int_fp8_contract):

* NaN: the block's min/max (``nan_min``/``nan_max``: XLA's CPU reductions drop NaN from ≥ ~4096
  elements) and so its scale are NaN, and the whole block dequantizes to NaN; other blocks are
  untouched (per tensor: the tensor). NaN codes are stored as the zero point (``2**(b-1)`` for
  ``int*``); under compressed-tensors arithmetic as signed 0, what PyTorch's NaN → int8 cast gives.
* ±Inf: the block's scale is Inf, finite values get code 0 (x / Inf), the Inf one NaN, and the block
  dequantizes to NaN (0 · Inf), or ±Inf where compressed-tensors' signed-0 NaN code minus its zero point
  is non-zero: exactly compressed-tensors' and gguf's result (tests/test_adversarial_int_fp8).

Presets (``quantize(x, fmt, like=...)``): ``"compressed-tensors"`` for ``int2..8`` / ``uint2..8``
(``COMPRESSED_TENSORS_OPTIONS``: its arithmetic, scales in the weight's dtype), ``"gguf"`` for ``int8``
(Q8_0). Not registered: torchao's int8 / int4 (it clamps scales to a minimum eps and its int4 uses a
float zero-point domain, neither of which this format has), GPTQ / AWQ (their scales come from their
own algorithms: ``quantize_int_with_params``), gguf Q4_0 / Q4_1 (other formulas), vLLM (it consumes
these checkpoints, it does not quantize weights).

GGUF Q8_0 is ``int8`` with ``GGUF_Q8_0_OPTIONS`` (blocks of 32, ``d = amax/127`` computed in float32,
codes ``roundf(x · (1/d))`` from that unrounded ``d``, ``d`` stored as float16), also registered
as the quantizer ``"gguf_q8_0"``. One documented deviation: a block with ``d < 2**-128`` (amax below
~4e-37) makes gguf-py's ``1/d`` overflow to Inf and its codes ``int8(±Inf)``, a platform-defined cast
(0 on x86); jquant keeps the exact codes of ``x · (1/d)``. Both store ``d`` as float16 0, so both
dequantize such a block to 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats.base import register_preset, register_quantizer
from jquant.formats.blocking import (block_axes, check_float_input, group_block, nan_max, nan_min, per_block,
                                     to_blocks)
from jquant.formats.exact import (LIFT, exact_abs_max, exact_divide, exact_reciprocal, is_tiny, lift,
                                  round_to_precision, store_exact, to_float32_exact, unlift_quotient)
from jquant.formats.packing import codes_per_group, pack_bits, unpack_bits
from jquant.qtensor import QTensor, register_format

BITS = tuple(range(2, 9))
GRANULARITIES = ("tensor", "channel", "group")
SYMMETRIC_RANGES = ("restricted", "full")
ROUNDINGS = ("half_even", "half_away")
ARITHMETICS = ("float32", "compressed-tensors")

GGUF_Q8_0_OPTIONS = dict(granularity="group", group_size=32, scale_dtype=jnp.dtype(jnp.float16),
                         rounding="half_away", reciprocal=True, quantize_with_stored_scale=False)
COMPRESSED_TENSORS_OPTIONS = dict(arithmetic="compressed-tensors", scale_dtype=None)


def int_format(bits: int, symmetric: bool) -> str:
    """Format name: ``"int4"`` (symmetric) or ``"uint4"`` (zero points).

    Examples:
      >>> from jquant.formats.integer import int_format
      >>> int_format(4, True), int_format(8, False)
      ('int4', 'uint8')
    """
    return f"{'int' if symmetric else 'uint'}{bits}"


def parse_int_format(fmt: str) -> tuple[int, bool]:
    """``"int4"`` → ``(4, True)``; ``"uint4"`` → ``(4, False)``.

    Examples:
      >>> from jquant.formats.integer import parse_int_format
      >>> parse_int_format("int4"), parse_int_format("uint8")
      ((4, True), (8, False))
    """
    symmetric = not fmt.startswith("uint")
    bits = int(fmt[3:] if symmetric else fmt[4:])
    return bits, symmetric


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
        raise ValueError(f"bits must be an int in [{BITS[0]}, {BITS[-1]}], got {bits!r}")
    return int(bits)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _float_dtype(name, dtype):
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dtype}")
    return dtype


def _round(v, rounding):
    if rounding == "half_even":
        return jnp.round(v)
    # Half away from zero, exactly (floor(|v| + 0.5) would round 0.49999997 up).
    a = jnp.abs(v)
    whole = jnp.floor(a)
    return jnp.sign(v) * (whole + (a - whole >= 0.5))


def _scaled(x, s, reciprocal):
    """``x / s`` (or ``x · (1/s)``), 0 where ``s == 0``; true IEEE divisions (see ``exact_divide``)."""
    zero = s == 0
    safe = jnp.where(zero, 1.0, s)
    if reciprocal:
        return x * jnp.where(zero, 0.0, exact_reciprocal(safe))
    return jnp.where(zero, 0.0, exact_divide(x, safe))


def _encode(x, s, z, bits, rounding, reciprocal):
    """Unsigned stored codes (uint8) of ``x`` given per-element float32 scales and zero points
    (``z`` None: symmetric, stored biased by ``2**(b-1)``)."""
    r = _round(_scaled(x, s, reciprocal), rounding)
    if z is None:
        offset = 2 ** (bits - 1)
        u = jnp.clip(r, -offset, offset - 1) + offset
        fill = offset
    else:
        u = jnp.clip(r + z, 0, 2 ** bits - 1)
        fill = z
    return jnp.where(jnp.isnan(u), fill, u).astype(jnp.uint8)


def _pack(codes, bits, axis):
    return (codes, None) if bits == 8 else (pack_bits(codes, bits, axis), axis)


def _check_packable(shape, axis, bits):
    n, _ = codes_per_group(bits)
    if shape[axis] % n:
        raise ValueError(f"x with shape {tuple(shape)}: axis {axis} (size {shape[axis]}) must be a multiple "
                         f"of {n} to pack {bits}-bit codes into whole bytes")


def _block(shape, axis, granularity, group_size):
    if granularity is None:
        granularity = "channel" if group_size in (None, -1) else "group"
    _check_choice("granularity", granularity, GRANULARITIES)
    if granularity == "tensor":
        if group_size is not None:
            raise ValueError(f"granularity='tensor' takes no group_size, got {group_size}")
        return tuple(shape)
    if granularity == "channel" and group_size not in (None, -1):
        raise ValueError(f"granularity='channel' takes no group_size, got {group_size}")
    if granularity == "group" and group_size is None:
        raise ValueError("granularity='group' needs a group_size")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))):
        raise ValueError(f"group_size must be an int (or -1 / None for the whole axis), got {group_size!r}")
    return group_block(shape, axis, group_size)


def quantize_int(x, *, bits: int, symmetric: bool, axis: int = -1, granularity: str | None = None,
                 group_size: int | None = None, scale_dtype=jnp.float32, symmetric_range: str | None = None,
                 rounding: str = "half_even", reciprocal: bool = False,
                 quantize_with_stored_scale: bool = True, arithmetic: str = "float32") -> QTensor:
    """Quantizes ``x`` to ``int{bits}`` (symmetric) or ``uint{bits}`` (asymmetric) blocks.

    Args:
      x: floating array (any rank ≥ 1).
      bits: code width, 2..8.
      symmetric: True for ``int*`` (no zero point), False for ``uint*``.
      axis: the axis codes are packed along and groups run along.
      granularity: ``"tensor"`` (one scale), ``"channel"`` (one scale per slice along ``axis``) or
        ``"group"`` (``group_size`` consecutive elements along ``axis``); default: ``"group"`` when
        ``group_size`` is set, else ``"channel"``. ``group_size=-1`` means the whole axis (GPTQ).
      scale_dtype: dtype the scales are stored in; None: x's dtype (compressed-tensors).
      symmetric_range: ``"restricted"`` (``amax / (2**(b-1)-1)``, the default) or ``"full"``
        (``amax / (2**(b-1)-0.5)``, GPTQ / compressed-tensors, the default of that arithmetic);
        symmetric formats only.
      rounding: ``"half_even"`` or ``"half_away"``.
      reciprocal: multiply by ``1/s`` instead of dividing by ``s`` (ggml).
      quantize_with_stored_scale: compute codes with the scale rounded to ``scale_dtype`` (default,
        so codes and stored scale agree) or with the float32 scale before rounding (ggml).
      arithmetic: ``"float32"`` (the formulas above in float32, as GPTQ / AWQ / ggml compute) or
        ``"compressed-tensors"``: its ``calculate_qparams`` + ``quantize`` op for op, each result
        rounded to x's dtype as PyTorch does for bfloat16 / float16 weights (``s`` in x's dtype, a
        zero scale replaced by that dtype's eps, ``zp = round(-2**(b-1) - min/s)`` in the signed
        domain, codes ``round(x/s + zp)``); half-even rounding and division only.

    Examples:
      ``jquant.quantize(x, "int4" or "uint4", **options)`` calls it with ``bits`` and ``symmetric``
      set by the name, as one compiled program (called directly, its dozens of small ops run one by
      one). Asymmetric: a scale ``(max - min) / 15`` and a zero point per block:

      >>> import numpy as np, jquant
      >>> from jquant.formats.integer import int_codes
      >>> qt = jquant.quantize(np.array([[0., 1., 2., 3.]], np.float32), "uint4")
      >>> qt.fmt, qt.zero.tolist(), int_codes(qt).tolist()
      ('uint4', [[0]], [[0, 5, 10, 15]])
      >>> qt.dequantize().tolist()
      [[0.0, 1.0, 2.0, 3.0]]
      >>> w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
      >>> jquant.quantize(w, "int8", granularity="tensor").scale.shape  # one scale
      (1, 1)
      >>> jquant.quantize(w, "int4", group_size=16, symmetric_range="full").scale.shape
      (4, 4)
    """
    bits = _check_bits(bits)
    x = check_float_input(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x with shape {tuple(x.shape)}")
    axis %= x.ndim
    block = _block(x.shape, axis, granularity, group_size)
    _check_packable(x.shape, axis, bits)
    scale_dtype = x.dtype if scale_dtype is None else _float_dtype("scale_dtype", scale_dtype)
    _check_choice("rounding", rounding, ROUNDINGS)
    _check_choice("arithmetic", arithmetic, ARITHMETICS)
    compressed_tensors = arithmetic == "compressed-tensors"
    if compressed_tensors and (rounding != "half_even" or reciprocal or not quantize_with_stored_scale):
        raise ValueError("arithmetic='compressed-tensors' rounds half to even and divides by the scale it "
                         "stores; rounding, reciprocal and quantize_with_stored_scale must keep their defaults")
    if not symmetric and symmetric_range is not None:
        raise ValueError(f"symmetric_range applies to symmetric int formats only, got {symmetric_range!r} "
                         f"for {int_format(bits, symmetric)}")
    symmetric_range = symmetric_range or ("full" if compressed_tensors else "restricted")
    _check_choice("symmetric_range", symmetric_range, SYMMETRIC_RANGES)

    xb = to_blocks(to_float32_exact(x), block)
    axes = block_axes(x.ndim)
    # Blocks of amax < 2**-60 are computed lifted by 2**64 (see exact.py: XLA flushes subnormals).
    tiny = is_tiny(exact_abs_max(xb, axes))
    xb = lift(xb, per_block(tiny, x.ndim))
    # The range always contains 0; for symmetric formats max(-lo, hi) is amax.
    lo = jnp.minimum(nan_min(xb, axis=axes), 0.0)
    hi = jnp.maximum(nan_max(xb, axis=axes), 0.0)
    qmax = 2 ** (bits - 1) - 1
    divisor = qmax if symmetric_range == "restricted" else qmax + 0.5
    if compressed_tensors:
        s, zero, codes = _compressed_tensors_codes(xb, lo, hi, tiny, x.dtype, bits, symmetric, divisor)
        stored = store_exact(s, scale_dtype)
    else:
        numerator, divisor = (jnp.maximum(jnp.abs(lo), hi), divisor) if symmetric else (hi - lo, 2 ** bits - 1)
        s, s_lifted = unlift_quotient(numerator, divisor, tiny)
        stored = store_exact(s, scale_dtype)
        s_codes = lift(to_float32_exact(stored), tiny) if quantize_with_stored_scale else s_lifted
        zero = None
        if not symmetric:
            z = jnp.clip(_round(_scaled(-lo, s_codes, reciprocal), rounding), 0, 2 ** bits - 1)
            zero = jnp.where(jnp.isnan(z), 0, z).astype(jnp.uint8)
        z_full = None if zero is None else per_block(zero.astype(jnp.float32), x.ndim)
        codes = _encode(xb, per_block(s_codes, x.ndim), z_full, bits, rounding, reciprocal)
    data, pack_axis = _pack(codes.reshape(x.shape), bits, axis)
    return QTensor(data=data, scale=stored, zero=zero, fmt=int_format(bits, symmetric), shape=x.shape,
                   dtype=x.dtype, block=block, pack_axis=pack_axis)


def _compressed_tensors_codes(xb, lo, hi, tiny, dtype, bits, symmetric, divisor):
    """(scale, zero or None, unsigned codes in block layout) as compressed-tensors computes them in
    ``dtype`` (``xb``, ``lo``, ``hi`` lifted where ``tiny``); its signed codes and zero points are stored
    shifted by ``2**(b-1)``, as its packer does."""
    ndim = xb.ndim // 2

    def rounded(v):  # a PyTorch op on `dtype` tensors rounds its float32 result to `dtype`
        return round_to_precision(v, dtype)

    offset = 2 ** (bits - 1)
    numerator = jnp.maximum(jnp.abs(lo), hi) if symmetric else rounded(hi - lo)
    s, s_lifted = unlift_quotient(numerator, divisor if symmetric else 2 ** bits - 1, tiny)
    # The float32 quotient rounded to `dtype` on its bits, subnormals included, then lifted again.
    s = to_float32_exact(store_exact(s, dtype))
    s_lifted = lift(s, tiny)
    # Its zero point divides by the scale before zero scales become eps: an all-zero group's 0 / 0
    # is NaN, which its int8 cast turns into 0 (so such a group stores zero point and codes 2**(b-1)).
    zero = None
    if not symmetric:
        signed_zero = jnp.round(jnp.clip(rounded(-offset - rounded(exact_divide(lo, s_lifted))), -offset, offset - 1))
        signed_zero = jnp.where(jnp.isnan(signed_zero), 0, signed_zero)
        zero = (signed_zero + offset).astype(jnp.uint8)
    eps = float(jnp.finfo(dtype).eps)
    s = jnp.where(s_lifted == 0, eps, s)
    s_lifted = jnp.where(s_lifted == 0, jnp.where(tiny, eps * 2.0 ** LIFT, eps), s_lifted)
    quotient = rounded(exact_divide(xb, per_block(s_lifted, ndim)))
    if zero is not None:
        quotient = rounded(quotient + per_block(signed_zero, ndim))
    u = jnp.clip(jnp.round(quotient), -offset, offset - 1) + offset
    # NaN quotients cast to int8 0 in PyTorch (x86 and ARM alike): stored as 2**(b-1).
    return s, zero, jnp.where(jnp.isnan(u), offset, u).astype(jnp.uint8)


def quantize_int_with_params(x, bits: int, scale, zero=None, group_index=None, *, axis: int = -1,
                             scale_dtype=None, rounding: str = "half_even", reciprocal: bool = False) -> QTensor:
    """Quantizes ``x`` with precomputed per-block ``scale`` / ``zero`` (GPTQ's algorithm makes them).

    Args:
      x: floating array.
      bits: code width, 2..8.
      scale: per-block scales with ``x``'s rank; each axis of ``x`` must be a multiple of the
        matching axis of ``scale`` (that ratio is the block). Codes are computed with these scales
        as given (float32 arithmetic); they are stored in ``scale_dtype`` (default: their own dtype).
      zero: None for a symmetric ``int{bits}`` tensor (codes ``clamp(round(x/s), -2**(b-1), 2**(b-1)-1)``,
        GPTQ's symmetric zero ``2**(b-1)`` implied) or integer zero points shaped like ``scale``
        for ``uint{bits}`` (clipped to ``[0, 2**b-1]``).
      group_index: optional int32 ``[x.shape[axis]]`` map from each index along ``axis`` to its group
        (GPTQ act-order ``g_idx``); then only ``axis`` may be grouped. A concrete ``group_index``
        equal to ``i // group_size`` is dropped (it is the default).
      axis: the grouped / packed axis.

    Examples:
      One scale of 0.5 for the whole row; 0.25 / 0.5 = 0.5 is a tie, which goes to the even code 0:

      >>> import numpy as np
      >>> from jquant.formats.integer import int_codes, quantize_int_with_params
      >>> x = np.array([[1., -1.5, 0.25, 3.]], np.float32)
      >>> qt = quantize_int_with_params(x, 4, np.array([[0.5]], np.float32))
      >>> qt.fmt, int_codes(qt).tolist(), qt.dequantize().tolist()
      ('int4', [[2, -3, 0, 6]], [[1.0, -1.5, 0.0, 3.0]])

      With a zero point the codes are unsigned:

      >>> qt = quantize_int_with_params(x, 4, np.array([[0.5]], np.float32), zero=np.array([[8]]))
      >>> qt.fmt, int_codes(qt).tolist()
      ('uint4', [[10, 5, 8, 14]])
    """
    bits = _check_bits(bits)
    x = check_float_input(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x with shape {tuple(x.shape)}")
    axis %= x.ndim
    _check_choice("rounding", rounding, ROUNDINGS)
    _check_packable(x.shape, axis, bits)
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"scale must have a floating dtype, got {scale.dtype} (shape {tuple(scale.shape)})")
    if scale.ndim != x.ndim or any(s == 0 or d % s for d, s in zip(x.shape, scale.shape)):
        raise ValueError(f"scale with shape {tuple(scale.shape)} must have x's rank {x.ndim} and divide "
                         f"x's shape {tuple(x.shape)} axis by axis")
    block = tuple(d // s for d, s in zip(x.shape, scale.shape))
    stored = scale.astype(_float_dtype("scale_dtype", scale_dtype) if scale_dtype is not None else scale.dtype)
    if zero is not None:
        zero = jnp.asarray(zero)
        if zero.shape != scale.shape:
            raise ValueError(f"zero with shape {tuple(zero.shape)} must match scale's shape {tuple(scale.shape)}")
        zero = jnp.clip(jnp.round(zero.astype(jnp.float32)), 0, 2 ** bits - 1).astype(jnp.uint8)
    group_index = _check_group_index(group_index, x.shape, scale.shape, block, axis)
    qt = QTensor(data=None, scale=stored, zero=zero, group_index=group_index, fmt=int_format(bits, zero is None),
                 shape=x.shape, dtype=x.dtype, block=block, k_axis=axis)
    z_full = None if zero is None else qt.expand(zero.astype(jnp.float32))
    codes = _encode(x.astype(jnp.float32), qt.expand(to_float32_exact(scale)), z_full, bits, rounding,
                    reciprocal)
    data, pack_axis = _pack(codes, bits, axis)
    return qt.replace(data=data, pack_axis=pack_axis)


def _check_group_index(group_index, shape, scale_shape, block, axis):
    if group_index is None:
        return None
    group_index = jnp.asarray(group_index)
    if group_index.shape != (shape[axis],) or not jnp.issubdtype(group_index.dtype, jnp.integer):
        raise ValueError(f"group_index must be an integer array of shape ({shape[axis]},) (x's axis {axis}), "
                         f"got {group_index.dtype} with shape {tuple(group_index.shape)}")
    others = [i for i, b in enumerate(block) if b > 1 and i != axis]
    if others or block[axis] == 1:
        raise ValueError(f"group_index needs groups along axis {axis} only; scale shape {tuple(scale_shape)} "
                         f"gives blocks {block} for x's shape {tuple(shape)}")
    group_index = group_index.astype(jnp.int32)
    if isinstance(group_index, jax.core.Tracer):
        return group_index
    values = np.asarray(group_index)
    if values.min() < 0 or values.max() >= scale_shape[axis]:
        raise ValueError(f"group_index values must lie in [0, {scale_shape[axis]}) (the number of groups), "
                         f"got [{values.min()}, {values.max()}]")
    if np.array_equal(values, np.arange(shape[axis]) // block[axis]):
        return None
    return group_index


def int_codes(qt: QTensor) -> jax.Array:
    """The integer codes of an int/uint QTensor as int32: signed ``q`` for ``int*``, unsigned for ``uint*``.

    Examples:
      >>> import numpy as np, jquant
      >>> from jquant.formats.integer import int_codes
      >>> qt = jquant.quantize(np.array([[7., -3., 2., 0.]], np.float32), "int4")  # scale 1
      >>> int_codes(qt).tolist()
      [[7, -3, 2, 0]]
    """
    bits, symmetric = parse_int_format(qt.fmt)
    codes = qt.data if qt.pack_axis is None else unpack_bits(qt.data, bits, qt.pack_axis)
    codes = codes.astype(jnp.int32)
    return codes - 2 ** (bits - 1) if symmetric else codes


def _dequantize_int(qt: QTensor, dtype) -> jax.Array:
    codes = int_codes(qt).astype(jnp.float32)
    if qt.zero is not None:
        codes = codes - qt.expand(qt.zero.astype(jnp.float32))
    # (q - z) is a small exact integer, so the float32 product rounded to a 16-bit dtype equals the
    # float16 / bfloat16 product PyTorch dequantizers compute.
    return (codes * qt.expand(to_float32_exact(qt.scale))).astype(dtype)


def _registered(bits: int, symmetric: bool, fixed: dict):
    """``quantize(x, name, **options)`` for one format: options that contradict the name (or, for
    ``gguf_q8_0``, its fixed layout) raise instead of silently producing another format."""
    name = "gguf_q8_0" if fixed else int_format(bits, symmetric)
    pinned = {"bits": bits, "symmetric": symmetric, **fixed}

    def quantize(x, **options):
        for key, value in options.items():
            if key in pinned and not _same_option(value, pinned[key]):
                hint = (f"; for {value}-bit codes use format {int_format(value, symmetric)!r}"
                        if key == "bits" and not fixed and value in BITS else "")
                raise ValueError(f"format {name!r} has {key}={pinned[key]!r}, got {key}={value!r}{hint}")
        return quantize_int(x, **(options | pinned))
    quantize.__doc__ = f"``quantize(x, {name!r}, ...)``: ``quantize_int`` with {pinned}."
    return quantize


def _same_option(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    try:
        return a == b or jnp.dtype(a) == jnp.dtype(b)
    except TypeError:
        return False


for _bits in BITS:
    for _symmetric in (True, False):
        _name = int_format(_bits, _symmetric)
        register_quantizer(_name, _registered(_bits, _symmetric, {}))
        register_format(_name, _dequantize_int)
        # compressed-tensors packs 1..8-bit ints and stores scales in the weight's dtype.
        register_preset("compressed-tensors", _name, COMPRESSED_TENSORS_OPTIONS)

register_quantizer("gguf_q8_0", _registered(8, True, GGUF_Q8_0_OPTIONS))
register_preset("gguf", "int8", GGUF_Q8_0_OPTIONS)

__all__ = ["BITS", "COMPRESSED_TENSORS_OPTIONS", "GGUF_Q8_0_OPTIONS", "int_codes", "int_format", "parse_int_format",
           "quantize_int", "quantize_int_with_params"]
