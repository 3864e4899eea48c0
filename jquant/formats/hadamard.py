"""Block-wise fast Walsh–Hadamard transform: the orthonormal Sylvester matrix ``H / sqrt(b)`` applied to
each run of ``b`` values along an axis. It is symmetric, hence its own inverse. Used to rotate a linear
layer's input axis (``jquant.algorithms.rotation``; a QParam's ``input_rotation``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jquant.kv.turboquant import rotation

BLOCKS = (16, 32, 64, 128)


def hadamard_matrix(block: int) -> jax.Array:
    """The dense orthonormal ``H / sqrt(block)`` (the reference the fast transform is checked against).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.algorithms.rotation import hadamard_matrix
      >>> h = hadamard_matrix(16)
      >>> h.shape, float(h[0, 0]), float(h[1, 1])  # entries ±1/4
      ((16, 16), 0.25, -0.25)
      >>> bool(jnp.allclose(h @ h, jnp.eye(16), atol=1e-6))  # symmetric and orthonormal: its own inverse
      True
    """
    check_block(block)
    return jnp.asarray(rotation(block))


def hadamard_blocks(x, block: int, axis: int = -1) -> jax.Array:
    """Applies ``H / sqrt(block)`` to each run of ``block`` consecutive elements along ``axis``.

    A fast Walsh–Hadamard transform: ``log2(block)`` butterfly stages of adds and subtracts, so
    ``O(n log block)`` instead of the dense ``O(n · block)``. Orthonormal and its own inverse.
    Computed and returned in float32.

    Raises:
      ValueError: ``block`` is not one of ``BLOCKS``, or ``x.shape[axis]`` is not a multiple of it.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms.rotation import hadamard_blocks, hadamard_matrix
      >>> x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
      >>> y = hadamard_blocks(x, 16)  # two blocks of 16 along the last axis
      >>> dense = (x.reshape(2, 2, 16) @ hadamard_matrix(16)).reshape(2, 32)
      >>> bool(jnp.allclose(y, dense, atol=1e-5))
      True
      >>> bool(jnp.allclose(hadamard_blocks(y, 16), x, atol=1e-5))  # applying it twice gives x back
      True
      >>> hadamard_blocks(x, 24)
      Traceback (most recent call last):
          ...
      ValueError: Hadamard block must be one of (16, 32, 64, 128), got 24
    """
    check_block(block)
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


def check_block(block) -> None:
    if type(block) is not int or block not in BLOCKS:
        raise ValueError(f"Hadamard block must be one of {BLOCKS}, got {block!r}")
