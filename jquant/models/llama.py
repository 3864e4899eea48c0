"""A Llama decoder in Flax linen: embed, RMSNorm, RoPE, GQA attention, SwiGLU, tied lm_head, KV cache.

Parameter layout (the one ``gguf_loader.load_gguf`` produces; kernels are Flax ``[in, out]``)::

    embed_tokens/embedding              [vocab, hidden]
    layers_{i}/input_norm/scale         [hidden]
    layers_{i}/{q,k,v,o}_proj/kernel    nn.Dense, use_bias=False
    layers_{i}/post_attention_norm/scale
    layers_{i}/{gate,up,down}_proj/kernel
    final_norm/scale
    lm_head/kernel                      only when the embeddings are not tied

With ``fused_projections=True`` each layer holds ``qkv_proj`` (q, k, v kernels side by side along the
output axis) and ``gate_up_proj`` (gate, then up) instead, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: one GEMM where there were three and two, which is what makes a
small-batch decode step fast (``jquant.models.fused.fuse_projections`` converts the parameters).

The projections sit directly under ``layers_{i}`` so that a parameter-path rule such as
``.*layers_\\d+/(q|k|v|o)_proj/kernel`` picks them out, and they are built by ``dense_cls`` (default
``nn.Dense``) so a quantized Dense with the same constructor arguments can replace them.

q/k rows are in Hugging Face order (each head's first half of dimensions, then its second half) and RoPE
is ``rotate_half``; ``gguf_loader`` un-permutes GGUF's adjacent-pair layout into this order.
``apply_rope_adjacent_pairs`` is GGML's form, kept to test that the two agree.

Parameters are float32; ``dtype`` picks the compute dtype (float32 or bfloat16). Norms, RoPE and softmax
run in float32 whatever the compute dtype; logits come back as float32. Everything is shape-static.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jquant.flax.linen import intercept_quantized
from jquant.kv.cache import PagedCache
from jquant.kv.dtypes import kv_cache_spec
from jquant.kv.paged import PagedKVCache
from jquant.models.paged_attention import paged_attention


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama: sizes, heads (``num_kv_heads`` < ``num_heads`` is grouped-query attention),
    RoPE base, RMSNorm epsilon, context length, and whether the lm_head is the embedding.

    Examples:
      >>> from jquant.models import LlamaConfig
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> config.num_heads // config.num_kv_heads  # query heads per KV head
      2

      The same config from a GGUF file's ``llama.*`` metadata:

      >>> metadata = {"general.architecture": "llama", "llama.vocab_size": 32, "llama.embedding_length": 64,
      ...             "llama.feed_forward_length": 128, "llama.block_count": 1, "llama.attention.head_count": 2,
      ...             "llama.attention.head_count_kv": 1, "llama.attention.layer_norm_rms_epsilon": 1e-5,
      ...             "llama.context_length": 64}
      >>> LlamaConfig.from_gguf_metadata(metadata) == config
      True
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, tie_word_embeddings: bool = True) -> LlamaConfig:
        """The config a GGUF file's key/values describe (``metadata``: key -> decoded value)."""
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

        def get(name, default=None):
            value = metadata.get(f"llama.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks llama.{name}")
            return value

        scaling = metadata.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(f"RoPE scaling {scaling!r} (llama.rope.scaling.type) is not supported")
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(metadata.get("llama.attention.key_length", hidden // heads))
        rope_dims = int(metadata.get("llama.rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ValueError(f"partial RoPE (llama.rope.dimension_count={rope_dims}, head_dim={head_dim}) "
                             "is not supported")
        vocab = metadata.get("llama.vocab_size")
        if vocab is None:  # older files: the vocabulary's length is the embedding's row count
            vocab = len(metadata.get("tokenizer.ggml.tokens") or ())
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=tie_word_embeddings,
        )

    def to_hf_config(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The Hugging Face ``config.json`` entries of a ``LlamaForCausalLM`` of this shape (what a
        checkpoint directory needs beside its tensors for transformers' and vLLM's loaders).

        Examples:
          >>> from jquant.models import LlamaConfig
          >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
          ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
          ...                      max_position_embeddings=64)
          >>> hf = config.to_hf_config()
          >>> hf["architectures"], hf["num_key_value_heads"], hf["tie_word_embeddings"]
          (['LlamaForCausalLM'], 1, True)
        """
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
                "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": torch_dtype}


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for ``max_len`` positions, of which the first ``length`` are filled.

    Writing past ``max_len`` is not checked inside jit (``dynamic_update_slice`` clamps the start), so
    size it for prompt + new tokens, as ``generate`` does.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import KVCache, LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> cache = KVCache.zeros(config, batch=1, max_len=8)
      >>> len(cache.keys), cache.keys[0].shape, int(cache.length), cache.max_len
      (1, (1, 1, 8, 32), 0, 8)

      A prefill and one decode step give the logits a full forward gives:

      >>> model = LlamaForCausalLM(config)
      >>> ids = jnp.array([[1, 5, 7, 2]], jnp.int32)
      >>> params = model.init(jax.random.key(0), ids)
      >>> step = jax.jit(model.apply)
      >>> _, cache = step(params, ids[:, :3], cache)
      >>> last, cache = step(params, ids[:, 3:], cache)
      >>> int(cache.length)
      4
      >>> full, _ = model.apply(params, ids)
      >>> bool(jnp.allclose(last[:, 0], full[:, 3], atol=1e-4))
      True
    """

    # Heads before positions, the layout attention reads. Stored [batch, max_len, heads, head_dim], a
    # decode step called with the cache (not inside a loop, where XLA picks the carried layout) copied
    # every layer's K and V transposed (seen in the CPU compile; on the H100 the bf16 step at B = 16,
    # ctx 8k took 11971 µs called per step against 3602 inside generate's loop).
    keys: tuple[jax.Array, ...]    # per layer [batch, num_kv_heads, max_len, head_dim], RoPE applied
    values: tuple[jax.Array, ...]  # per layer [batch, num_kv_heads, max_len, head_dim]
    length: jax.Array              # int32 scalar

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def zeros(cls, config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        # Distinct buffers for keys and values, so the cache can be donated to a step.
        return cls(keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   length=jnp.zeros((), jnp.int32))


# ---- pure functions ------------------------------------------------------------------------------


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """``positions[..., None] * inv_freq``: [..., head_dim // 2] float32 angles."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """RoPE on ``x`` [batch, seq, heads, head_dim] (HF ``rotate_half``: dim i pairs with i + head_dim/2)."""
    angles = rope_angles(positions, x.shape[-1], theta)[..., None, :]  # [batch|1, seq, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def apply_rope_adjacent_pairs(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """GGML's "normal" RoPE: dims (2i, 2i+1) rotate together. Equals ``apply_rope`` on un-permuted rows."""
    angles = rope_angles(positions, x.shape[-1], theta)[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def causal_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """[queries, keys] bool: a query sees keys at its own position or earlier (cache slots past the
    filled length hold later positions, so this also hides them)."""
    return key_positions[None, :] <= query_positions[:, None]


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention; query head ``h`` reads KV head ``h // (heads // kv_heads)`` (HF ``repeat_kv``).

    q [batch, T, heads, D]; k, v [batch, kv_heads, S, D] (the dense cache's layout); mask [T, S] bool (or
    [batch, 1, 1, T, S]: one per sequence). Returns [batch, T, heads, D].
    """
    batch, t, heads, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Heads-major out, as the probabilities and values are: written "btkgd", XLA's CPU compile made v the
    # dot's left operand, which its bf16 dots with a float32 result do not run.
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, t, heads, d).astype(q.dtype)


# ---- modules -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale).astype(self.dtype)


class DecoderLayer(nn.Module):
    config: LlamaConfig
    dtype: Any = jnp.float32
    dense_cls: Callable[..., nn.Module] = nn.Dense
    fused_projections: bool = False

    @nn.compact
    def __call__(self, x, positions, mask, kv, write_index):
        """``kv``: None (no cache), ``(keys, values)`` of a dense ``KVCache`` written at ``write_index``, or
        ``(PagedKVCache, block_tables, lengths)`` of a ``PagedCache`` (``mask`` unused: positions decide)."""
        c = self.config
        batch, t, _ = x.shape
        dense = functools.partial(self.dense_cls, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)

        h = RMSNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x)
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.fused_projections:
            q, k, v = jnp.split(dense(nq + 2 * nkv, name="qkv_proj")(h), [nq, nq + nkv], axis=-1)
        else:
            q, k, v = dense(nq, name="q_proj")(h), dense(nkv, name="k_proj")(h), dense(nkv, name="v_proj")(h)
        q = q.reshape(batch, t, c.num_heads, c.head_dim)
        k = k.reshape(batch, t, c.num_kv_heads, c.head_dim)
        v = v.reshape(batch, t, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta)
        if kv is not None and isinstance(kv[0], PagedKVCache):
            attended, layer = paged_attention(q, k, v, kv[0], kv[1], kv[2], positions, grouped_query_attention)
            kv = (layer,)
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_heads, T, head_dim]
            if kv is not None:  # write this step's keys/values into the cache, then attend over all of it
                start = (0, 0, write_index, 0)
                k = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), start)
                v = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), start)
                if k.dtype != self.dtype:
                    # Else XLA fuses the update into both the new cache and the converted copy attention
                    # reads, and each then needs the old cache: the in-place write becomes a copy of
                    # the cache per layer (CPU compile, a float32 model on a bf16 cache).
                    k, v = jax.lax.optimization_barrier((k, v))
                kv = (k, v)
            attended = grouped_query_attention(q, k.astype(self.dtype), v.astype(self.dtype), mask)
        x = x + dense(c.hidden_size, name="o_proj")(attended.reshape(batch, t, c.num_heads * c.head_dim))

        h = RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_norm")(x)
        if self.fused_projections:
            gate, up = jnp.split(dense(2 * c.intermediate_size, name="gate_up_proj")(h), 2, axis=-1)
        else:
            gate, up = dense(c.intermediate_size, name="gate_proj")(h), dense(c.intermediate_size, name="up_proj")(h)
        x = x + dense(c.hidden_size, name="down_proj")(nn.silu(gate) * up)
        return x, kv


class LlamaForCausalLM(nn.Module):
    """``apply(params, token_ids[, cache]) -> (logits [batch, T, vocab] float32, cache or None)``.

    Without a cache: a full causal forward over positions 0..T-1. With a dense ``KVCache``: the tokens sit
    at positions ``cache.length ..`` (prefill when the cache is empty, a decode step for T == 1), their
    keys/values are written into it, and the returned cache has ``length + T`` filled. With a
    ``jquant.kv.PagedCache``: sequence b continues at ``cache.lengths[b]``, its new keys/values are
    quantized into its pages in the cache's ``kv_cache_dtype``, and T == 1 runs the paged
    decode-attention kernel. ``fused_projections``: the layers hold ``qkv_proj`` / ``gate_up_proj`` (see the
    module docstring).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jnp.array([[1, 5, 7, 2]], jnp.int32)
      >>> params = model.init(jax.random.key(0), ids)
      >>> sorted(params["params"]["layers_0"])
      ['down_proj', 'gate_proj', 'input_norm', 'k_proj', 'o_proj', 'post_attention_norm', 'q_proj', 'up_proj', 'v_proj']
      >>> params["params"]["layers_0"]["k_proj"]["kernel"].shape  # Flax [in, out]
      (64, 32)
      >>> logits, cache = model.apply(params, ids)
      >>> logits.shape, str(logits.dtype), cache
      ((1, 4, 32), 'float32', None)
    """

    config: LlamaConfig
    dtype: Any = jnp.float32
    dense_cls: Callable[..., nn.Module] = nn.Dense
    fused_projections: bool = False

    @nn.compact
    def __call__(self, token_ids: jax.Array, cache: KVCache | PagedCache | None = None):
        c = self.config
        t = token_ids.shape[1]
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                         name="embed_tokens")
        x = embed(token_ids)
        paged = isinstance(cache, PagedCache)
        if paged:  # each sequence continues at its own length
            if len(cache.layers) != c.num_layers:
                raise ValueError(f"the paged cache has {len(cache.layers)} layers, the model {c.num_layers}")
            layer = cache.layers[0]
            if (layer.kv_heads, layer.head_dim) != (c.num_kv_heads, c.head_dim):
                raise ValueError(f"the paged cache holds {layer.kv_heads} KV heads of {layer.head_dim}; the model "
                                 f"has {c.num_kv_heads} of {c.head_dim}")
            if token_ids.shape[0] != cache.batch:
                raise ValueError(f"token_ids has batch {token_ids.shape[0]} but the paged cache holds "
                                 f"{cache.batch} sequences")
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
            mask = write_index = None
        elif cache is None:
            positions = jnp.arange(t, dtype=jnp.int32)[None]
            mask, write_index = causal_mask(positions[0], positions[0]), None
        else:
            check_room(cache, t)
            positions = cache.length + jnp.arange(t, dtype=jnp.int32)[None]
            mask = causal_mask(positions[0], jnp.arange(cache.max_len, dtype=jnp.int32))
            write_index = cache.length

        new_layers = []
        for i in range(c.num_layers):
            if paged:
                layer_kv = (cache.layers[i], cache.block_tables, cache.lengths)
            else:
                layer_kv = None if cache is None else (cache.keys[i], cache.values[i])
            x, layer_kv = DecoderLayer(c, self.dtype, self.dense_cls, self.fused_projections, name=f"layers_{i}")(
                x, positions, mask, layer_kv, write_index)
            new_layers.append(layer_kv)

        x = RMSNorm(c.rms_norm_eps, self.dtype, name="final_norm")(x)
        if c.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = self.dense_cls(c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                                    name="lm_head")(x)
        if paged:
            new_cache = PagedCache(tuple(kv[0] for kv in new_layers), cache.block_tables, cache.lengths + t)
        elif cache is not None:
            new_cache = KVCache(tuple(kv[0] for kv in new_layers), tuple(kv[1] for kv in new_layers),
                                cache.length + t)
            # Under jit nothing can raise: XLA clamps the write into the cache's last slots, so an
            # overflowing step's logits are NaN rather than a plausible answer (as the paged cache's).
            logits = jnp.where((cache.length < 0) | (cache.length + t > cache.max_len), jnp.nan, logits)
        else:
            new_cache = None
        return logits.astype(jnp.float32), new_cache


# ---- generation ----------------------------------------------------------------------------------


def new_cache(model: LlamaForCausalLM, batch: int, max_len: int, kv_cache_dtype: str | None = None,
              page_size: int = 16, **paged_options) -> KVCache | PagedCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens: the dense ``KVCache`` in the
    model's dtype when ``kv_cache_dtype`` is None, else a ``PagedCache`` of that vLLM ``kv_cache_dtype``
    (``paged_options``: ``skip_layers``, ``k_scales``, ``v_scales`` of ``PagedCache.allocate``)."""
    c = model.config
    if kv_cache_dtype is None:
        return KVCache.zeros(c, batch, max_len, model.dtype)
    return PagedCache.allocate(kv_cache_dtype, num_layers=c.num_layers, batch=batch, max_len=max_len,
                               kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=page_size,
                               **paged_options)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "greedy", "eos_id", "kv_cache_dtype",
                                             "page_size", "forward", "scales"))
def _generate(model, params, prompt_ids, rng, temperature, max_new_tokens, greedy, eos_id, kv_cache_dtype,
              page_size, forward, scales):
    batch, prompt_len = prompt_ids.shape
    cache = new_cache(model, batch, prompt_len + max_new_tokens, kv_cache_dtype, page_size, **dict(scales))
    apply = model.apply if forward is None else forward

    def pick(logits, key):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    keys = jax.random.split(rng, max_new_tokens)
    logits, cache = apply(params, prompt_ids, cache)
    first = pick(logits[:, -1], keys[0])
    done = jnp.zeros((batch,), bool) if eos_id is None else first == eos_id

    def step(carry, key):
        token, cache, done = carry
        logits, cache = apply(params, token[:, None], cache)
        nxt = pick(logits[:, -1], key)
        if eos_id is not None:  # a finished row keeps emitting eos; shapes stay static
            nxt = jnp.where(done, eos_id, nxt)
            done = done | (nxt == eos_id)
        return (nxt, cache, done), nxt

    _, rest = jax.lax.scan(step, (first, cache, done), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(model: LlamaForCausalLM, params, prompt_ids, max_new_tokens: int, greedy: bool = True, *,
             rng: jax.Array | None = None, temperature: float = 1.0, eos_id: int | None = None,
             kv_cache_dtype: str | None = None, page_size: int = 16, forward: Callable | None = None,
             k_scales: Sequence[float] | None = None, v_scales: Sequence[float] | None = None) -> jax.Array:
    """``max_new_tokens`` tokens after ``prompt_ids`` [batch, P] (equal-length prompts, no padding):
    one prefill through the KV cache, then one decode step per token inside ``lax.scan``.
    Greedy takes the argmax; otherwise tokens are sampled at ``temperature`` from ``rng`` (0 is greedy,
    as in vLLM; negative, NaN or infinite temperatures raise).
    ``kv_cache_dtype`` (a vLLM name: ``bf16``, ``fp8``, ``int8_per_token_head``, ``turboquant_3bit_nc``,
    ...) stores the cache paged in that format, ``page_size`` tokens a page; None keeps a dense cache in
    the model's dtype; ``k_scales`` / ``v_scales``: its static per-tensor scales, one per layer (a
    checkpoint's: ``jquant.checkpoint.kv_cache_settings(...).cache_options()``; default 1.0).
    Returns int32 [batch, max_new_tokens]; after ``eos_id`` a row repeats ``eos_id``.
    ``forward(params, token_ids, cache) -> (logits, cache)`` runs each step in place of ``model.apply``
    (hashable: ``jquant.parallel.generate`` passes its tensor-parallel ``TensorParallel.apply``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM, generate
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jnp.array([[1, 5, 7, 2]], jnp.int32)
      >>> params = model.init(jax.random.key(0), ids)
      >>> tokens = generate(model, params, ids, max_new_tokens=3)
      >>> tokens.shape, str(tokens.dtype)
      ((1, 3), 'int32')
      >>> full, _ = model.apply(params, ids)
      >>> int(tokens[0, 0]) == int(full[0, -1].argmax())  # greedy: the most likely next token
      True
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2:
        raise ValueError(f"prompt_ids must be [batch, length], got shape {prompt_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_ids.shape[1] + max_new_tokens > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context length {model.config.max_position_embeddings}")
    if not greedy and rng is None:
        raise ValueError("sampling (greedy=False) needs an rng key")
    if not greedy and not isinstance(temperature, jax.core.Tracer):
        t = float(temperature)
        if not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        # vLLM's convention: temperature 0 is greedy (logits / 0 sampled token 0 everywhere).
        greedy = t == 0
    if kv_cache_dtype is not None:
        kv_cache_spec(kv_cache_dtype)  # an unknown name fails here, before tracing
    scales = tuple((name, tuple(float(v) for v in value)) for name, value in
                   (("k_scales", k_scales), ("v_scales", v_scales)) if value is not None)
    if scales and kv_cache_dtype is None:
        raise ValueError("k_scales / v_scales are a paged cache's static scales: pass a kv_cache_dtype too")
    rng = jax.random.key(0) if rng is None else rng
    return _generate(model, params, prompt_ids, rng, jnp.float32(temperature), max_new_tokens, greedy, eos_id,
                     kv_cache_dtype, page_size, forward, scales)


def check_room(cache: PagedCache | KVCache, new_tokens: int) -> None:
    """Raises ``ValueError`` if ``new_tokens`` more tokens do not fit a sequence of ``cache`` (or its
    length is negative). Reads the lengths, so it waits for the step that wrote them; a no-op on traced
    lengths (under jit, where an overflowing sequence's logits come out NaN instead).

    Examples:
      >>> import dataclasses, jax.numpy as jnp
      >>> from jquant.kv import PagedCache
      >>> from jquant.models.llama import check_room
      >>> cache = PagedCache.allocate("bf16", num_layers=1, batch=2, max_len=16, kv_heads=1, head_dim=16)
      >>> cache = dataclasses.replace(cache, lengths=jnp.array([3, 10], jnp.int32))
      >>> check_room(cache, 6)   # fits: no error
      >>> check_room(cache, 7)
      Traceback (most recent call last):
          ...
      ValueError: sequence 1 holds 10 tokens; 7 more do not fit the cache's 16 a sequence: allocate a larger one (new_cache(..., max_len=...))
    """
    paged = isinstance(cache, PagedCache)
    lengths, room = (cache.lengths, cache.capacity) if paged else (cache.length, cache.max_len)
    if new_tokens > room:
        raise ValueError(f"{new_tokens} tokens do not fit the cache's {room} a sequence: allocate a larger one "
                         "(new_cache(..., max_len=...))")
    if isinstance(lengths, jax.core.Tracer):
        return
    held = np.atleast_1d(np.asarray(lengths)).astype(np.int64)
    bad = np.flatnonzero((held < 0) | (held + new_tokens > room))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"sequence {b} holds {held[b]} tokens; {new_tokens} more do not fit the cache's {room} "
                         "a sequence: allocate a larger one (new_cache(..., max_len=...))")


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _decode_step(model: LlamaForCausalLM, variables, token_ids: jax.Array, cache: PagedCache | KVCache):
    with intercept_quantized():
        return model.apply(variables, token_ids, cache)


def decode_step(model: LlamaForCausalLM, variables, token_ids: jax.Array, cache: PagedCache | KVCache, *,
                check: bool = True):
    """``model.apply(variables, token_ids, cache)`` as one jitted step ``(logits [B, T, vocab], cache)``, the
    cache donated so its pages are updated in place (the caller must not reuse the ``cache`` it passed).
    Quantized Dense kernels (QParams) run their scheme.

    ``check``: first ``check_room`` (a ``ValueError`` naming the sequence whose new tokens would pass
    the cache's end, before anything is written or donated); it reads the cache's lengths, so the host
    waits for the previous step. With ``check=False``, or called under jit, nothing raises: an
    overflowing sequence's tokens are not written and its logits are NaN."""
    if check:
        check_room(cache, jnp.shape(token_ids)[1])
    return _decode_step(model, variables, token_ids, cache)
