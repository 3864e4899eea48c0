"""A model's paged KV cache: one ``PagedKVCache`` per layer, shared block tables and lengths.

Every layer of a sequence uses the same pages (vLLM's layout: one block table per sequence, one pool
per layer), so a token's slot is computed once per step. Layers may differ in format: TurboQuant keeps
the first and last ``TURBOQUANT_BOUNDARY_LAYERS`` layers in bf16, as vLLM adds them to
``kv_cache_dtype_skip_layers`` by default (its boundary protection).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kv.dtypes import KVCacheSpec, kv_cache_spec
from jquant.kv.paged import PagedKVCache, allocate

TURBOQUANT_BOUNDARY_LAYERS = 2


def default_skip_layers(kv_cache_dtype: str, num_layers: int) -> tuple[int, ...]:
    """Layers kept in bf16: for TurboQuant the first and last two (vLLM's default), else none. Like
    vLLM's ``get_boundary_skip_layers``, at most half the layers on each side: n = min(2, layers // 2),
    so 3 layers keep the middle one quantized and 1 layer skips none.

    Examples:
      >>> from jquant.kv import default_skip_layers
      >>> default_skip_layers("turboquant_4bit_nc", 6), default_skip_layers("fp8", 6)
      ((0, 1, 4, 5), ())
      >>> default_skip_layers("turboquant_4bit_nc", 3), default_skip_layers("turboquant_4bit_nc", 1)
      ((0, 2), ())
    """
    if kv_cache_spec(kv_cache_dtype).kind != "turboquant":
        return ()
    n = min(TURBOQUANT_BOUNDARY_LAYERS, num_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(num_layers - n, num_layers))))


def token_bytes(kv_cache_dtype: str, *, num_layers: int, kv_heads: int, head_dim: int) -> int:
    """K + V bytes one cached token costs over every layer and KV head of a ``PagedCache`` of this
    dtype (the bf16 boundary layers of ``default_skip_layers`` included; per-tensor scalars excluded)."""
    name = kv_cache_spec(kv_cache_dtype).name
    skip = default_skip_layers(name, num_layers)
    return kv_heads * sum(kv_cache_spec("bf16" if i in skip else name).bytes_per_token_per_head(head_dim)
                          for i in range(num_layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """``layers[i]``: layer i's pages; ``block_tables [batch, max_pages]`` int32 (page ids in the pool);
    ``lengths [batch]`` int32: tokens cached per sequence (the next token's position).

    Examples:
      Two sequences of up to 20 tokens in pages of 16: two pages each. TurboQuant keeps the first and
      last two layers in bf16:

      >>> from jquant.kv import PagedCache
      >>> cache = PagedCache.allocate("turboquant_4bit_nc", num_layers=5, batch=2, max_len=20, kv_heads=1,
      ...                             head_dim=64, page_size=16)
      >>> cache.kv_cache_dtypes
      ('bf16', 'bf16', 'turboquant_4bit_nc', 'bf16', 'bf16')
      >>> cache.block_tables.tolist(), cache.lengths.tolist(), cache.capacity
      ([[0, 1], [2, 3]], [0, 0], 32)
    """

    layers: tuple[PagedKVCache, ...]
    block_tables: jax.Array
    lengths: jax.Array

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    @property
    def page_size(self) -> int:
        return self.layers[0].page_size

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: ``max_pages * page_size``."""
        return self.block_tables.shape[1] * self.page_size

    @property
    def kv_cache_dtypes(self) -> tuple[str, ...]:
        return tuple(layer.spec.name for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes the cache allocates on the device (pages, side arrays, tables)."""
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(self))

    @classmethod
    def allocate(cls, kv_cache_dtype: str | KVCacheSpec, *, num_layers: int, batch: int, max_len: int,
                 kv_heads: int, head_dim: int, page_size: int = 16,
                 skip_layers: Sequence[int] | None = None, k_scales: Sequence[float] | None = None,
                 v_scales: Sequence[float] | None = None) -> PagedCache:
        """Zeroed cache for ``batch`` sequences of up to ``max_len`` tokens each.

        Sequence b owns pages ``[b * pages_per_seq, (b + 1) * pages_per_seq)``, so the pool holds
        exactly what the batch can use. ``skip_layers`` (default ``default_skip_layers``) stay bf16.
        ``k_scales``/``v_scales``: one static per-tensor scale per layer (a checkpoint's ``k_scale``
        / ``v_scale``, or ``calibrate_kv_scales``) for the per-tensor FP8 formats; default 1.0.
        """
        spec = kv_cache_dtype if isinstance(kv_cache_dtype, KVCacheSpec) else kv_cache_spec(kv_cache_dtype)
        if min(num_layers, batch, max_len, page_size) <= 0:
            raise ValueError(f"num_layers, batch, max_len and page_size must be positive; got "
                             f"{num_layers}, {batch}, {max_len}, {page_size}")
        if head_dim % 16:   # the decode-attention kernel's dot tiles: refused here, not at the first decode step
            raise ValueError(f"head_dim must be a multiple of 16 for a model's paged cache, got {head_dim}")
        skip = default_skip_layers(spec.name, num_layers) if skip_layers is None else tuple(skip_layers)
        bad = [i for i in skip if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"skip_layers {bad} lie outside the model's {num_layers} layers")
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is not None and len(scales) != num_layers:
                raise ValueError(f"{name} needs one scale per layer ({num_layers}), got {len(scales)}")
        pages_per_seq = -(-max_len // page_size)
        layers = tuple(
            allocate(kv_cache_spec("bf16") if i in skip else spec, batch * pages_per_seq, page_size,
                     kv_heads, head_dim, k_scale=1.0 if k_scales is None else float(k_scales[i]),
                     v_scale=1.0 if v_scales is None else float(v_scales[i]))
            for i in range(num_layers))
        tables = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)
        return cls(layers, tables, jnp.zeros((batch,), jnp.int32))
