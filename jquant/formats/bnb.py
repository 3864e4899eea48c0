"""bitsandbytes 4-bit formats: ``"nf4"`` and ``"fp4_bnb"``, optionally double-quantized.

Bit-exact with bitsandbytes 0.50.2 on CPU (``quantize_4bit``'s torch kernel, the C++ 8-bit
``quantize_blockwise``, the C++/torch dequantizers):

* The tensor is flattened (row-major) and cut into blocks of ``blocksize``; a short last block is
  kept short. Each block stores its float32 ``absmax`` = max |x| (NaN propagates).
* Full blocks scale by ``x * (1 / absmax)``, the short last block by ``x / absmax`` (bnb floors that
  block's stored absmax at 1e-38); scaled values are clamped to [-1, 1].
* The code is ``torch.bucketize`` against the float32 midpoints of the sorted table: the number of
  midpoints strictly below the value, so a value exactly on a midpoint takes the lower entry and
  NaN takes the top one. bnb's FP4 table is not sorted; the sorted position maps back through a
  stable argsort, so 0 and tiny negatives code as 0b0000 and tiny positives as 0b1000 (both +0).
* Codes are packed two per byte, the even element in the HIGH nibble; an odd count pads one code of 0.
* Double quantization (``compress_statistics``): ``offset`` = torch's float32 mean of absmax, and
  ``absmax - offset`` goes through ``bnb_dynamic8`` (8-bit signed dynamic map, blocks of 256); the
  result is a nested QTensor in ``scale`` whose ``zero`` holds the 0-d offset, added back on
  dequantization.
* Dequantization is ``table[code] * absmax`` in float32, then cast (round to nearest even), over the
  flattened blocks as bnb's generic path computes it. bnb 0.50.2's CPU ``dequantize_4bit`` kernel
  disagrees with its own quantizer's flat blocks on some shapes whose rows do not hold whole blocks
  (33 × 96 in blocks of 128, 7 × 352 in blocks of 64; not 6 × 70 in blocks of 64).

NaN/Inf follow bnb, at every tensor size (the absmax is an integer max of |x|'s bits, which keeps NaN
where XLA's float max drops it from large reductions): a NaN makes its block's absmax NaN (the block
dequantizes to NaN, other blocks are untouched); an Inf makes it Inf, the Inf element codes like
NaN and the block's finite elements like 0, so the block dequantizes to NaN/±Inf. The 8-bit level
ignores NaN in its block maxima and codes NaN as 0; double quantization's offset (a mean) is NaN or
Inf when any absmax is, as in bnb.

Subnormals are reproduced although XLA flushes them (``jquant.formats.subnormal``): subnormal
elements and absmaxes, bnb's 1e-38 absmax floor, ``1 / absmax`` past 2^126 (a subnormal reciprocal)
and products that torch keeps as tiny subnormals (FP4 codes +tiny as 0b1000, 0 as 0b0000); double
quantization's statistics when every block maximum is below 2^-60 (an all-zero tensor with a short
last block: the mean of its 1e-38 floor and zeros is a subnormal), worked on lifted by 2^64; and
dequantized values below 2^-126 (a tiny block's ``table[code] · absmax``, ``subnormal.product``),
which bnb's torch path keeps in float32 and bfloat16.

Bit-exactness under XLA needs two guards (see ``_divide`` and ``_dequantize_dynamic8``): XLA turns
division by a broadcast or constant into multiplication by a reciprocal, and fuses a multiply
followed by an add into an FMA; torch rounds each step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats.base import register_preset, register_quantizer
from jquant.formats import subnormal
from jquant.formats.exact import abs_bits, bits_float, exact_abs_max, exact_divide, exact_reciprocal
from jquant.formats.blocking import check_float_input, pad_to_blocks
from jquant.formats.packing import pack_bits, unpack_bits
from jquant.qtensor import QTensor, expand_blocks, register_format

FOUR_BIT_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256
INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

_NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)
# bnb's FP4 (1 sign, 2 exponent, 1 mantissa bit, bias 2; NOT OCP E2M1), indexed by code, over 12.
# Code 0b1000 is +0.0, not -0.0: bnb writes that entry as the Python int -0.
_FP4 = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3],
                np.float32) / np.float32(12)
_TABLES = {"nf4": _NF4, "fp4_bnb": _FP4}
_F32_TINY = np.float32(1e-38)  # bnb's absmax floor (a subnormal, so kept out of XLA arithmetic)
# Double-quantization statistics below this are worked on lifted by 2^64 (subnormal.lift64).
_LIFTED_BELOW = int(np.float32(2.0 ** -60).view(np.int32))   # its bits, compared with abs_bits


def code_table(fmt: str) -> np.ndarray:
    """The 16 float32 values the 4-bit codes of ``fmt`` ("nf4" / "fp4_bnb") stand for (bnb's quant_map)."""
    return _TABLES[fmt].copy()


@functools.cache
def _sorted_table(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(float32 midpoints of the sorted table, code of each sorted position)."""
    table = _TABLES[fmt]
    order = np.argsort(table, kind="stable")
    ordered = table[order]
    return (ordered[:-1] + ordered[1:]) / np.float32(2), order.astype(np.uint8)


@functools.cache
def _dynamic_map() -> np.ndarray:
    # bnb's create_dynamic_map(signed=True): for exponent i = 0..6, 2**i linear steps between 0.1 and
    # 1 scaled by 10**(i-6), both signs, plus 0 and 1. torch.linspace (float32) computes
    # start + step*k for the first half and end - step*(n-1-k) for the rest with a fused
    # multiply-add; float64 holds those products exactly, so rounding once to float32 matches.
    values = [np.array([0.0, 1.0], np.float32)]
    for i in range(7):
        steps = 2 ** i + 1
        step = (np.float32(1.0) - np.float32(0.1)) / np.float32(steps - 1)
        k = np.arange(steps)
        bounds = np.where(k < steps // 2, np.float64(np.float32(0.1)) + np.float64(step) * k,
                          1.0 - np.float64(step) * (steps - 1 - k)).astype(np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (i - 6))
        values += [scale * means, -scale * means]
    return np.sort(np.concatenate(values))


def dynamic_map() -> np.ndarray:
    """bnb's signed 8-bit dynamic quantization map (256 sorted float32 values in [-1, 1])."""
    return _dynamic_map().copy()


@functools.cache
def _dynamic_thresholds() -> np.ndarray:
    """Smallest scaled value that reaches each code 1..255 under bnb's C++ 8-bit quantizer.

    That quantizer maps s in [-1, 1] to ``lut[trunc(fma((s + 1) * 0.5, 65535, 0.5))]``, where
    ``lut[i]`` is the first code whose upper midpoint is not below ``2i / 65535 - 1`` (float32).
    The map is monotone in s, so it is a count of thresholds; each is found by bisection over the
    ordered float32 values (float64 evaluates the fused multiply-add exactly).
    """
    code = _dynamic_map()
    mids = (code[:-1] + code[1:]) * np.float32(0.5)
    i = np.arange(65536)
    lut = np.searchsorted(mids, (i + i).astype(np.float32) / np.float32(65535) - np.float32(1), "left")

    def codes(s):
        t = (s + np.float32(1)) * np.float32(0.5)
        return lut[(t.astype(np.float64) * 65535 + 0.5).astype(np.float32).astype(np.int64)]

    def to_float(key):  # ordered int32 key -> float32
        return np.where(key < 0, -(-key).astype(np.int32).view(np.float32), key.astype(np.int32).view(np.float32))

    target = np.arange(1, 256)
    lo = np.full(255, -np.float32(1).view(np.int32), np.int64)  # codes(-1) = 0, below every target
    hi = np.full(255, np.float32(1).view(np.int32), np.int64)  # codes(1) = 255 reaches every target
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        up = codes(to_float(mid)) >= target
        hi, lo = np.where(up, mid, hi), np.where(up, lo, mid)
    return to_float(hi)


# ---- torch's float32 sum (double quantization's offset) ----------------------------------------
_TORCH_LANES = 8  # torch's CPU sum kernel works on Vectorized<float> of 8 lanes (AVX2 and AVX512 hosts)
_TORCH_ILP = 4


def _fold(x):
    """Sequential float32 sum over axis 0, starting from 0 (never reassociated)."""
    total = jnp.zeros(x.shape[1:], x.dtype)
    for row in x:
        total = total + row
    return total


def _fold_groups(x, size):
    """Sums of consecutive groups of ``size`` rows (sequential within a group) and the leftover rows."""
    groups = x.shape[0] // size
    grouped = x[:groups * size].reshape(groups, size, *x.shape[1:])
    return _fold(jnp.moveaxis(grouped, 1, 0)), x[groups * size:]


def _cascade_sum(rows):
    # torch's multi_row_sum: rows are summed in runs of L = 2**max(4, ceil(log2(n)) // 4); run sums
    # collect in a level-1 accumulator that is flushed to level 2 every L runs, level 2 to level 3
    # every L**2 runs; the leftover rows, then levels 1..3, are added last.
    level = 1 << max(4, (rows.shape[0] - 1).bit_length() // 4)
    runs, leftover = _fold_groups(rows, level)
    groups, level1 = _fold_groups(runs, level)
    supers, level2 = _fold_groups(groups, level)
    return ((_fold(leftover) + _fold(level1)) + _fold(level2)) + _fold(supers)


def _row_sum(vectors):
    # torch's row_sum: an (n/4, 4) view cascaded column by column, leftovers into column 0, then the
    # four columns added in order.
    columns = vectors.shape[0] // _TORCH_ILP
    partial = _cascade_sum(vectors[:columns * _TORCH_ILP].reshape(columns, _TORCH_ILP, *vectors.shape[1:]))
    total = partial[0]
    for row in vectors[columns * _TORCH_ILP:]:
        total = total + row
    for k in range(1, _TORCH_ILP):
        total = total + partial[k]
    return total


def _torch_sum(x):
    """``torch.sum`` of a 1-D float32 array as torch computes it on CPU in one thread.

    (torch splits sums of >= 32768 elements across its threads, so bnb's offset for tensors with that
    many blocks depends on its thread count; a checkpoint's stored offset is always kept exactly.)
    """
    n = x.shape[0]
    if n < _TORCH_LANES:
        return _row_sum(x[:, None])[0]
    vectors = n // _TORCH_LANES
    lanes = _row_sum(x[:vectors * _TORCH_LANES].reshape(vectors, _TORCH_LANES))
    total = _fold(x[vectors * _TORCH_LANES:])
    for k in range(_TORCH_LANES):
        total = total + lanes[k]
    return total


def _torch_mean(x):
    """``torch.mean`` of a 1-D float32 array as torch computes it on CPU in one thread."""
    return exact_divide(_torch_sum(x), jnp.float32(x.shape[0]))


def _tiny_mean_lifted(lifted):
    """``torch.mean`` · 2^64 of values given as ``subnormal.lift64`` of them, the mean rounded where
    PyTorch rounds it: to a multiple of 2^-149 (2^-85 lifted) when it is subnormal."""
    n = lifted.shape[0]
    total = _torch_sum(lifted)
    mean = exact_divide(total, jnp.float32(n))
    # A subnormal total is t · 2^-149 with an integer t < 2^23: the quotient rounded half to even.
    t = (total * np.float32(2.0 ** 85)).astype(jnp.int32)
    q, r = t // n, t % n
    q = q + ((2 * r > n) | ((2 * r == n) & (q % 2 == 1))).astype(jnp.int32)
    # A normal total over a subnormal mean: rounded twice (to 24 bits, then to the grid), which can
    # differ from PyTorch's once only at a tie of the second rounding.
    grid = jnp.where(total < np.float32(2.0 ** -62), q.astype(jnp.float32),
                     jnp.round(mean * np.float32(2.0 ** 85)))
    return jnp.where(mean < np.float32(2.0 ** -62), grid * np.float32(2.0 ** -85), mean)


def _double_quantize(absmax):
    """bnb's ``compress_statistics``: the float32 mean of the block maxima (the offset) and their
    differences from it in ``bnb_dynamic8``. Block maxima all below 2^-60 (an all-zero tensor's are 0
    and bnb's 1e-38 floor for a short last block) are worked on lifted by 2^64, where the subnormal
    mean and differences PyTorch keeps are normal floats."""
    offset = _torch_mean(absmax)
    nested = _dynamic8(absmax - offset, NESTED_BLOCKSIZE)
    tiny = jnp.max(abs_bits(absmax)) < _LIFTED_BELOW
    lifted = subnormal.lift64(absmax)
    offset_lifted = _tiny_mean_lifted(lifted)
    nested_lifted = _dynamic8(lifted - offset_lifted, NESTED_BLOCKSIZE)
    return nested.replace(data=jnp.where(tiny, nested_lifted.data, nested.data),
                          scale=jnp.where(tiny, subnormal.unlift64(nested_lifted.scale), nested.scale),
                          zero=jnp.where(tiny, subnormal.unlift64(offset_lifted), offset))


# ---- input checks -------------------------------------------------------------------------------
def _check_input(x, fmt):
    given = np.asarray(x).dtype if isinstance(x, (list, tuple)) else getattr(x, "dtype", None)
    x = check_float_input(x)
    if given not in INPUT_DTYPES:  # checked before jnp.asarray, which turns float64 into float32
        raise TypeError(f"{fmt}: x must be float32, bfloat16 or float16 (as bitsandbytes), got {given} "
                        f"(shape {tuple(x.shape)})")
    return x


def _check_axis(axis, x, fmt):
    # bnb blocks the row-major flattened tensor, so blocks run along the last axis only.
    if not isinstance(axis, int) or axis not in (-1, x.ndim - 1):
        raise ValueError(f"{fmt}: blocks run along the last axis of the flattened tensor; axis must be -1 "
                         f"(or {x.ndim - 1}) for x with shape {tuple(x.shape)}, got axis={axis}")


def _check_blocksize(blocksize, allowed, fmt):
    if isinstance(blocksize, bool) or not isinstance(blocksize, (int, np.integer)) or blocksize <= 0 \
            or (allowed and blocksize not in allowed):
        expected = f"one of {allowed}" if allowed else "a positive int"
        raise ValueError(f"{fmt}: blocksize must be {expected}, got {blocksize!r}")
    return int(blocksize)


# ---- 8-bit dynamic map (bnb quantize_blockwise) -------------------------------------------------
def quantize_dynamic8(x, blocksize: int = 4096, axis: int = -1) -> QTensor:
    """bnb's ``quantize_blockwise`` with the signed dynamic map: one uint8 code per element.

    Blocks of ``blocksize`` over the flattened tensor (a short last block allowed); block absmax
    ignores NaN; codes follow bnb's C++ CPU kernel (see ``_dynamic_thresholds``).
    """
    x = _check_input(x, "bnb_dynamic8")
    _check_axis(axis, x, "bnb_dynamic8")
    return _dynamic8(x, _check_blocksize(blocksize, (), "bnb_dynamic8"))


@functools.partial(jax.jit, static_argnums=1)
def _dynamic8(x, blocksize):
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = pad_to_blocks(flat, (blocksize,)).reshape(-1, blocksize)
    magnitude = jnp.where(jnp.isnan(blocks), 0.0, jnp.abs(blocks))
    absmax = jnp.max(magnitude, axis=1)
    scaled = blocks * exact_reciprocal(absmax)[:, None]
    codes = jnp.searchsorted(jnp.asarray(_dynamic_thresholds()), scaled, side="right")
    codes = jnp.where(jnp.isnan(scaled) | (absmax[:, None] == 0), 0, codes)
    return QTensor(data=codes.astype(jnp.uint8).reshape(-1)[:flat.size].reshape(x.shape), scale=absmax,
                   fmt="bnb_dynamic8", shape=x.shape, dtype=x.dtype, block=(blocksize,))


@functools.partial(jax.jit, static_argnums=1)
def _dequantize_dynamic8(qt: QTensor, dtype) -> jnp.ndarray:
    values = jnp.asarray(_dynamic_map())[qt.data.reshape(-1)]

    def dequantize(scale, zero):
        out = values * expand_blocks(scale, (qt.size,), qt.block)
        # bnb rounds the product before adding the offset; the barrier keeps XLA from fusing an FMA.
        return out if zero is None else jax.lax.optimization_barrier(out) + zero

    out = dequantize(qt.scale, qt.zero)
    # Subnormal statistics (an all-zero tensor's double quantization): PyTorch keeps the subnormal
    # results, whose signs give the 4-bit level's zeros their signs; lifted by 2^64 they survive here,
    # rounded twice (within one 2^-149 step of PyTorch's).
    tiny = abs_bits(qt.scale) < _LIFTED_BELOW
    if qt.zero is not None:
        tiny = tiny & (abs_bits(qt.zero) < _LIFTED_BELOW)
    lifted = dequantize(subnormal.lift64(qt.scale), None if qt.zero is None else subnormal.lift64(qt.zero))
    out = jnp.where(expand_blocks(tiny, (qt.size,), qt.block), subnormal.unlift64(lifted), out)
    return out.reshape(qt.shape).astype(dtype)


# ---- 4-bit --------------------------------------------------------------------------------------
def _scaled(flat, blocksize):
    """(values scaled into [-1, 1], float32 absmax per block) exactly as bnb's quantize_4bit, whose
    torch arithmetic keeps subnormals (``jquant.formats.subnormal`` rebuilds them)."""
    full = flat.size - flat.size % blocksize
    scaled, absmax = [], []
    if full:
        blocks = flat[:full].reshape(-1, blocksize)
        block_max = exact_abs_max(blocks, axis=1)
        # bnb: x * (1 / absmax.clamp(min=1e-38)); the reciprocal is subnormal past 2^126.
        floored = jnp.maximum(abs_bits(block_max), abs_bits(_F32_TINY))
        floored = jnp.where(jnp.isnan(block_max), block_max, bits_float(floored))
        r, shift = subnormal.reciprocal(floored[:, None])
        product = subnormal.multiply(blocks, r, shift)
        scaled.append(_keep_tiny_sign(product, subnormal.tiny_product_sign(blocks, r, shift)))
        absmax.append(block_max)
    if full < flat.size:
        tail = flat[full:]
        tail_max = exact_abs_max(tail, axis=0)
        tail_max = jnp.where(abs_bits(tail_max) < abs_bits(_F32_TINY), _F32_TINY, tail_max)
        scaled.append(_keep_tiny_sign(*subnormal.divide(tail, tail_max)))
        absmax.append(tail_max[None])
    scaled = jnp.clip(jnp.concatenate([s.reshape(-1) for s in scaled]), -1.0, 1.0)
    return scaled, jnp.concatenate(absmax)


def _keep_tiny_sign(values, sign):
    """A product XLA flushed where torch keeps a subnormal becomes ±2^-126: same code (the FP4
    table tells +tiny, code 0b1000, from 0 and -tiny, code 0b0000; NF4 codes all three alike)."""
    tiny = jnp.where(sign > 0, np.float32(2.0 ** -126), np.float32(-2.0 ** -126))
    return jnp.where((values == 0) & (sign != 0), tiny, values)


def _codes_4bit(scaled, fmt):
    midpoints, order = _sorted_table(fmt)
    position = jnp.searchsorted(jnp.asarray(midpoints), scaled, side="left")
    position = jnp.where(jnp.isnan(scaled), midpoints.size, position)
    return jnp.asarray(order)[position]


def _quantize_4bit(x, fmt, blocksize=64, compress_statistics=False, axis=-1) -> QTensor:
    x = _check_input(x, fmt)
    _check_axis(axis, x, fmt)
    blocksize = _check_blocksize(blocksize, FOUR_BIT_BLOCKSIZES, fmt)
    if not isinstance(compress_statistics, (bool, np.bool_)):
        raise TypeError(f"{fmt}: compress_statistics must be a bool, got {compress_statistics!r}")
    return _four_bit(x, fmt, blocksize, bool(compress_statistics))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _four_bit(x, fmt, blocksize, compress_statistics):
    flat = x.reshape(-1).astype(jnp.float32)
    scaled, absmax = _scaled(flat, blocksize)
    codes = _codes_4bit(jnp.pad(scaled, (0, flat.size % 2)), fmt)
    scale = absmax
    if compress_statistics:
        scale = _double_quantize(absmax)
    return QTensor(data=pack_bits(codes, 4, axis=0, order="high_first"), scale=scale, fmt=fmt,
                   shape=x.shape, dtype=x.dtype, block=(blocksize,), pack_axis=0)


def quantize_nf4(x, blocksize: int = 64, compress_statistics: bool = False, axis: int = -1) -> QTensor:
    """bnb NF4 (``quantize_4bit(quant_type="nf4")``) of ``x`` (float32/bfloat16/float16, any shape)."""
    return _quantize_4bit(x, "nf4", blocksize, compress_statistics, axis)


def quantize_fp4_bnb(x, blocksize: int = 64, compress_statistics: bool = False, axis: int = -1) -> QTensor:
    """bnb FP4 (``quantize_4bit(quant_type="fp4")``) of ``x`` (float32/bfloat16/float16, any shape)."""
    return _quantize_4bit(x, "fp4_bnb", blocksize, compress_statistics, axis)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize_4bit(qt: QTensor, dtype) -> jnp.ndarray:
    codes = unpack_bits(qt.data, 4, axis=0, order="high_first")[:qt.size]
    absmax = qt.scale.dequantize(jnp.float32) if isinstance(qt.scale, QTensor) else qt.scale
    out = subnormal.product(jnp.asarray(_TABLES[qt.fmt])[codes], expand_blocks(absmax, (qt.size,), qt.block))
    return out.astype(dtype).reshape(qt.shape)


register_quantizer("nf4", quantize_nf4)
register_quantizer("fp4_bnb", quantize_fp4_bnb)
register_quantizer("bnb_dynamic8", quantize_dynamic8)
register_format("nf4", _dequantize_4bit)
register_format("fp4_bnb", _dequantize_4bit)
register_format("bnb_dynamic8", _dequantize_dynamic8)
# The defaults are bitsandbytes' own (blocksize 64 / 4096, no double quantization): nothing to set.
for _fmt in ("nf4", "fp4_bnb", "bnb_dynamic8"):
    register_preset("bitsandbytes", _fmt, {})
