"""Decode attention over a paged, possibly quantized KV cache: one query token per sequence.

Cache layout (jquant/kv): pages ``[num_pages, page_size, kv_heads, head_dim]`` (bf16, or
fp8_e4m3 / int8 codes), scales per (token, head) ``[num_pages, page_size, kv_heads]`` float32 or
one float32 scalar per tensor, block tables ``[batch, max_pages]`` int32, lengths ``[batch]``
int32; token t of sequence b sits in slot ``block_tables[b, t // page_size] * page_size +
t % page_size``; dequantized value = code * scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kernels.decode_attention.config import TuningConfig
from jquant.schemes import dispatch

IMPLS = ("auto", "pallas", "xla")
_CODE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2,
                jnp.int8)


def choose_impl(q, k_pages) -> str:
    """"pallas" on a CUDA GPU of capability 8.0 or more for a 16-bit ``q``, "xla" elsewhere (CPU: the
    kernel would run interpreted; float32 ``q``: its 16-bit operands would round the query); the
    policy is ``jquant.schemes.dispatch.decode_attention_impl``'s.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.kernels.decode_attention import choose_impl
      >>> q, k_pages = jnp.zeros((1, 2, 16)), jnp.zeros((2, 4, 1, 16))
      >>> choose_impl(q, k_pages) in ("pallas", "xla")
      True
      >>> jax.default_backend() != "cpu" or choose_impl(q, k_pages) == "xla"  # CPU: XLA
      True
    """
    del k_pages
    return dispatch.decode_attention_impl(query_dtype=q.dtype)


def _check(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [B, Hq, D] and pages [P, S, Hkv, D]; got {q.shape}, "
                         f"{k_pages.shape}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages differ: {k_pages.shape} {k_pages.dtype} vs "
                         f"{v_pages.shape} {v_pages.dtype}")
    batch, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and pages ({dk}) differ")
    if d % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {d}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k_pages.dtype not in _CODE_DTYPES:
        raise ValueError(f"unsupported page dtype {k_pages.dtype} (packed TurboQuant pages "
                         "take their own kernel)")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale or neither")
    if k_scale is not None:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if jnp.ndim(s) not in (0,) and jnp.shape(s) != (num_pages, page_size, hkv):
                raise ValueError(f"{name} must be a scalar or [{num_pages}, {page_size}, {hkv}], "
                                 f"got {jnp.shape(s)}")
        if jnp.ndim(k_scale) != jnp.ndim(v_scale):
            raise ValueError("k_scale and v_scale must both be per-tensor or both per-(token, head)")
    elif k_pages.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8):
        raise ValueError(f"{k_pages.dtype} pages need k_scale and v_scale")
    check_tables(block_tables, lengths, batch, num_pages, page_size)


def check_tables(block_tables, lengths, batch: int, num_pages: int, page_size: int) -> None:
    """Block tables ``[batch, max_pages]`` and lengths ``[batch]`` of a paged cache of ``num_pages``
    pages: shapes always, values where they are concrete."""
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_pages], got {block_tables.shape}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [{batch}], got {lengths.shape}")
    # Values are checked only where they are concrete (outside jit): inside jit the kernel
    # clamps page indices into the pool, so a bad table reads a wrong page, never outside memory.
    if not isinstance(block_tables, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer):
        bt, ln = np.asarray(block_tables), np.asarray(lengths)
        if (ln < 0).any() or (ln > block_tables.shape[1] * page_size).any():
            raise ValueError(f"lengths must lie in [0, {block_tables.shape[1] * page_size}], got "
                             f"{ln.min()}..{ln.max()}")
        used = np.arange(bt.shape[1])[None, :] < -(-ln[:, None] // page_size)
        if ((bt < 0) | (bt >= num_pages))[used].any():
            raise ValueError(f"block_tables point outside the pool of {num_pages} pages")


def decode_attention(q, k_pages, v_pages, block_tables, lengths, *, k_scale=None, v_scale=None,
                     scale: float | None = None, impl: str = "auto",
                     config: TuningConfig | None = None, interpret: bool = False):
    """Attention of one query token per sequence over its cached context.

    q: ``[B, Hq, D]``; Hq a multiple of the pages' KV heads (GQA). Sequences of length 0 give
    zeros. ``scale`` defaults to 1/sqrt(D). Returns ``[B, Hq, D]`` in q's dtype.

    Examples:
      Two sequences over a pool of 3 pages of 4 tokens: sequence 0 has 6 tokens in pages 2 then 0,
      sequence 1 has 3 in page 1; 2 query heads share the one KV head (GQA). The result is the
      softmax attention over each sequence's tokens, gathered in order:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.decode_attention import decode_attention
      >>> rng = np.random.default_rng(0)
      >>> k_pages, v_pages = (jnp.asarray(rng.standard_normal((3, 4, 1, 16)), jnp.float32) for _ in range(2))
      >>> block_tables = jnp.array([[2, 0], [1, 0]], jnp.int32)
      >>> lengths = jnp.array([6, 3], jnp.int32)
      >>> q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)  # [B, Hq, D]
      >>> out = decode_attention(q, k_pages, v_pages, block_tables, lengths, impl="xla")
      >>> out.shape, str(out.dtype)
      ((2, 2, 16), 'float32')
      >>> def attend(b):  # the tokens of sequence b, in order
      ...     k = k_pages[block_tables[b]].reshape(-1, 16)[:lengths[b]]
      ...     v = v_pages[block_tables[b]].reshape(-1, 16)[:lengths[b]]
      ...     return jax.nn.softmax(q[b] @ k.T / 4.0, axis=-1) @ v  # scale 1/sqrt(16)
      >>> bool(jnp.allclose(out[0], attend(0), atol=1e-5)), bool(jnp.allclose(out[1], attend(1), atol=1e-5))
      (True, True)
      >>> empty = decode_attention(q, k_pages, v_pages, block_tables, jnp.array([6, 0], jnp.int32))
      >>> float(jnp.abs(empty[1]).max())  # a sequence of length 0 gives zeros
      0.0
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if impl == "auto":
        impl = choose_impl(q, k_pages)
    out_scale = None
    if k_scale is not None and jnp.ndim(k_scale) == 0:
        # Per-tensor: the K scale multiplies every logit and the V scale the output.
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
        out_scale, k_scale, v_scale = v_scale, None, None
    if impl == "xla":
        from jquant.kernels.decode_attention.xla import decode_attention_xla
        out = decode_attention_xla(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale,
                                   sm_scale=sm_scale)
    else:
        from jquant.kernels.decode_attention import triton as kernel
        o, m, l = kernel.partials(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale,
                                  sm_scale=sm_scale, config=config, interpret=interpret)
        out = kernel.combine(o, m, l).reshape(q.shape)
    if out_scale is not None:
        out = out * out_scale
    return out.astype(q.dtype)
