"""``lowered_once``: a Pallas kernel's entry point jitted, so a program lowers each kernel once per shape.

Mosaic GPU and Triton lower a kernel in Python each time a traced program calls it; a model calls
the same kernel with the same shapes in every layer. A jitted entry point is traced and lowered once
per (shapes, static arguments) and called from every site (XLA inlines the calls, so the compiled
program is the same). Exporting for CUDA on this repository's CPU, a program of 8 identical W4A16
GEMMs at 6144 × 4096 took 3.32 s (0.47 s for one) and 0.44 s with the entry jitted; a Llama-3-8B
decode step has 128 such GEMMs and 64 attention and cache-insert kernels.

Interpret mode (CPU tests) calls the function as it is: lowering there costs nothing worth saving,
and one test run with the interpreted kernels jitted this way stopped in a deadlock (a worker idle
inside an eager op after an interpreted grouped FP8 GEMM; not reproduced in 18 more runs of those
examples, never seen with the interpreted kernels called directly).
"""

from __future__ import annotations

import functools

import jax


def lowered_once(*static_argnames: str):
    """Decorator: ``jax.jit`` with ``static_argnames`` (the launch config, flags, Python scalars) for a
    function that issues a Pallas kernel and takes ``interpret`` as a keyword; its array arguments
    (None included) stay traced.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.lowered_once import lowered_once
      >>> @lowered_once("scale", "interpret")
      ... def scaled(x, *, scale: float, interpret: bool = False):
      ...     return x * scale
      >>> float(scaled(jnp.float32(2), scale=1.5))
      3.0
    """
    def wrap(fn):
        jitted = jax.jit(fn, static_argnames=static_argnames)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            return (fn if kwargs.get("interpret") else jitted)(*args, **kwargs)
        return entry
    return wrap
