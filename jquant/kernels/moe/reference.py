"""The pure-JAX grouped GEMM every MoE kernel is checked against: dequantize, then ``jax.lax.ragged_dot``.

Contract (``jax.lax.ragged_dot``'s, with the weight in PyTorch orientation): rows of ``x [T, K]`` are
sorted by expert; expert ``e`` owns the ``group_sizes[e]`` rows after those of experts ``0..e-1``;
``y[t] = W[e(t)] @ x[t]`` for each owned row, and rows past ``sum(group_sizes)`` (which must be
``<= T``) come out as zeros. Products accumulate in float32 and return in x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.qtensor import QTensor


@jax.jit
def grouped_matmul_xla(x: jax.Array, experts: QTensor | jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x [T, K]`` rows grouped by expert, ``experts [E, N, K]`` (QTensor or float), ``group_sizes [E]``
    int32 → ``[T, N]`` in x's dtype. No input checks (``api.grouped_matmul`` does them)."""
    w = experts.dequantize(x.dtype) if isinstance(experts, QTensor) else jnp.asarray(experts, x.dtype)
    # ragged_dot takes the weights as [E, K, N].
    y = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
