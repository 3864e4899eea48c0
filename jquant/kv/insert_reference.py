"""Pure-JAX quantize-and-insert of new tokens at flat slot indices (the kernels' reference twin)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kv import scalar, turboquant
from jquant.kv.paged import PagedKVCache, token_slots, validate_append


def _scatter(arr, slots, new):
    """arr [P, S, ...] gets new [T, ...] at flat slots; out-of-range or negative slots are dropped."""
    p, s = arr.shape[:2]
    flat = arr.reshape(p * s, *arr.shape[2:])
    safe = jnp.where((slots >= 0) & (slots < p * s), slots, p * s)
    return flat.at[safe].set(new.astype(arr.dtype), mode="drop").reshape(arr.shape)


def check_slots(cache: PagedKVCache, k_new, v_new, slots) -> None:
    """Raises unless k_new, v_new are [T, kv_heads, head_dim] and slots [T] integers; concrete slots
    must also lie below the pool's end (negative ones are padding)."""
    if k_new.shape != v_new.shape or k_new.shape[1:] != (cache.kv_heads, cache.head_dim):
        raise ValueError(f"k_new/v_new must be [T, {cache.kv_heads}, {cache.head_dim}]; got {k_new.shape}, "
                         f"{v_new.shape}")
    dtype = slots.dtype if hasattr(slots, "dtype") else np.asarray(slots).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"slots must be integers (flat slot indices), got {dtype}")
    if np.shape(slots) != k_new.shape[:1]:
        raise ValueError(f"slots must be [{k_new.shape[0]}] (one flat slot per new token), got shape "
                         f"{np.shape(slots)}")
    if isinstance(slots, jax.core.Tracer):
        return
    pool = cache.num_pages * cache.page_size
    past = np.flatnonzero(np.asarray(slots) >= pool)
    if past.size:
        raise ValueError(f"slot {int(np.asarray(slots)[past[0]])} (token {int(past[0])}) is past the pool's {pool} "
                         f"slots ({cache.num_pages} pages x {cache.page_size}); negative slots are padding")


def insert_reference(cache: PagedKVCache, k_new, v_new, slots) -> PagedKVCache:
    """Quantize k_new, v_new [T, kv_heads, head_dim] and write token i at flat slot slots[i].

    Negative slots are padding (skipped). A slot past the pool raises when the slots are concrete;
    under jit it is skipped like padding. Per-tensor formats use the cache's static scales.

    Examples:
      Three tokens into slots 0, 1 and 5 of an FP8 cache with a static scale of 0.5; slot -1 is padding:

      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kv import allocate, dequantize_keys, insert_reference
      >>> cache = allocate("fp8", num_pages=2, page_size=4, kv_heads=1, head_dim=16, k_scale=0.5, v_scale=0.5)
      >>> rng = np.random.default_rng(0)
      >>> k, v = (jnp.asarray(rng.standard_normal((4, 1, 16)), jnp.float32) for _ in range(2))
      >>> cache = insert_reference(cache, k, v, jnp.array([0, 1, 5, -1]))
      >>> keys = dequantize_keys(cache, jnp.array([[0, 1]]))[0]  # the 8 slots of pages 0 and 1
      >>> bool(jnp.abs(keys[jnp.array([0, 1, 5])] - k[:3]).max() < 0.1), float(jnp.abs(keys[2]).max())
      (True, 0.0)
    """
    spec, d = cache.spec, cache.head_dim
    check_slots(cache, k_new, v_new, slots)
    slots = jnp.asarray(slots, jnp.int32)
    ks, vs, vm = cache.k_scale, cache.v_scale, cache.v_min
    if spec.kind == "dense":
        kc, vc = k_new, v_new
    elif spec.kind == "per_tensor":
        kc = scalar.encode(k_new, ks, spec.key_format)
        vc = scalar.encode(v_new, vs, spec.value_format)
    elif spec.kind == "per_token_head":
        kts = scalar.token_head_scale(k_new, spec.key_format)
        vts = scalar.token_head_scale(v_new, spec.value_format)
        kc = scalar.encode(k_new, kts[..., None], spec.key_format)
        vc = scalar.encode(v_new, vts[..., None], spec.value_format)
        ks, vs = _scatter(ks, slots, kts), _scatter(vs, slots, vts)
    else:
        if spec.key_format == "lloyd_max":
            kc, norm = turboquant.quantize_keys(k_new, spec.key_bits)
            ks = _scatter(ks, slots, norm)
        else:
            kc = scalar.encode(k_new, 1.0, "fp8_e4m3")
        vc, vsc, vmn = turboquant.quantize_values(v_new, spec.value_bits)
        vs, vm = _scatter(vs, slots, vsc), _scatter(vm, slots, vmn)
    return PagedKVCache(_scatter(cache.k_pages, slots, kc), _scatter(cache.v_pages, slots, vc),
                        ks, vs, vm, spec, d)


def append_reference(cache: PagedKVCache, k_new, v_new, block_tables, lengths, *, validate=True):
    """Append one token per sequence (k_new [B, kv_heads, D]) at position lengths[b].

    Returns (cache, lengths + 1). With concrete inputs the block tables are checked first
    (validate_append), so a bad table raises before anything is written.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kv import allocate, append_reference
      >>> cache = allocate("bf16", num_pages=2, page_size=4, kv_heads=1, head_dim=16)
      >>> block_tables, lengths = jnp.array([[0], [1]], jnp.int32), jnp.array([0, 3], jnp.int32)
      >>> k = v = jnp.ones((2, 1, 16), jnp.float32)  # one new token per sequence
      >>> cache, lengths = append_reference(cache, k, v, block_tables, lengths)
      >>> lengths.tolist()
      [1, 4]
      >>> append_reference(cache, k, v, block_tables, lengths)  # sequence 1 has filled its page
      Traceback (most recent call last):
          ...
      ValueError: sequence 1 would hold 5 tokens, past its 4 slots (1 pages x 4)
    """
    if not np.shape(k_new)[:1] == np.shape(lengths) == np.shape(block_tables)[:1]:
        raise ValueError(f"k_new [B, kv_heads, D], lengths [B] and block_tables [B, max_pages] must agree on B; "
                         f"got {np.shape(k_new)}, {np.shape(lengths)}, {np.shape(block_tables)}")
    if validate and not any(isinstance(x, jax.core.Tracer) for x in (block_tables, lengths)):
        validate_append(block_tables, lengths, 1, cache.num_pages, cache.page_size)
    lengths = jnp.asarray(lengths)
    # Under jit a full sequence or a negative length must not write (a clamped or wrapped slot holds
    # this sequence's own earlier tokens): token_slots gives -1, which insert_reference drops.
    slots = token_slots(jnp.asarray(block_tables), lengths[:, None], cache.page_size)[:, 0]
    return insert_reference(cache, k_new, v_new, slots), lengths + 1
