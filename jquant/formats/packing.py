"""Bit packing of small integer codes into bytes.

One primitive covers every layout: codes along ``axis`` are concatenated into a little-endian
bitstream (code ``i`` occupies bits ``[i*bits, (i+1)*bits)``) and cut into bytes. Two 4-bit codes
per byte come out "low nibble first"; viewing the bytes as little-endian int32 gives the GPTQ word
layout (8 nibbles per word, element ``i`` at bits ``4i``), and 3-bit codes give GPTQ's 32-values-in-
3-words layout. ``order="high_first"`` swaps the two nibbles of each byte (bitsandbytes).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def codes_per_group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group for ``bits``-wide codes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    n = 8 // math.gcd(8, bits)
    return n, n * bits // 8


def _move(x, axis):
    return jnp.moveaxis(x, axis, -1)


def pack_bits(codes, bits: int, axis: int = -1, order: str = "low_first"):
    """Packs unsigned ``bits``-wide codes (any integer dtype, values < 2**bits) along ``axis`` into uint8."""
    codes = jnp.asarray(codes)
    axis = axis % codes.ndim
    n, nbytes = codes_per_group(bits)
    length = codes.shape[axis]
    if length % n:
        raise ValueError(f"pack_bits: axis {axis} of codes with shape {codes.shape} must be a multiple "
                         f"of {n} to pack {bits}-bit codes into whole bytes")
    if bits == 8:
        return codes.astype(jnp.uint8)
    x = _move(codes.astype(jnp.uint8), axis)
    lead = x.shape[:-1]
    x = x.reshape(*lead, length // n, n)
    shifts = jnp.arange(bits, dtype=jnp.uint8)
    bitstream = ((x[..., None] >> shifts) & 1).reshape(*lead, length // n, nbytes, 8)
    weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8))
    packed = jnp.sum(bitstream * weights, axis=-1, dtype=jnp.uint8).reshape(*lead, length * bits // 8)
    if order == "high_first":
        packed = _swap_nibbles(packed, bits)
    elif order != "low_first":
        raise ValueError(f"order must be 'low_first' or 'high_first', got {order!r}")
    return jnp.moveaxis(packed, -1, axis)


def unpack_bits(packed, bits: int, axis: int = -1, order: str = "low_first"):
    """Inverse of ``pack_bits``: uint8 bytes along ``axis`` back to uint8 codes."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_bits expects uint8 packed data, got {packed.dtype}")
    axis = axis % packed.ndim
    n, nbytes = codes_per_group(bits)
    if bits == 8:
        return packed
    if order == "high_first":
        packed = _swap_nibbles(packed, bits)
    elif order != "low_first":
        raise ValueError(f"order must be 'low_first' or 'high_first', got {order!r}")
    x = _move(packed, axis)
    lead = x.shape[:-1]
    length = x.shape[-1]
    if length % nbytes:
        raise ValueError(f"unpack_bits: axis {axis} of packed data with shape {packed.shape} must be a "
                         f"multiple of {nbytes} bytes for {bits}-bit codes")
    x = x.reshape(*lead, length // nbytes, nbytes)
    bitstream = ((x[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1).reshape(*lead, length // nbytes, n, bits)
    weights = (jnp.uint8(1) << jnp.arange(bits, dtype=jnp.uint8))
    codes = jnp.sum(bitstream * weights, axis=-1, dtype=jnp.uint8).reshape(*lead, length * 8 // bits)
    return jnp.moveaxis(codes, -1, axis)


def _swap_nibbles(x, bits):
    if bits != 4:
        raise ValueError(f"order='high_first' is defined for 4-bit codes only, got bits={bits}")
    return (x >> 4) | (x << 4)


def bytes_to_int32(packed, axis: int = -1):
    """Views little-endian uint8 bytes along ``axis`` (a multiple of 4) as int32 words."""
    packed = np.asarray(packed, dtype=np.uint8)
    moved = np.ascontiguousarray(np.moveaxis(packed, axis, -1))
    if moved.shape[-1] % 4:
        raise ValueError(f"bytes_to_int32: axis {axis} of shape {packed.shape} must be a multiple of 4")
    return np.moveaxis(moved.view("<i4"), -1, axis)


def int32_to_bytes(words, axis: int = -1):
    """Inverse of ``bytes_to_int32``."""
    words = np.asarray(words)
    if words.dtype != np.int32:
        raise TypeError(f"int32_to_bytes expects int32 words, got {words.dtype}")
    moved = np.ascontiguousarray(np.moveaxis(words.astype("<i4"), axis, -1))
    return np.moveaxis(moved.view(np.uint8), -1, axis)
