"""One layer's paged KV cache: pages [num_pages, page_size, kv_heads, head_dim (or packed bytes)].

Side arrays: per-tensor formats hold float32 scalars; per-(token, head) formats float32
[num_pages, page_size, kv_heads]; TurboQuant holds float16 [num_pages, page_size, kv_heads] key norms,
value scales and value mins (fp16 as vLLM stores them, so the bytes match its presets).
Slot of token t of sequence b = block_tables[b, t // page_size] * page_size + t % page_size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kv import turboquant
from jquant.kv.dtypes import KVCacheSpec, kv_cache_spec, storage_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One layer's pages and side arrays (see the module docstring); a pytree whose ``spec`` and
    ``head_dim`` are static. ``allocate`` makes one.

    Examples:
      >>> import jax
      >>> from jquant.kv import allocate
      >>> cache = allocate("fp8_per_token_head", num_pages=4, page_size=16, kv_heads=2, head_dim=64)
      >>> cache.num_pages, cache.page_size, cache.kv_heads, cache.spec.name
      (4, 16, 2, 'fp8_per_token_head')
      >>> [leaf.shape for leaf in jax.tree_util.tree_leaves(cache)]  # K, V pages; K, V scales; v_min
      [(4, 16, 2, 64), (4, 16, 2, 64), (4, 16, 2), (4, 16, 2), ()]
    """

    k_pages: jax.Array
    v_pages: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    spec: KVCacheSpec = dataclasses.field(metadata=dict(static=True))
    head_dim: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[2]


def _last_dim(fmt: str, bits: int, head_dim: int) -> tuple[int, object]:
    if fmt in ("lloyd_max", "uniform"):
        return head_dim * bits // 8, jnp.uint8
    return head_dim, storage_dtype(fmt)


def allocate(kv_cache_dtype: str | KVCacheSpec, num_pages: int, page_size: int, kv_heads: int,
             head_dim: int, *, k_scale: float = 1.0, v_scale: float = 1.0) -> PagedKVCache:
    """Zeroed cache; k_scale / v_scale are the static per-tensor scales (checkpoint or calibrated).

    Examples:
      >>> from jquant.kv import allocate
      >>> cache = allocate("int8_per_token_head", num_pages=4, page_size=16, kv_heads=2, head_dim=64)
      >>> cache.k_pages.shape, str(cache.k_pages.dtype), cache.k_scale.shape  # a scale per (token, head)
      ((4, 16, 2, 64), 'int8', (4, 16, 2))
      >>> cache = allocate("fp8", num_pages=4, page_size=16, kv_heads=2, head_dim=64, k_scale=0.5)
      >>> str(cache.k_pages.dtype), float(cache.k_scale)  # one static scale per tensor
      ('float8_e4m3fn', 0.5)
    """
    spec = kv_cache_dtype if isinstance(kv_cache_dtype, KVCacheSpec) else kv_cache_spec(kv_cache_dtype)
    if spec.kind == "turboquant":
        turboquant.check_head_dim(head_dim)
    if min(num_pages, page_size, kv_heads, head_dim) <= 0:
        raise ValueError("num_pages, page_size, kv_heads and head_dim must be positive")
    if spec.kind == "per_tensor":   # codes · scale: 0 zeroes the cache, NaN / Inf poison it (vLLM asserts > 0)
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            scale = np.asarray(value, np.float64)
            if scale.size != 1 or not np.isfinite(scale).all() or not (scale > 0).all():
                raise ValueError(f"{name} must be one positive finite float (a per-tensor scale), got {value!r}")
    lead = (num_pages, page_size, kv_heads)
    kd, kdt = _last_dim(spec.key_format, spec.key_bits, head_dim)
    vd, vdt = _last_dim(spec.value_format, spec.value_bits, head_dim)
    # Every leaf its own buffer: a cache donated to a step must not hold one buffer twice.
    ks, vs, vm = jnp.array(k_scale, jnp.float32), jnp.array(v_scale, jnp.float32), jnp.zeros((), jnp.float32)
    if spec.kind == "per_token_head":
        ks, vs = jnp.ones(lead, jnp.float32), jnp.ones(lead, jnp.float32)
    elif spec.kind == "turboquant":
        ks = jnp.zeros(lead, jnp.float16) if spec.key_format == "lloyd_max" else jnp.ones((), jnp.float32)
        vs = jnp.zeros(lead, jnp.float16)
        vm = jnp.zeros(lead, jnp.float16)
    elif spec.kind == "dense":
        ks, vs = jnp.ones((), jnp.float32), jnp.ones((), jnp.float32)
    return PagedKVCache(jnp.zeros((*lead, kd), kdt), jnp.zeros((*lead, vd), vdt), ks, vs, vm,
                        spec, head_dim)


