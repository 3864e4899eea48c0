"""The 4-bit weight layout of the Mosaic GPU W4A16 kernel (``prepack_nk``), its dequantization and
the kernel's pure-JAX twin (``reference_nk``).

A unified 4-bit weight: codes ``q`` ``[K, N]`` in 0..15 and
``w[k, n] = (LUT[q[k, n]] - zero[g, n]) * scale[g, n] * global_scale`` with ``g = k // G``.
``prepack_nk`` stores it ``[N_pad, K_pad]`` (the kernel computes ``yᵀ = W_nk · xᵀ``), with groups
of 16, 32, 64·j or one per column. Everything here is plain XLA: nothing in this module needs a
GPU or imports Mosaic GPU.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kernels.w4a16.mosaic_gpu_decode import (E2M1_SCALE_EXP, canonical_lut,
                                                     from_word_order, lut_values,
                                                     pack_e2m1_pairs, signed_int4,
                                                     to_word_order, unpack_e2m1_pairs)

# wgmma consumes K in chunks of one 128-byte swizzle atom of the 16-bit B operand.
K_CHUNK = 64
# Groups finer than a chunk: the chunk's scale is chosen per column.
SUB_CHUNK_GROUPS = (16, 32)


class PaddedNK:
    """``n_pad`` and ``k_pad`` of a weight stored ``data`` ``[N_pad, K_pad]`` (or a stack of them,
    ``[E, N_pad, K_pad]``: MoE experts)."""

    @property
    def n_pad(self) -> int:
        return self.data.shape[-2]

    @property
    def k_pad(self) -> int:
        return self.data.shape[-1]


@dataclasses.dataclass(frozen=True)
class PackedW4NK(PaddedNK):
    """A 4-bit weight laid out for the Mosaic GPU kernel.

    ``data`` int4 ``[N_pad, K_pad]``: ``code − 8`` for int4 codes (exact in int4 for uint4b8 and
    for asymmetric codes, whose zero points are shifted the same way), or E2M1 codes in pairs
    (``lut="e2m1"``, ``pack_e2m1_pairs``), or table codes as they are (``"nf4"``, ``"fp4_bnb"``);
    ``word_order``: its K axis permuted within blocks of 32 codes (``to_word_order``).
    ``scale`` ``[K_pad / G, N_pad]`` (bf16, fp16 or fp32: converted to x's dtype in the kernel;
    E2M1's times 2^(126 − k), ``_e2m1_prescale``); ``zero`` optional ``[K_pad / G, N_pad]``:
    ``zero − 8`` (int4 asymmetric), subtracted before scaling. ``perm``: act-order gather of x's
    columns; ``global_scale``: optional fp32 ``[1]`` multiplier (NVFP4's; for E2M1 always, times
    2^k). ``group_size`` in stored rows.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w4a16 import prepack_nk
      >>> rng = np.random.default_rng(0)
      >>> packed = prepack_nk(rng.integers(0, 16, (64, 8)), np.ones((2, 8), np.float32), group_size=32)
      >>> packed.k, packed.n, packed.k_pad, packed.n_pad, packed.group_size, packed.lut  # [K, N] = [64, 8]
      (64, 8, 64, 128, 32, 'int4')
      >>> packed.data.shape, str(packed.data.dtype), packed.scale.shape  # N padded to 128 rows
      ((128, 64), 'int4', (2, 128))
      >>> packed.nbytes  # 4096 bytes of codes + 256 float32 scales
      5120
    """

    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    global_scale: jax.Array | None = None
    lut: str = "int4"
    k: int = 0
    n: int = 0
    group_size: int = 0
    word_order: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.size // 2 + sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                                         for leaf in (self.scale, self.zero, self.perm,
                                                      self.global_scale)
                                         if leaf is not None)


jax.tree_util.register_dataclass(
    PackedW4NK, data_fields=["data", "scale", "zero", "perm", "global_scale"],
    meta_fields=["lut", "k", "n", "group_size", "word_order"])


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def nk_compatible(group_size: int, k: int, lut: str = "int4") -> bool:
    """Whether a weight fits the kernel: any code book (``LUTS``), per-channel or groups of 16, 32
    or multiples of 64."""
    canonical_lut(lut)   # raises for an unknown code book; every known one fits
    return (group_size in (None, -1) or group_size >= k or group_size % K_CHUNK == 0
            or group_size in SUB_CHUNK_GROUPS)


def prepack_nk(q, scale, zero=None, *, group_size, lut="int4", global_scale=None, g_idx=None,
               pad_k: int = K_CHUNK, pad_n: int = 128, word_order: bool = True) -> PackedW4NK:
    """Lays 4-bit codes ``q`` ``[K, N]`` (0..15) out for the Mosaic GPU kernel: ``[N_pad, K_pad]``
    signed int4, scales and zeros ``[K_pad / G, N_pad]``. ``lut``: ``"int4"`` (value ``code − 8``,
    or ``code − zero``), ``"e2m1"`` (FP4; optional ``global_scale``) or a table (``"nf4"``,
    ``"fp4_bnb"``; both without zeros). ``g_idx``: optional int32 ``[K]`` GPTQ act-order group of
    each input row, every group exactly G rows. Padded columns have scale 0, so they are exactly
    0; padded rows decode to 0 (code 8, or the last group's zero point rounded) and meet the zero
    columns ``gather_pad`` appends to x. ``word_order``: K permuted
    within blocks of 32 codes (``to_word_order``) so the kernel reads a word per thread and row.

    Examples:
      Codes ``q`` in 0..15 stand for ``(q - 8) * scale`` (int4), a scale per group of 32 rows of K:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w4a16 import dequantize_nk, prepack_nk
      >>> rng = np.random.default_rng(0)
      >>> q = rng.integers(0, 16, (64, 8))  # [K, N]
      >>> scale = rng.uniform(0.5, 1.0, (2, 8)).astype(np.float32)  # [K / 32, N]
      >>> packed = prepack_nk(q, scale, group_size=32)
      >>> packed.data.shape, packed.k, packed.n  # stored [N_pad, K_pad]
      ((128, 64), 64, 8)
      >>> w = (q - 8) * np.repeat(scale, 32, axis=0)
      >>> bool(jnp.array_equal(dequantize_nk(packed)[:64, :8], w))
      True
      >>> prepack_nk(q, scale[:1], group_size=48)
      Traceback (most recent call last):
          ...
      ValueError: prepack_nk takes group_size 16, 32, a multiple of 64 or -1 (per channel); ...
    """
    lut = canonical_lut(lut)
    q = jnp.asarray(q)
    if q.ndim != 2 or 0 in q.shape or not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q must be a non-empty [K, N] array of integer codes, got shape "
                         f"{tuple(q.shape)} and dtype {q.dtype}")
    k, n = q.shape
    g = k if group_size in (None, -1) or group_size >= k else int(group_size)
    if not nk_compatible(group_size, k, lut):
        raise ValueError(f"prepack_nk takes group_size 16, 32, a multiple of 64 or -1 (per "
                         f"channel); got lut={lut!r}, group_size={group_size}: quantize with one "
                         "of those, or run the scheme's XLA path (Scheme.apply / jquant.qdot)")
    if zero is not None and lut != "int4":
        raise ValueError(f"zero points apply to lut='int4' only, got lut={lut!r}")
    n_groups = -(-k // g)
    if jnp.shape(scale) != (n_groups, n):
        raise ValueError(f"scale has shape {tuple(jnp.shape(scale))}; expected ({n_groups}, {n}) "
                         f"for q of shape ({k}, {n}) and group_size {group_size}")
    perm = None
    if g_idx is not None:
        perm, q = sort_act_order(g_idx, q, g, n_groups)
    k_pad = round_up(k, math.lcm(pad_k, g) if g < k else pad_k)
    group = g if g < k else k_pad
    n_pad = round_up(n, pad_n)
    codes = q.astype(jnp.int32).T
    pad = ((0, n_pad - n), (0, k_pad - k))   # padded codes decode to 0
    if lut == "int4":
        data = jnp.pad(codes - 8, pad)
        if zero is not None and k_pad > k:
            # Padded rows of the last group hold its (rounded) zero point, so they decode to 0 too,
            # not to (8 - z) * s (a finite weight that only x's zero padding cancelled, until it overflowed).
            z_last = jnp.clip(jnp.round(jnp.asarray(zero, jnp.float32)[-1]), 0, 15).astype(jnp.int32) - 8
            data = data.at[:n, k:].set(z_last[:, None])
        data = data.astype(jnp.int4)
    elif lut == "e2m1":
        data = pack_e2m1_pairs(jnp.pad(codes, pad))
    else:   # a table (NF4, bnb FP4): the codes as they are
        zero_code = int(np.flatnonzero(lut_values(lut) == 0)[0])
        data = signed_int4(jnp.pad(codes & 0xF, pad, constant_values=zero_code))
    if word_order:
        data = to_word_order(data, lut)

    def per_group(values, dtype):
        rows = k_pad // group
        return jnp.pad(jnp.asarray(values).astype(dtype),
                       ((0, rows - values.shape[0]), (0, n_pad - n)))

    scale = jnp.asarray(scale)
    # e4m3 / e8m0 scales are exact in bf16 (8 exponent bits); fp16 / bf16 stay; the rest fp32.
    s_dtype = (jnp.bfloat16 if scale.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
               else scale.dtype if scale.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32)
    if lut == "e2m1":
        scale, global_scale = _e2m1_prescale(scale, global_scale)
        s_dtype = jnp.float32 if s_dtype == jnp.float16 else s_dtype   # fp16 cannot hold them
    zz = None
    if zero is not None:
        zz = per_group(jnp.asarray(zero, jnp.float32) - 8, jnp.bfloat16)
    gs = None if global_scale is None else jnp.asarray(global_scale, jnp.float32).reshape(1)
    return PackedW4NK(data=data, scale=per_group(scale, s_dtype), zero=zz, perm=perm,
                      global_scale=gs, lut=lut, k=k, n=n, group_size=group,
                      word_order=word_order)


def _e2m1_prescale(scale, global_scale):
    """E2M1 scales times 2^(126 − k), the global scale times 2^k (both exact), with k ≥ 0 the
    least that keeps the largest scale ≤ 2^127, inside bf16: the kernel's FP4 decode then skips
    its own × 2^126 and multiplies the codes' placed bits by the scale (``_e2m1_ptx``)."""
    s = jnp.asarray(scale, jnp.float32)
    top = jnp.max(jnp.abs(s))
    k = jnp.maximum(jnp.ceil(jnp.log2(top)) - 1, 0).astype(jnp.int32)   # 0 for all-zero scales
    gs = jnp.ones((1,), jnp.float32) if global_scale is None else global_scale
    return (jnp.ldexp(s, E2M1_SCALE_EXP - k),
            jnp.ldexp(jnp.asarray(gs, jnp.float32).reshape(1), k))


def sort_act_order(g_idx, q, g: int, n_groups: int):
    """(perm, rows of ``q`` stored sorted by group): the matmul gathers ``x[:, perm]``, never W."""
    g_idx = jnp.asarray(g_idx)
    if g_idx.shape != (q.shape[0],):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}; expected ({q.shape[0]},)")
    perm = jnp.argsort(g_idx, stable=True).astype(jnp.int32)
    if not isinstance(g_idx, jax.core.Tracer):
        # After sorting, group j must be stored rows j*G .. j*G+G: the kernel finds scales by row.
        sorted_groups = np.asarray(g_idx)[np.asarray(perm)]
        expected = np.arange(q.shape[0]) // g
        if not np.array_equal(sorted_groups, expected):
            raise ValueError(f"g_idx must put exactly group_size={g} rows in each of the {n_groups} "
                             f"groups (GPTQ act-order); got group sizes "
                             f"{np.bincount(np.asarray(g_idx), minlength=n_groups).tolist()[:8]}...")
    return perm, jnp.take(q, perm, axis=0)


def gather_pad(x2: jax.Array, packed: PackedW4NK, m_pad: int, k_cols: int | None = None) -> jax.Array:
    """``x2`` ``[M, K]`` with its columns in the weight's stored (act-order) row order, zero-padded
    to ``[m_pad, k_cols]`` (default ``K_pad``): what the kernel multiplies."""
    if packed.perm is not None:
        x2 = jnp.take(x2, packed.perm, axis=1)
    pad_m = m_pad - x2.shape[0]
    pad_k = (packed.k_pad if k_cols is None else k_cols) - packed.k
    return jnp.pad(x2, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else x2


def dequantize_nk(packed: PackedW4NK, dtype=jnp.float32) -> jax.Array:
    """The float weight ``[K_pad, N_pad]`` in stored row order, in fp32 math (padding is 0).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w4a16 import dequantize_nk, prepack_nk
      >>> q = np.array([[0, 15], [8, 9]] * 16)  # [K=32, N=2] codes; int4 value = code - 8
      >>> packed = prepack_nk(q, np.array([[0.5, 2.0]], np.float32), group_size=32)
      >>> w = dequantize_nk(packed)
      >>> w.shape, str(w.dtype), w[:2, :2].tolist()  # padded to [K_pad, N_pad]
      ((64, 128), 'float32', [[-4.0, 14.0], [0.0, 2.0]])
      >>> float(jnp.abs(w[32:]).max()), float(jnp.abs(w[:, 2:]).max())  # the padding is 0
      (0.0, 0.0)
      >>> str(dequantize_nk(packed, jnp.bfloat16).dtype)
      'bfloat16'
    """
    data = from_word_order(packed.data, packed.lut) if packed.word_order else packed.data
    if packed.lut == "int4":
        values = data.astype(jnp.float32).T
    else:
        codes = (unpack_e2m1_pairs(data) if packed.lut == "e2m1"
                 else data.astype(jnp.int32) & 0xF)
        values = jnp.asarray(lut_values(packed.lut))[codes].T
    rows = lambda t: jnp.repeat(t.astype(jnp.float32), packed.group_size, axis=0)
    if packed.zero is not None:
        values = values - rows(packed.zero)
    scale = packed.scale
    if packed.lut == "e2m1":   # its scales carry 2^E2M1_SCALE_EXP
        scale = jnp.ldexp(scale.astype(jnp.float32), -E2M1_SCALE_EXP)
    w = values * rows(scale)
    if packed.global_scale is not None:
        w = w * packed.global_scale[0]
    return w.astype(dtype)


def reference_nk(x2: jax.Array, packed: PackedW4NK, bias=None, dtype=jnp.float32) -> jax.Array:
    """The kernel's pure-JAX twin: dequantize in fp32 (then ``dtype``), dot with fp32 accumulation.

    Examples:
      ``x2 [M, K]`` times the packed ``[K, N]`` weight, what ``w4a16_matmul`` returns:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w4a16 import prepack_nk, reference_nk
      >>> rng = np.random.default_rng(0)
      >>> q, scale = rng.integers(0, 16, (64, 8)), rng.uniform(0.5, 1.0, (2, 8)).astype(np.float32)
      >>> packed = prepack_nk(q, scale, group_size=32)
      >>> x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
      >>> y = reference_nk(x, packed, bias=jnp.ones(8))
      >>> y.shape, bool(jnp.allclose(y, x @ ((q - 8) * np.repeat(scale, 32, axis=0)) + 1, atol=1e-4))
      ((3, 8), True)
    """
    xs = gather_pad(x2, packed, x2.shape[0]).astype(dtype)
    out = jnp.dot(xs, dequantize_nk(packed, dtype)[:, :packed.n],
                  preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x2.dtype)
