"""Block-wise Walsh–Hadamard rotation of a linear layer's input (K) axis (QuaRot / SpinQuant style).

A Hadamard rotation spreads a few outlier input channels over the whole block, so 4-bit block formats
(MXFP4, NVFP4, int4 groups) waste less of their range on them. The orthonormal Sylvester matrix
``H / sqrt(b)`` is symmetric, hence its own inverse, so rotating both the activations and the weight
along K leaves ``x @ w.T`` unchanged: ``(x H)(w H)^T = x H H^T w^T = x w^T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.formats.hadamard import BLOCKS, hadamard_blocks, hadamard_matrix

__all__ = ["BLOCKS", "hadamard_blocks", "hadamard_matrix", "rotate_act", "rotate_linear"]


def rotate_linear(w, block: int) -> jax.Array:
    """A PyTorch-orientation weight ``[N, K]`` rotated along K: ``w H`` block by block."""
    _check_weight(w)
    return hadamard_blocks(w, block, axis=-1)


def rotate_act(x, block: int) -> jax.Array:
    """Activations ``[..., K]`` rotated to match ``rotate_linear``: ``rotate_act(x) @ rotate_linear(w).T``
    equals ``x @ w.T`` to float32 precision. Also undoes a rotation (the transform is an involution)."""
    return hadamard_blocks(x, block, axis=-1)


def _check_weight(w) -> None:
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be a 2-D [N, K] weight, got shape {tuple(jnp.shape(w))}")
