"""The tile-major 4-bit weight layout that the W4A16 kernels read, and ``prepack`` into it.

A unified 4-bit weight: codes ``q`` uint8 ``[K, N]`` in 0..15 and
``w[k, n] = (LUT[q[k, n]] - zero[g, n]) * scale[g, n] * global_scale`` with ``g = k // G``.

Layout (chosen so each kernel program streams one contiguous run of memory):

* ``data`` int32 ``[N_pad/BN, K_pad/BK, P, BN]`` with ``P = BK/8``: tile ``(nt, kt)`` holds rows
  ``kt*BK .. kt*BK+BK`` and columns ``nt*BN .. nt*BN+BN``; word ``[nt, kt, j, c]`` keeps the codes of
  rows ``kt*BK + i*P + j`` (``i = 0..7``) in bits ``4i..4i+3``. So nibble plane ``i`` of a tile is
  ``P`` consecutive rows, and the activations it meets are one contiguous slice of ``x``. A program
  that walks its K range reads tiles ``(nt, kt), (nt, kt+1), ...``: consecutive addresses.
* ``scale`` / ``zero`` ``[N_pad/BN, K_pad/G, BN]``: one row of ``BN`` per group, tile-major too.
  ``P`` divides ``G``, so every nibble plane lies inside one group and meets a single scale row.
* Padding: ``K`` up to a multiple of ``BK`` and ``G``, ``N`` up to ``BN``; padded codes are 0 and
  padded scales 0, so padded weights are exactly 0 (padded ``x`` columns are 0 too).
* Act-order: with ``g_idx``, rows are stored sorted by group (stable argsort) and ``perm`` says which
  input row each stored row is; the matmul gathers ``x[:, perm]`` (never ``W``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jquant.formats import bnb, mx

# The code books of the kernels: integers, OCP E2M1, and bitsandbytes' two tables (NF4 and its
# own FP4, which is not E2M1).
LUTS = ("int4", "e2m1", "nf4", "fp4_bnb")
_LUT_ALIASES = {"int4": "int4", "uint4": "int4", "e2m1": "e2m1", "fp4": "e2m1", "mxfp4": "e2m1",
                "nvfp4": "e2m1", "nf4": "nf4", "fp4_bnb": "fp4_bnb"}


def lut_values(lut: str) -> np.ndarray:
    """The 16 float32 values code ``0..15`` stands for under ``lut`` (the format modules' own)."""
    lut = canonical_lut(lut)
    if lut == "int4":
        return np.arange(16, dtype=np.float32)
    if lut == "e2m1":
        return mx.E2M1_VALUES.copy()
    return bnb.code_table(lut)


def canonical_lut(lut) -> str:
    if not isinstance(lut, str) or lut.lower() not in _LUT_ALIASES:
        raise ValueError(f"lut must be one of {sorted(_LUT_ALIASES)}, got {lut!r}")
    return _LUT_ALIASES[lut.lower()]


# Scales are stored in the narrowest float that holds every value of their input dtype exactly:
# e4m3 and e8m0 fit bf16 (8 exponent bits), fp16 stays fp16, anything else is fp32.
_SCALE_STORAGE = {jnp.dtype(jnp.bfloat16): jnp.bfloat16, jnp.dtype(jnp.float16): jnp.float16,
                  jnp.dtype(jnp.float8_e4m3fn): jnp.bfloat16,
                  jnp.dtype(jnp.float8_e8m0fnu): jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class PackedW4:
    """A 4-bit weight repacked for the W4A16 kernels (see the module docstring for the layout).

    ``k``/``n`` are the logical in/out features; ``group_size`` is in stored (sorted, padded) rows.
    ``zero_point`` is the constant zero used when ``zero`` is None (8 for uint4b8, 0 for fp codes).
    """

    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    global_scale: jax.Array | None = None
    perm: jax.Array | None = None
    lut: str = "int4"
    zero_point: float = 0.0
    k: int = 0
    n: int = 0
    group_size: int = 0
    block_n: int = 64
    block_k: int = 512

    @property
    def plane(self) -> int:
        return self.block_k // 8

    @property
    def k_pad(self) -> int:
        return self.data.shape[1] * self.block_k

    @property
    def n_pad(self) -> int:
        return self.data.shape[0] * self.block_n

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(self))


jax.tree_util.register_dataclass(
    PackedW4,
    data_fields=["data", "scale", "zero", "global_scale", "perm"],
    meta_fields=["lut", "zero_point", "k", "n", "group_size", "block_n", "block_k"],
)


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def layout_blocks(k: int, group_size: int, block_n: int, block_k: int) -> tuple[int, int, int]:
    """(block_n, block_k, group) after fitting ``block_k`` to the group: a nibble plane (BK/8 rows)
    must lie inside one group, so BK ≤ 8·G; BK ≥ 128 keeps planes ≥ 16 rows for the tensor cores."""
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not _is_pow2(v) or v < 16:
            raise ValueError(f"{name} must be a power of two ≥ 16, got {v}")
    g = k if group_size in (None, -1) or group_size >= k else int(group_size)
    if g <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    if g < k and not _is_pow2(g):
        raise ValueError(f"group_size must be a power of two (or -1 / K for per-channel), got {g}")
    if g < k:
        if g < 16:
            raise ValueError(f"group_size {g} is too small for the W4A16 kernels (need ≥ 16)")
        block_k = max(128, min(block_k, 8 * g))
    return block_n, block_k, g


def prepack(q, scale, zero=None, *, lut, group_size, global_scale=None, g_idx=None, config=None,
            zero_point=None) -> PackedW4:
    """Repacks a unified 4-bit weight into the kernels' tile-major layout (once, after loading).

    Args:
      q: integer codes ``[K, N]`` with values 0..15 (uint8 or any integer dtype).
      scale: float ``[ceil(K/G), N]`` (per-channel: ``[1, N]``); e4m3 / e8m0 scales may be passed in
        their float8 dtypes and are kept exactly.
      zero: optional ``[ceil(K/G), N]`` zero points (int4 asymmetric), subtracted before scaling.
      lut: ``"int4"`` (codes are integers), ``"e2m1"`` (MXFP4 / NVFP4) or ``"nf4"``.
      group_size: G along K, or -1 / K for one group per column.
      global_scale: optional scalar multiplier (NVFP4).
      g_idx: optional int32 ``[K]`` GPTQ act-order group of each input row; every group must hold
        exactly G rows (what GPTQ produces).
      config: a ``TuningConfig`` whose ``block_n``/``block_k`` set the tile (default 64 × 512, the
        H200 sweep's best for both kernels; small groups shrink block_k to 8·G).
      zero_point: the constant zero when ``zero`` is None (default 8 for int4 = uint4b8, else 0).
    """
    lut = canonical_lut(lut)
    q = jnp.asarray(q)
    if q.ndim != 2 or 0 in q.shape:
        raise ValueError(f"q must be a non-empty [K, N] array of codes, got shape {tuple(q.shape)}")
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise TypeError(f"q must hold integer codes 0..15, got dtype {q.dtype} (shape {tuple(q.shape)})")
    k, n = q.shape
    block_n = getattr(config, "block_n", 64)
    block_k = getattr(config, "block_k", 512)
    block_n, block_k, g = layout_blocks(k, group_size, block_n, block_k)
    n_groups = -(-k // g)

    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"scale must be a float array, got dtype {scale.dtype}")
    if scale.shape != (n_groups, n):
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected ({n_groups}, {n}) for "
                         f"q of shape ({k}, {n}) and group_size {group_size}")
    if zero is not None:
        if lut != "int4":
            raise ValueError(f"zero points apply to lut='int4' only, got lut={lut!r}")
        zero = jnp.asarray(zero)
        if zero.shape != (n_groups, n):
            raise ValueError(f"zero has shape {tuple(zero.shape)}; expected ({n_groups}, {n})")
    if zero_point is None:
        zero_point = 8.0 if lut == "int4" and zero is None else 0.0

    perm = None
    if g_idx is not None:
        perm, q = _sort_act_order(g_idx, q, g, n_groups)

    # Pad K to whole tiles and whole groups, N to whole column tiles.
    k_pad = _round_up(k, math.lcm(block_k, g) if g < k else block_k)
    group = g if g < k else k_pad
    n_pad = _round_up(n, block_n)
    q = jnp.pad(q.astype(jnp.uint32), ((0, k_pad - k), (0, n_pad - n)))
    nt, kt, p = n_pad // block_n, k_pad // block_k, block_k // 8
    tiles = q.reshape(kt, 8, p, nt, block_n).transpose(3, 0, 2, 4, 1)   # [nt, kt, p, bn, 8 nibbles]
    words = jnp.sum(tiles << (4 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
    data = jax.lax.bitcast_convert_type(words, jnp.int32)

    def per_group(values, dtype):
        rows = k_pad // group
        values = jnp.pad(values.astype(dtype), ((0, rows - values.shape[0]), (0, n_pad - n)))
        return values.reshape(rows, nt, block_n).transpose(1, 0, 2)

    scale_t = per_group(scale, _SCALE_STORAGE.get(jnp.dtype(scale.dtype), jnp.float32))
    zero_t = None
    if zero is not None:
        # Integer zeros (0..15) are exact in bf16; fractional ones keep fp32.
        zero_dtype = jnp.bfloat16 if jnp.issubdtype(zero.dtype, jnp.integer) else jnp.float32
        zero_t = per_group(zero, zero_dtype)
    gs = None
    if global_scale is not None:
        gs = jnp.asarray(global_scale, jnp.float32).reshape(1)
    return PackedW4(data=data, scale=scale_t, zero=zero_t, global_scale=gs, perm=perm, lut=lut,
                    zero_point=float(zero_point), k=k, n=n, group_size=group, block_n=block_n,
                    block_k=block_k)


def _sort_act_order(g_idx, q, g, n_groups):
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


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def gather_pad(x2: jax.Array, packed, m_pad: int, k_cols: int | None = None) -> jax.Array:
    """``x2`` ``[M, K]`` with its columns in the weight's stored (act-order) row order, zero-padded
    to ``[m_pad, k_cols]`` (default ``K_pad``): what every kernel layout (``PackedW4``,
    ``PackedW4NK``) multiplies."""
    if packed.perm is not None:
        x2 = jnp.take(x2, packed.perm, axis=1)
    pad_m = m_pad - x2.shape[0]
    pad_k = (packed.k_pad if k_cols is None else k_cols) - packed.k
    return jnp.pad(x2, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else x2


def unpack_codes(packed: PackedW4) -> jax.Array:
    """Stored codes ``[K_pad, N_pad]`` (uint32) in stored (sorted) row order."""
    words = jax.lax.bitcast_convert_type(packed.data, jnp.uint32)
    nibbles = (words[..., None] >> (4 * jnp.arange(8, dtype=jnp.uint32))) & 15   # [nt, kt, p, bn, 8]
    return nibbles.transpose(1, 4, 2, 0, 3).reshape(packed.k_pad, packed.n_pad)


def dequantize_packed(packed: PackedW4, dtype=jnp.float32) -> jax.Array:
    """The float weight ``[K_pad, N_pad]`` in stored row order, in fp32 math. Padded columns are 0;
    padded rows may not be (NF4's code 0 is -1), which is harmless: they meet zero activations."""
    values = jnp.asarray(lut_values(packed.lut))[unpack_codes(packed)]

    def rows(t):   # [nt, groups, bn] → one row per stored k
        full = t.astype(jnp.float32).transpose(1, 0, 2).reshape(t.shape[1], packed.n_pad)
        return jnp.repeat(full, packed.group_size, axis=0)

    zero = rows(packed.zero) if packed.zero is not None else packed.zero_point
    w = (values - zero) * rows(packed.scale)
    if packed.global_scale is not None:
        w = w * packed.global_scale[0]
    return w.astype(dtype)
