"""Fake quantization: quantize then dequantize in one step, keeping the input's dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.formats.blocking import check_float_input


def blockwise_symmetric_fake_quant(x, block_size: int, qmax: int):
    """Symmetric round-to-nearest-even fake quantization over consecutive blocks of a 1-D array.

    Each block's scale is ``amax / qmax``; an all-zero block gets scale 1 (so zeros stay zeros instead
    of dividing by zero). Returns ``(fake_quantized, scales)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.formats.fake_quant import blockwise_symmetric_fake_quant
      >>> values, scales = blockwise_symmetric_fake_quant(jnp.array([0., 1., -2., 8.]), 2, 7)
      >>> (scales * 7).tolist()  # scales [1/7, 8/7]
      [1.0, 8.0]
      >>> [f"{v:.4f}" for v in values.tolist()]  # -2 / (8/7) = -1.75, nearest code -2: -16/7
      ['0.0000', '1.0000', '-2.2857', '8.0000']
    """
    x = check_float_input(x, "x")
    if x.ndim != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if x.shape[0] % block_size:
        raise ValueError(f"x with shape {tuple(x.shape)} is not divisible into blocks of {block_size}")
    if not isinstance(qmax, int) or qmax <= 0:
        raise ValueError(f"qmax must be a positive int, got {qmax!r}")
    return _fake_quant(x, block_size, qmax)


@jax.jit(static_argnums=(1, 2))
def _fake_quant(x, block_size, qmax):
    blocks = x.astype(jnp.float32).reshape(-1, block_size)
    amax = jnp.max(jnp.abs(blocks), axis=1)
    scales = jnp.where(amax == 0, 1.0, amax / qmax)
    q = jnp.clip(jnp.round(blocks / scales[:, None]), -qmax, qmax)
    return (q * scales[:, None]).reshape(x.shape).astype(x.dtype), scales
