"""Shared input checks and block bookkeeping for every format's ``quantize``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def check_float_input(x, name: str = "x", min_ndim: int = 1):
    """Returns ``x`` as a jax array after checking it is a non-empty floating array of ndim ≥ min_ndim."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype} (shape {tuple(x.shape)})")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}")
    if math.prod(x.shape) == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")
    return jnp.asarray(x)


def group_block(shape, axis: int, group_size: int | None, name: str = "x") -> tuple[int, ...]:
    """Block tuple for groups of ``group_size`` along ``axis`` (None or -1: the whole axis)."""
    ndim = len(shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for {name} with shape {tuple(shape)}")
    axis %= ndim
    size = shape[axis]
    g = size if group_size in (None, -1) else int(group_size)
    if g <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    if size % g:
        raise ValueError(f"{name} with shape {tuple(shape)}: axis {axis} (size {size}) is not divisible "
                         f"by group_size {g}")
    return tuple(g if i == axis else 1 for i in range(ndim))


def to_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Reshapes ``x`` (each axis divisible by its block) to ``(n0, b0, n1, b1, ...)``."""
    new_shape = []
    for size, b in zip(x.shape, block):
        new_shape += [size // b, b]
    return x.reshape(new_shape)


def block_axes(ndim: int) -> tuple[int, ...]:
    """Axes of the in-block dimensions of ``to_blocks``' output."""
    return tuple(2 * i + 1 for i in range(ndim))


def per_block(values: jax.Array, ndim: int) -> jax.Array:
    """Inserts singleton in-block axes so per-block ``values`` broadcast against ``to_blocks`` output."""
    return jnp.expand_dims(values, block_axes(ndim))


def nan_max(x: jax.Array, axis=None) -> jax.Array:
    """``jnp.max`` that returns NaN for any reduction holding a NaN, at every size.

    XLA's CPU backend drops NaN from vectorized max/min reductions of ~4096 elements and more (a
    [4096] array with one NaN reduces to its largest number, also blockwise), so the NaN test is
    its own reduction.
    """
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, jnp.max(x, axis=axis)).astype(x.dtype)


def nan_min(x: jax.Array, axis=None) -> jax.Array:
    """``jnp.min`` with ``nan_max``'s NaN guarantee."""
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, jnp.min(x, axis=axis)).astype(x.dtype)


def block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Max |x| of each block, shape ``shape / block`` (a block holding a NaN gives NaN)."""
    return nan_max(jnp.abs(to_blocks(x, block)), axis=block_axes(x.ndim))


def pad_to_blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Zero-pads each axis up to a multiple of its block (for formats whose reference pads)."""
    pads = [(0, -s % b) for s, b in zip(x.shape, block)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x
