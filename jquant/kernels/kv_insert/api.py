"""Quantize new K/V tokens and write them into their paged-cache slots: the Pallas kernel on a CUDA
GPU, ``insert_reference`` (XLA quantize + scatter) elsewhere; both write the same bits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jquant.kernels.kv_insert import triton
from jquant.kernels.kv_insert.triton import InsertConfig
from jquant.kv.dtypes import KVCacheSpec
from jquant.kv.insert_reference import check_slots, insert_reference
from jquant.kv.paged import PagedKVCache
from jquant.schemes import dispatch

IMPLS = ("auto", "pallas", "xla")


def _int32_offsets_wrap(pages) -> bool:
    """Whether Pallas' Triton lowering would index these pages wrongly: it uses int32 element
    offsets for arrays of up to 4 GiB, which wrap past 2**31 elements (1-byte codes over 2 GiB)."""
    size = math.prod(pages.shape)
    return size > 2**31 and size * pages.dtype.itemsize <= 2**32


def choose_impl(spec: KVCacheSpec) -> str:
    """"pallas" where the Triton-backend kernels run (``dispatch.runs_triton_pallas``: a CUDA GPU of
    capability 8.0 or more) for the formats the kernel covers (and, for e4m3, capability 8.9 or more:
    Triton casts float32 to e4m3 from sm_89 on); "xla" elsewhere.

    Both paths write the same bits, so a cache's contents never depend on the path: the reference
    divides with ``exact_divide`` (correctly rounded on the GPU too), the kernel with PTX's IEEE
    ``div.rn.f32``. XLA's uncorrected GPU division (``div.full.f32``) differs from the kernel in ~3 of
    10^4 int8 per (token, head) codes, ~9 of 10^4 k8v4 4-bit values and 1 of 4·10^6 fp8 per (token,
    head) codes (H200, bench/results/h200/insert.json).

    Examples:
      >>> import jax
      >>> from jquant.kernels.kv_insert import choose_impl
      >>> from jquant.kv import kv_cache_spec
      >>> choose_impl(kv_cache_spec("turboquant_3bit_nc"))  # Lloyd-Max keys: the reference everywhere
      'xla'
      >>> jax.default_backend() != "cpu" or choose_impl(kv_cache_spec("bf16")) == "xla"  # CPU: XLA
      True
    """
    if not dispatch.runs_triton_pallas() or not triton.covers_format(spec):
        return "xla"
    e4m3 = "fp8_e4m3" in (spec.key_format, spec.value_format)
    return "xla" if e4m3 and dispatch.compute_capability() < dispatch.E4M3_CAST_MIN_CAPABILITY else "pallas"


def insert(cache: PagedKVCache, k_new: jax.Array, v_new: jax.Array, slots: jax.Array, *,
           impl: str = "auto", config: InsertConfig | None = None, interpret: bool = False) -> PagedKVCache:
    """Quantize ``k_new, v_new [T, kv_heads, head_dim]`` and write token i at flat slot ``slots[i]``
    (``page * page_size + offset``); negative slots are padding (nothing written), a slot past the pool
    raises if the slots are concrete and is dropped like padding under jit.

    Same contract and bits as ``jquant.kv.insert_reference``. ``impl``: "pallas" (the kernel),
    "xla" (the reference) or "auto" (``choose_impl``). Formats the kernel does not cover
    (TurboQuant with Lloyd-Max keys: turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc;
    a head_dim that is not a power of two ≥ 16), T = 0 and 1-byte page pools of 2-4 GiB per layer
    run the reference whatever ``impl``.
    ``config``: the kernel's launch (None: ``InsertConfig()``). Donate the cache to the jitted
    caller for the write to happen in place.

    Examples:
      Two tokens into slots 0 and 5 of an INT8 cache; slot -1 is padding. The bits are the reference's:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.kv_insert import insert
      >>> from jquant.kv import allocate, dequantize_keys, insert_reference
      >>> cache = allocate("int8_per_token_head", num_pages=2, page_size=4, kv_heads=1, head_dim=16)
      >>> rng = np.random.default_rng(0)
      >>> k, v = (jnp.asarray(rng.standard_normal((3, 1, 16)), jnp.float32) for _ in range(2))
      >>> slots = jnp.array([0, 5, -1])
      >>> new = insert(cache, k, v, slots)
      >>> leaves = zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(insert_reference(cache, k, v, slots)))
      >>> all(bool(jnp.array_equal(a, b)) for a, b in leaves)
      True
      >>> keys = dequantize_keys(new, jnp.array([[0, 1]]))[0]  # the 8 slots of pages 0 and 1
      >>> bool(jnp.allclose(keys[jnp.array([0, 5])], k[:2], atol=0.02)), int(jnp.count_nonzero(keys.any(-1)))
      (True, 2)
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    d = cache.head_dim
    check_slots(cache, k_new, v_new, slots)
    if impl == "auto":
        impl = choose_impl(cache.spec)
    if (impl == "xla" or k_new.shape[0] == 0 or not triton.covers(cache.spec, d)
            or any(map(_int32_offsets_wrap, (cache.k_pages, cache.v_pages)))):
        return insert_reference(cache, k_new, v_new, slots)
    return triton.insert(cache, k_new, v_new, jnp.asarray(slots, jnp.int32), config=config or InsertConfig(),
                         interpret=interpret)
