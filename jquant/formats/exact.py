"""Arithmetic that stays bit-exact with PyTorch/numpy under XLA's optimisations.

Two XLA rewrites break bit-exactness with the reference libraries, also under ``jit`` on CPU:
- ``a / broadcast(b)`` (a constant included) becomes ``a * broadcast(1 / b)``, an ulp off often enough
  to change codes and scales; ``exact_divide`` keeps a true division behind an optimization barrier.
- a float32 → bf16/fp16 → float32 round trip may be dropped ("excess precision"), so PyTorch's
  "compute in the weight's dtype" arithmetic would differ; ``round_to_precision`` uses
  ``reduce_precision``, which XLA never elides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def exact_divide(numerator: jax.Array, denominator) -> jax.Array:
    """``numerator / denominator`` correctly rounded, also under ``jit``."""
    denominator = jnp.broadcast_to(jnp.asarray(denominator, numerator.dtype), numerator.shape)
    numerator, denominator = lax.optimization_barrier((numerator, denominator))
    return numerator / denominator


def round_to_precision(values: jax.Array, dtype) -> jax.Array:
    """float32 ``values`` rounded (half to even) to ``dtype``'s precision and range, kept as float32.

    This is PyTorch's bf16/fp16 op semantics: compute in float32, round the result to the dtype.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return values
    info = jnp.finfo(dtype)
    return lax.reduce_precision(values, exponent_bits=info.nexp, mantissa_bits=info.nmant)