def slots_for(block_tables, seq_ids, positions, page_size: int):
    """Flat slot index of token `positions[i]` of sequence `seq_ids[i]`.

    Examples:
      Pages of 4 tokens; sequence 0 owns pages 2 then 0, sequence 1 pages 1 then 3:

      >>> import jax.numpy as jnp
      >>> from jquant.kv import slots_for
      >>> block_tables = jnp.array([[2, 0], [1, 3]], jnp.int32)
      >>> slots_for(block_tables, jnp.array([0, 1]), jnp.array([5, 2]), 4).tolist()  # page 0 slot 1, page 1 slot 2
      [1, 6]
    """
    page = block_tables[seq_ids, positions // page_size]
    return page * page_size + positions % page_size


def token_slots(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat slots ``[B, T]`` of tokens at ``positions [B, T]`` (traceable), -1 (not written) for a position
    outside a sequence's pages: past its last page, or negative (a negative length), so no lookup is
    clamped or wrapped into a page that holds other tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kv import token_slots
      >>> block_tables = jnp.array([[2, 0]], jnp.int32)   # pages of 4: sequence 0 owns pages 2 then 0
      >>> token_slots(block_tables, jnp.array([[5, 8, -1]]), 4).tolist()   # page 0 slot 1; past; negative
      [[1, -1, -1]]
    """
    max_pages = block_tables.shape[1]
    page_idx = positions // page_size
    page = jnp.take_along_axis(block_tables, jnp.clip(page_idx, 0, max_pages - 1), axis=1)
    inside = (positions >= 0) & (page_idx < max_pages)
    return jnp.where(inside, page * page_size + positions % page_size, -1)


def validate_append(block_tables, lengths, num_new, num_pages: int, page_size: int) -> None:
    """Eager check before appending num_new[b] tokens to each sequence b (concrete arrays).

    Raises ValueError if a sequence would write past its pages, a used block-table entry points
    outside the pool, or two sequences own the same page.

    Examples:
      >>> import numpy as np
      >>> from jquant.kv import validate_append
      >>> validate_append(np.array([[0, 1]]), np.array([7]), 1, num_pages=2, page_size=4)  # fits: no error
      >>> validate_append(np.array([[0, 1]]), np.array([8]), 1, num_pages=2, page_size=4)
      Traceback (most recent call last):
          ...
      ValueError: sequence 0 would hold 9 tokens, past its 8 slots (2 pages x 4)
      >>> validate_append(np.array([[0, 1], [1, 2]]), np.array([5, 0]), 1, num_pages=4, page_size=4)
      Traceback (most recent call last):
          ...
      ValueError: page 1 is owned by sequences 0 and 1
    """
    bt = np.asarray(block_tables)
    ln = np.asarray(lengths).astype(np.int64)
    nn = np.broadcast_to(np.asarray(num_new), ln.shape).astype(np.int64)
    if bt.ndim != 2 or ln.shape != (bt.shape[0],):
        raise ValueError(f"block_tables must be [batch, max_pages] and lengths [batch]; got "
                         f"{bt.shape}, {ln.shape}")
    if (ln < 0).any() or (nn < 0).any():
        b = int(np.argmax((ln < 0) | (nn < 0)))
        raise ValueError(f"lengths and new token counts must be non-negative; sequence {b} has length {ln[b]} "
                         f"and {nn[b]} new tokens")
    end = ln + nn
    cap = bt.shape[1] * page_size
    if (end > cap).any():
        b = int(np.argmax(end > cap))
        raise ValueError(f"sequence {b} would hold {end[b]} tokens, past its {cap} slots "
                         f"({bt.shape[1]} pages x {page_size})")
    used = np.arange(bt.shape[1])[None, :] < -(-end // page_size)[:, None]   # [B, max_pages]: pages in use
    outside = used & ((bt < 0) | (bt >= num_pages))
    if outside.any():
        b, j = (int(i) for i in np.argwhere(outside)[0])
        raise ValueError(f"block table of sequence {b} points at page {bt[b, j]}, outside the "
                         f"pool of {num_pages} pages")
    seqs, pages = np.nonzero(used)
    order = np.lexsort((seqs, bt[seqs, pages]))   # by page, then sequence
    page_sorted, seq_sorted = bt[seqs, pages][order], seqs[order]
    shared = (page_sorted[1:] == page_sorted[:-1]) & (seq_sorted[1:] != seq_sorted[:-1])
    if shared.any():
        i = int(np.argmax(shared))
        raise ValueError(f"page {page_sorted[i]} is owned by sequences {seq_sorted[i]} and {seq_sorted[i + 1]}")
