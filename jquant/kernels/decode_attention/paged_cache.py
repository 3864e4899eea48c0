"""Decode attention over one layer of a ``jquant.kv`` paged cache, whatever its format.

bf16, per-tensor FP8 and per-(token, head) INT8/FP8 pages go to ``decode_attention``; TurboQuant pages to
their own kernel (``triton_turboquant``, scored in the rotated domain). Both run the Pallas kernel where
``jquant.schemes.dispatch.decode_attention_impl`` says so (a CUDA GPU, a 16-bit query) and XLA
elsewhere; for TurboQuant the XLA path is ``jquant.kv.attention_reference``.
"""

from __future__ import annotations

import jax

from jquant.kernels.decode_attention import triton_turboquant
from jquant.kernels.decode_attention.api import IMPLS, check_tables, decode_attention
from jquant.kernels.decode_attention.config import TuningConfig
from jquant.kv.attention_reference import attention_reference
from jquant.kv.paged import PagedKVCache
from jquant.schemes import dispatch


def cache_decode_attention(q: jax.Array, layer: PagedKVCache, block_tables: jax.Array, lengths: jax.Array,
                           *, impl: str = "auto", config: TuningConfig | None = None,
                           interpret: bool = False) -> jax.Array:
    """``q [B, Hq, D]`` against each sequence's first ``lengths[b]`` cached tokens; ``[B, Hq, D]`` in
    q's dtype (zeros for a sequence of length 0). ``config``: the kernel's launch (None: its default);
    ``interpret``: run the Pallas kernel in interpret mode (tests on CPU).

    Examples:
      Five tokens in an INT8 cache (a scale per token and head), read back as the reference reads them:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.decode_attention import cache_decode_attention
      >>> from jquant.kv import allocate, attention_reference, insert_reference
      >>> rng = np.random.default_rng(0)
      >>> layer = allocate("int8_per_token_head", num_pages=2, page_size=4, kv_heads=1, head_dim=16)
      >>> k, v = (jnp.asarray(rng.standard_normal((5, 1, 16)), jnp.float32) for _ in range(2))
      >>> layer = insert_reference(layer, k, v, jnp.arange(5))  # slots 0..4: page 0, then page 1
      >>> block_tables, lengths = jnp.array([[0, 1]], jnp.int32), jnp.array([5], jnp.int32)
      >>> q = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
      >>> out = cache_decode_attention(q, layer, block_tables, lengths, impl="xla")
      >>> out.shape, bool(jnp.allclose(out, attention_reference(q, layer, block_tables, lengths), atol=1e-5))
      ((1, 2, 16), True)
    """
    kind = layer.spec.kind
    if kind == "turboquant":
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        check_tables(block_tables, lengths, q.shape[0], layer.num_pages, layer.page_size)
        if impl == "auto":
            # Every preset, 3-bit values included, passes tests/kernels/decode_attention/test_turboquant_kernel.py
            # on the H100 (JQUANT_TEST_GPU=1, commit 7f859da), the 3-bit value tile rebuilt without a join.
            fits = triton_turboquant.supports(layer.spec, layer.head_dim)
            impl = dispatch.decode_attention_impl(query_dtype=q.dtype) if fits else "xla"
        if impl == "xla":
            return attention_reference(q, layer, block_tables, lengths).astype(q.dtype)
        return triton_turboquant.turboquant_decode_attention(
            q, layer, block_tables, lengths, config=config, interpret=interpret).astype(q.dtype)
    scales = {} if kind == "dense" else dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
    return decode_attention(q, layer.k_pages, layer.v_pages, block_tables, lengths, impl=impl, config=config,
                            interpret=interpret, **scales)
