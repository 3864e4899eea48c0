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
    """A PyTorch-orientation weight ``[N, K]`` rotated along K: ``w H`` block by block.

    Examples:
      Rotating both operands along K leaves the product unchanged:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms.rotation import rotate_act, rotate_linear
      >>> rng = np.random.default_rng(0)
      >>> w = rng.standard_normal((8, 64)).astype(np.float32)
      >>> x = rng.standard_normal((3, 64)).astype(np.float32)
      >>> bool(jnp.allclose(rotate_act(x, 32) @ rotate_linear(w, 32).T, x @ w.T, atol=1e-4))
      True

      An outlier input channel is spread over its whole block:

      >>> w = np.zeros((8, 64), np.float32); w[0, 5] = 8.0
      >>> rotated = jnp.abs(rotate_linear(w, 32))
      >>> f"{float(rotated.max()):.4f}", int((rotated > 1.414).sum())  # 8 / sqrt(32) on 32 values
      ('1.4142', 32)
    """
    _check_weight(w)
    return hadamard_blocks(w, block, axis=-1)


def rotate_act(x, block: int) -> jax.Array:
    """Activations ``[..., K]`` rotated to match ``rotate_linear``: ``rotate_act(x) @ rotate_linear(w).T``
    equals ``x @ w.T`` to float32 precision. Also undoes a rotation (the transform is an involution).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms.rotation import rotate_act
      >>> x = np.random.default_rng(0).standard_normal((2, 5, 64)).astype(np.float32)
      >>> rotate_act(x, 64).shape
      (2, 5, 64)
      >>> bool(jnp.allclose(rotate_act(rotate_act(x, 64), 64), x, atol=1e-5))
      True
    """
    return hadamard_blocks(x, block, axis=-1)


def _check_weight(w) -> None:
    if jnp.ndim(w) != 2:
        raise ValueError(f"w must be a 2-D [N, K] weight, got shape {tuple(jnp.shape(w))}")
