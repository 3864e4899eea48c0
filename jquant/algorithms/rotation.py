"""Block-wise Walsh–Hadamard rotation of a linear layer's input (K) axis (QuaRot / SpinQuant style).

A Hadamard rotation spreads a few outlier input channels over the whole block, so 4-bit block formats
(MXFP4, NVFP4, int4 groups) waste less of their range on them. The orthonormal Sylvester matrix
``H / sqrt(b)`` is symmetric, hence its own inverse, so rotating both the activations and the weight
along K leaves ``x @ w.T`` unchanged: ``(x H)(w H)^T = x H H^T w^T = x w^T``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jquant.kv.turboquant import rotation

BLOCKS = (16, 32, 64, 128)


def hadamard_matrix(block: int) -> jax.Array:
    """The dense orthonormal ``H / sqrt(block)`` (the reference the fast transform is checked against)."""
    _check_block(block)
    return jnp.asarray(rotation(block))


def hadamard_blocks(x, block: int, axis: int = -1) -> jax.Array:
    """Applies ``H / sqrt(block)`` to each run of ``block`` consecutive elements along ``axis``.

    A fast Walsh–Hadamard transform: ``log2(block)`` butterfly stages of adds and subtracts, so
    ``O(n log block)`` instead of the dense ``O(n · block)``. Orthonormal and its own inverse.
    Computed and returned in float32.

    Raises:
      ValueError: ``block`` is not one of ``BLOCKS``, or ``x.shape[axis]`` is not a multiple of it.
    """
    _check_block(block)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating array, got {x.dtype}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x with shape {tuple(x.shape)}")
    axis %= x.ndim
    if x.shape[axis] % block:
        raise ValueError(f"x with shape {tuple(x.shape)}: axis {axis} (size {x.shape[axis]}) is not a "
                         f"multiple of the Hadamard block {block}")
    return _fwht(x, block, axis)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _fwht(x, block, axis):
    y = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    shape = y.shape
    y = y.reshape(-1, block)
    # Stage h pairs element i with i + h inside each 2h run: the Sylvester recursion
    # H_2h = [[H_h, H_h], [H_h, -H_h]] unrolled from the smallest h up.
    h = 1
    while h < block:
        pairs = y.reshape(y.shape[0], block // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        y = jnp.stack([lo + hi, lo - hi], axis=2).reshape(-1, block)
        h *= 2
    y = y * jnp.float32(1 / block ** 0.5)
    return jnp.moveaxis(y.reshape(shape), -1, axis)


def rotate_linear(w, block: int) -> jax.Array:
    """A PyTorch-orientation weight ``[N, K]`` rotated along K: ``w H`` block by block."""
    _check_weight(w)
    return hadamard_blocks(w, block, axis=-1)


def rotate_act(x, block: int) -> jax.Array:
    """Activations ``[..., K]`` rotated to match ``rotate_linear``: ``rotate_act(x) @ rotate_linear(w).T``
    equals ``x @ w.T`` to float32 precision. Also undoes a rotation (the transform is an involution)."""
    return hadamard_blocks(x, block, axis=-1)


def _check_block(block) -> None:
    if type(block) is not int or block not in BLOCKS:
        raise ValueError(f"Hadamard block must be one of {BLOCKS}, got {block!r}")


def _check_weight(w) -> None:
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be a 2-D [N, K] weight, got shape {tuple(jnp.shape(w))}")
