"""The 8-bit weight layout of the Mosaic GPU W8A16 kernel (``prepack_w8``), its dequantization and
the kernel's pure-JAX twin (``reference_w8``).

An 8-bit weight: codes ``q`` ``[K, N]`` and ``w[k, n] = (q[k, n] - zero[g, n]) * scale[g, n] *
channel_scale[n] * global_scale`` with ``g = k // G``; ``q`` signed int8 (``lut="int8"``) or FP8
e4m3 (``lut="e4m3"``). The kernel runs the W4A16 kernel's pipeline (``jquant.kernels.w4a16``)
with 8-bit tiles: the layout is the same ``[N_pad, K_pad]``, one byte a code, no word order
(Mosaic GPU's own int8 and e4m3 conversions read wgmma's layout as it is). Per-channel and
per-tensor scales go to the epilogue in fp32 (``channel_scale``, ``global_scale``) instead of
multiplying every decoded weight in bf16, where an fp32 scale would be rounded. Plain XLA: nothing
here needs a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jquant.kernels.w4a16.layout import (K_CHUNK, SUB_CHUNK_GROUPS, PaddedNK, gather_pad, round_up,
                                         sort_act_order)
from jquant.kernels.w4a16.mosaic_gpu_decode import BYTE_LUTS

_CODE_DTYPES = {"int8": jnp.int8, "e4m3": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class PackedW8NK(PaddedNK):
    """An 8-bit weight laid out for the Mosaic GPU kernel.

    ``data`` ``[N_pad, K_pad]``: int8 codes (``code − 128`` for unsigned codes with zero points,
    whose zero points are shifted the same way) or float8_e4m3fn codes. ``scale`` ``[K_pad / G,
    N_pad]`` group or block multipliers (bf16, fp16 or fp32; all ones, and not multiplied, when
    the weight has none finer than a channel: ``unit_scales``). ``zero``: optional ``[K_pad / G, N_pad]`` bf16
    ``zero − 128``, subtracted before scaling. ``channel_scale``: optional fp32 ``[N_pad]``,
    ``global_scale``: optional fp32 ``[1]``, both applied to the fp32 sums. ``perm``: act-order
    gather of x's columns. ``group_size`` in stored rows.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w8a16 import prepack_w8
      >>> q = np.random.default_rng(0).integers(-127, 128, (64, 8)).astype(np.int8)  # [K, N]
      >>> packed = prepack_w8(q, channel_scale=np.full(8, 0.01, np.float32))
      >>> packed.k, packed.n, packed.k_pad, packed.n_pad, packed.lut, packed.data.shape
      (64, 8, 64, 128, 'int8', (128, 64))
      >>> packed.nbytes  # 8192 code bytes + one row of unit scales + 128 channel scales
      8960
    """

    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    global_scale: jax.Array | None = None
    channel_scale: jax.Array | None = None
    lut: str = "int8"
    k: int = 0
    n: int = 0
    group_size: int = 0
    unit_scales: bool = False
    word_order: bool = False

    @property
    def nbytes(self) -> int:
        return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in (self.data, self.scale, self.zero, self.perm, self.global_scale,
                                self.channel_scale)
                   if leaf is not None)


jax.tree_util.register_dataclass(
    PackedW8NK, data_fields=["data", "scale", "zero", "perm", "global_scale", "channel_scale"],
    meta_fields=["lut", "k", "n", "group_size", "unit_scales", "word_order"])


def prepack_w8(q, scale=None, zero=None, *, group_size=None, channel_scale=None,
               global_scale=None, g_idx=None, pad_k: int = K_CHUNK,
               pad_n: int = 128) -> PackedW8NK:
    """Lays 8-bit codes ``q`` ``[K, N]`` out for the Mosaic GPU kernel.

    ``q``: signed int8 codes (value ``q``), unsigned uint8 codes with ``zero`` points (value ``q
    − zero``), or float8_e4m3fn codes. ``scale`` ``[K / G, N]``: group (or block) multipliers
    with ``group_size`` G (16, 32 or a multiple of 64); ``channel_scale`` ``[N]`` and
    ``global_scale`` (a scalar) multiply the fp32 sums. At least one of the three. ``g_idx``:
    optional int32 ``[K]`` GPTQ act-order group of each input row. Padded columns are exactly 0.

    Examples:
      Unsigned codes with a zero point per group of 32 rows, dequantized exactly:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w8a16 import dequantize_w8, prepack_w8
      >>> rng = np.random.default_rng(0)
      >>> q = rng.integers(0, 256, (64, 8)).astype(np.uint8)
      >>> scale = rng.uniform(0.5, 1.0, (2, 8)).astype(np.float32)
      >>> zero = rng.integers(0, 256, (2, 8)).astype(np.uint8)
      >>> packed = prepack_w8(q, scale, zero, group_size=32)
      >>> w = (q.astype(np.float32) - np.repeat(zero, 32, 0)) * np.repeat(scale, 32, 0)
      >>> bool(jnp.array_equal(dequantize_w8(packed)[:64, :8], w))
      True
      >>> prepack_w8(q.astype(np.float32), scale, group_size=32)
      Traceback (most recent call last):
          ...
      TypeError: prepack_w8 takes int8, uint8 (with zero points) or float8_e4m3fn codes, got float32 codes of shape (64, 8)
    """
    q = jnp.asarray(q)
    if q.ndim != 2 or 0 in q.shape:
        raise ValueError(f"q must be a non-empty [K, N] array of 8-bit codes, got shape {tuple(q.shape)}")
    k, n = q.shape
    if q.dtype == jnp.uint8 and zero is not None:
        lut, codes = "int8", (q.astype(jnp.int32) - 128).astype(jnp.int8)
    elif q.dtype == jnp.int8 and zero is None:
        lut, codes = "int8", q
    elif q.dtype == jnp.float8_e4m3fn and zero is None:
        lut, codes = "e4m3", q
    else:
        what = "uint8 codes without zero points" if q.dtype == jnp.uint8 else f"{q.dtype} codes"
        if q.dtype == jnp.int8 or q.dtype == jnp.float8_e4m3fn:
            what = f"{q.dtype} codes with zero points"
        raise TypeError(f"prepack_w8 takes int8, uint8 (with zero points) or float8_e4m3fn codes, got {what} "
                        f"of shape {tuple(q.shape)}")
    if scale is None and channel_scale is None and global_scale is None:
        raise ValueError("prepack_w8 needs scale (groups), channel_scale or global_scale")
    if scale is None:
        if zero is not None or group_size not in (None, -1) or g_idx is not None:
            raise ValueError("zero points, group_size and g_idx need group scales (scale)")
        g = k
    else:
        g = k if group_size in (None, -1) or group_size >= k else int(group_size)
        if g < k and g % K_CHUNK and g not in SUB_CHUNK_GROUPS:
            raise ValueError(f"prepack_w8 takes group_size 16, 32, a multiple of {K_CHUNK} or -1 (per "
                             f"channel), got {group_size}")
        n_groups = -(-k // g)
        if jnp.shape(scale) != (n_groups, n):
            raise ValueError(f"scale has shape {tuple(jnp.shape(scale))}; expected ({n_groups}, {n}) for q of "
                             f"shape ({k}, {n}) and group_size {group_size}")
        if zero is not None and jnp.shape(zero) != (n_groups, n):
            raise ValueError(f"zero has shape {tuple(jnp.shape(zero))}; expected ({n_groups}, {n})")
    perm = None
    if g_idx is not None:
        perm, codes = sort_act_order(g_idx, codes, g, -(-k // g))
    k_pad = round_up(k, math.lcm(pad_k, g) if g < k else pad_k)
    group = g if g < k else k_pad
    n_pad = round_up(n, pad_n)
    data = jnp.pad(codes.T, ((0, n_pad - n), (0, k_pad - k)))   # padded codes are 0

    def per_group(values, dtype):
        return jnp.pad(jnp.asarray(values).astype(dtype),
                       ((0, k_pad // group - values.shape[0]), (0, n_pad - n)))

    if scale is None:   # a placeholder row the pipeline streams but never multiplies
        rows = jnp.ones((1, n_pad), jnp.bfloat16)
    else:
        scale = jnp.asarray(scale)
        # e4m3 / e8m0 scales are exact in bf16; fp16 / bf16 stay; the rest fp32.
        s_dtype = (jnp.bfloat16 if scale.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
                   else scale.dtype if scale.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32)
        rows = per_group(scale, s_dtype)
    zz = None if zero is None else per_group(jnp.asarray(zero, jnp.float32) - 128, jnp.bfloat16)
    cs = None
    if channel_scale is not None:
        channel_scale = jnp.asarray(channel_scale, jnp.float32)
        if channel_scale.shape != (n,):
            raise ValueError(f"channel_scale has shape {tuple(channel_scale.shape)}; expected ({n},)")
        cs = jnp.pad(channel_scale, (0, n_pad - n))
    gs = None if global_scale is None else jnp.asarray(global_scale, jnp.float32).reshape(1)
    return PackedW8NK(data=data, scale=rows, zero=zz, perm=perm, global_scale=gs, channel_scale=cs,
                      lut=lut, k=k, n=n, group_size=group, unit_scales=scale is None)


def dequantize_w8(packed: PackedW8NK, dtype=jnp.float32) -> jax.Array:
    """The float weight ``[K_pad, N_pad]`` in stored row order, in fp32 math (padding is 0).

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w8a16 import dequantize_w8, prepack_w8
      >>> q = np.array([[-128, 127], [3, -5]] * 16, np.int8)  # [K=32, N=2]
      >>> w = dequantize_w8(prepack_w8(q, channel_scale=np.array([0.5, 2.0], np.float32)))
      >>> w.shape, w[:2, :2].tolist()
      ((64, 128), [[-64.0, 254.0], [1.5, -10.0]])
    """
    if packed.lut not in BYTE_LUTS:
        raise ValueError(f"dequantize_w8 takes an 8-bit packed weight, got lut={packed.lut!r}")
    values = packed.data.astype(jnp.float32).T
    rows = lambda t: jnp.repeat(t.astype(jnp.float32), packed.group_size, axis=0)
    if packed.zero is not None:
        values = values - rows(packed.zero)
    w = values if packed.unit_scales else values * rows(packed.scale)
    if packed.channel_scale is not None:
        w = w * packed.channel_scale[None, :]
    if packed.global_scale is not None:
        w = w * packed.global_scale[0]
    return w.astype(dtype)


def reference_w8(x2: jax.Array, packed: PackedW8NK, bias=None, dtype=jnp.float32) -> jax.Array:
    """The kernel's pure-JAX twin: dequantize in fp32 (then ``dtype``), dot with fp32 accumulation.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w8a16 import prepack_w8, reference_w8
      >>> rng = np.random.default_rng(0)
      >>> q = rng.integers(-127, 128, (64, 8)).astype(np.int8)
      >>> packed = prepack_w8(q, channel_scale=np.full(8, 0.5, np.float32))
      >>> x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
      >>> bool(jnp.allclose(reference_w8(x, packed), x @ (q * 0.5), atol=1e-4))
      True
    """
    xs = gather_pad(x2, packed, x2.shape[0]).astype(dtype)
    out = jnp.dot(xs, dequantize_w8(packed, dtype)[:, :packed.n], preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x2.dtype)
