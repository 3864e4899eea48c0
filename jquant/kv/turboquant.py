"""TurboQuant codes (arXiv 2504.19874 as vLLM ships it, vllm/v1/attention/ops/triton_turboquant_store.py).

Keys: n = |k|, y = (k / (n + 1e-8)) @ H / sqrt(d) (Sylvester Hadamard, no sign flips); index of the
Lloyd-Max cell (y >= midpoint goes up); fp16 norm. Norm correction: centroid vector rescaled to unit norm
before the inverse rotation. Values: scale = max((max - min) / (2^b - 1), 1e-8),
q = clip(floor((v - min) / scale + 0.5)), fp16 scale and min. Packing: 4-bit low nibble first; 3-bit
8 values per 3 bytes, value j at bit 3j little-endian.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jquant.formats.exact import exact_divide
from jquant.kv import lloyd_max


def check_head_dim(head_dim: int) -> None:
    if head_dim < 8 or head_dim & (head_dim - 1):
        raise ValueError(f"TurboQuant needs a power-of-two head_dim >= 8 (Hadamard); got {head_dim}")


@functools.lru_cache(maxsize=None)
def rotation(head_dim: int) -> np.ndarray:
    """H / sqrt(d): symmetric and orthonormal, so it is its own inverse."""
    check_head_dim(head_dim)
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(head_dim)).astype(np.float32)


def pack(q, bits: int):
    """[..., D] ints in [0, 2^bits) -> [..., D * bits / 8] uint8."""
    q = q.astype(jnp.uint32)
    if bits == 4:
        q = q.reshape(*q.shape[:-1], -1, 2)
        return (q[..., 0] | (q[..., 1] << 4)).astype(jnp.uint8)
    if bits == 3:
        q = q.reshape(*q.shape[:-1], -1, 8)
        w = jnp.sum(q << (3 * jnp.arange(8, dtype=jnp.uint32)), axis=-1)
        b = jnp.stack([(w >> s) & 0xFF for s in (0, 8, 16)], axis=-1)
        return b.reshape(*b.shape[:-2], -1).astype(jnp.uint8)
    raise ValueError(f"packing supports 3 or 4 bits, got {bits}")


def unpack(packed, bits: int):
    p = packed.astype(jnp.uint32)
    if bits == 4:
        q = jnp.stack([p & 0xF, p >> 4], axis=-1)
        return q.reshape(*q.shape[:-2], -1).astype(jnp.int32)
    if bits == 3:
        p = p.reshape(*p.shape[:-1], -1, 3)
        w = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)
        q = (w[..., None] >> (3 * jnp.arange(8, dtype=jnp.uint32))) & 7
        return q.reshape(*q.shape[:-2], -1).astype(jnp.int32)
    raise ValueError(f"packing supports 3 or 4 bits, got {bits}")


def quantize_keys(k, bits: int):
    """k [..., D] -> (packed indices uint8 [..., D*bits/8], norm float16 [...])."""
    d = k.shape[-1]
    k = k.astype(jnp.float32)
    n = jnp.linalg.norm(k, axis=-1)
    y = (k / (n[..., None] + 1e-8)) @ rotation(d)
    c = lloyd_max.centroids(d, bits)
    # compare_all: the default "scan" is a while loop (log2 of the 2^bits boundaries), launched on
    # every decode step's insert; against ≤ 15 boundaries one compare-and-count fusion is cheaper.
    idx = jnp.searchsorted(jnp.asarray(0.5 * (c[1:] + c[:-1])), y, side="right", method="compare_all")
    return pack(idx, bits), n.astype(jnp.float16)


def rotated_key_directions(packed, bits: int, head_dim: int, norm_correction: bool):
    """Centroid vectors in the rotated domain (unit norm when norm_correction)."""
    c = jnp.asarray(lloyd_max.centroids(head_dim, bits))[unpack(packed, bits)]
    if norm_correction:
        c = c / jnp.maximum(jnp.linalg.norm(c, axis=-1, keepdims=True), 1e-30)
    return c


def dequantize_keys(packed, norm, bits: int, head_dim: int, norm_correction: bool):
    c = rotated_key_directions(packed, bits, head_dim, norm_correction)
    return norm.astype(jnp.float32)[..., None] * (c @ rotation(head_dim))


def quantize_values(v, bits: int):
    """v [..., D] -> (packed uint8, scale float16 [...], min float16 [...])."""
    v = v.astype(jnp.float32)
    lo, hi = jnp.min(v, axis=-1), jnp.max(v, axis=-1)
    levels = 2**bits - 1
    s = jnp.maximum((hi - lo) / levels, 1e-8)
    s = jnp.where(jnp.isnan(hi - lo), hi - lo, s)
    q = jnp.clip(jnp.floor(exact_divide(v - lo[..., None], s[..., None]) + 0.5), 0, levels)
    return pack(jnp.nan_to_num(q).astype(jnp.int32), bits), s.astype(jnp.float16), lo.astype(jnp.float16)


def dequantize_values(packed, scale, vmin, bits: int):
    q = unpack(packed, bits).astype(jnp.float32)
    return q * scale.astype(jnp.float32)[..., None] + vmin.astype(jnp.float32)[..., None]
