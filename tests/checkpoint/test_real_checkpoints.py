"""Checkpoints written by the quantization tools themselves (GPTQModel, llmcompressor, bitsandbytes via
transformers) load and give the tools' own outputs.

Each directory under tests/goldens/real/ (made by tools/real_checkpoints/) holds a tiny random Llama
(2 layers, hidden 256, bfloat16 norms and embeddings as transformers saved them) quantized by the tool,
and reference.npz with the tool's outputs on ``input_ids``:

- weight-only schemes: ``logits``, the float32 forward of the tool's own dequantized weights. jquant's
  side is the same: the loaded QTensors dequantized to float32 in the float Llama, so the two agree to
  float32 rounding (the tools' CPU kernels compute in bfloat16/float16 and are not the reference).
- FP8 dynamic (W8A8, per-token activation scales): each projection's output on fixed inputs
  (``<module>.input`` → ``<module>.output``), from the tool's own quantized forward; end-to-end logits
  are not compared since one activation rounding to a neighbouring FP8 value moves them by whole units.
- bitsandbytes LLM.int8(): the same per-projection outputs (bfloat16 inputs with outlier columns), from
  the loaded model's ``Linear8bitLt``; jquant's must be the same bits.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.flax import QParam, quantized_apply

REAL = pathlib.Path(__file__).parents[1] / "goldens" / "real"

# checkpoint directory: what its reference.npz holds
CHECKPOINTS = {
    "bnb_nf4": "logits",
    "bnb_nf4_dq": "logits",
    "bnb_fp4": "logits",
    "bnb_int8": "int8_layers",
    "ct_gptq_w4a16": "logits",
    "ct_gptq_w8a16": "logits",
    "ct_awq_w4a16_asym": "logits",
    "ct_fp8_dynamic": "layers",
    "gptqmodel_w4g64": "logits",
    "gptqmodel_w4g64_act_order": "logits",
}
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _llama_config(path: pathlib.Path) -> LlamaConfig:
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=cfg["tie_word_embeddings"])


def _load(name: str, prepare: bool = False):
    path = REAL / name
    ref = np.load(path / "reference.npz")
    model = LlamaForCausalLM(_llama_config(path))
    ids = jnp.asarray(ref["input_ids"])
    like = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    return model, ids, ref, load_hf_checkpoint(path, like, prepare=prepare)


def _assert_close(actual, expected, what=""):
    """float32 agreement: the same weights and the same arithmetic up to summation order."""
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(),
                               err_msg=what)


def _dequantized(params):
    """The float32 Flax params: each QParam's QTensor dequantized, as the [K, N] kernel it replaces."""
    return jax.tree.map(lambda p: p.qtensor.dequantize(jnp.float32).T if isinstance(p, QParam) else p, params,
                        is_leaf=lambda p: isinstance(p, QParam))


def _cases(kind):
    return [name for name, k in CHECKPOINTS.items() if k == kind]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_all_zero_channel_and_groups_stay_zero(name):
    """The base model has an all-zero output channel (layer 0 q_proj row 5: a zero per-channel scale)
    and zero groups (layer 1 down_proj row 3, inputs 128..255). Every tool keeps the channel zero, and
    the nearest-value quantizers (bitsandbytes, AWQ, FP8) the groups too (GPTQ spreads the rounding error
    of earlier inputs into them); the loaded weights must agree (a 0/0 scale would give NaN)."""
    _, _, _, params = _load(name)
    q = np.asarray(params["layers_0"]["q_proj"]["kernel"].qtensor.dequantize(jnp.float32))
    down = np.asarray(params["layers_1"]["down_proj"]["kernel"].qtensor.dequantize(jnp.float32))
    assert np.isfinite(q).all() and np.isfinite(down).all()
    np.testing.assert_array_equal(q[5], 0.0)
    if "gptq" not in name:
        np.testing.assert_array_equal(down[3, 128:256], 0.0)
    assert np.count_nonzero(q[4]) > 128 and np.count_nonzero(down[3, :128]) > 64  # the rest is not zero


def test_every_committed_checkpoint_is_tested():
    assert sorted(p.name for p in REAL.iterdir() if p.is_dir()) == sorted(CHECKPOINTS)


@pytest.mark.parametrize("name", _cases("logits"))
def test_weight_only_logits_match_the_tool(name):
    model, ids, ref, params = _load(name)
    assert sum(isinstance(p, QParam) for p in jax.tree.leaves(params, is_leaf=lambda p: isinstance(p, QParam))) \
        == 7 * model.config.num_layers
    logits, _ = jax.jit(model.apply)({"params": _dequantized(params)}, ids)
    _assert_close(logits, ref["logits"])


@pytest.mark.parametrize("name", _cases("logits"))
def test_weight_only_scheme_forward_matches_the_tool(name):
    """The product path: prepared weights, each projection run by its scheme (float32 activations)."""
    model, ids, ref, params = _load(name, prepare=True)
    logits, _ = jax.jit(lambda p: quantized_apply(model, {"params": p}, ids))(params)
    _assert_close(logits, ref["logits"])


@pytest.mark.parametrize("name", _cases("layers"))
def test_fp8_dynamic_layer_outputs_match_the_tool(name):
    model, _, ref, params = _load(name)
    for i in range(model.config.num_layers):
        for proj, group in PROJECTIONS.items():
            qparam = params[f"layers_{i}"][proj]["kernel"]
            assert isinstance(qparam, QParam) and qparam.scheme.activation.mode == "dynamic_per_token", qparam
            module = f"model.layers.{i}.{group}.{proj}"
            x, expected = ref[f"{module}.input"], ref[f"{module}.output"]
            _assert_close(qparam.apply(jnp.asarray(x)), expected, module)


@pytest.mark.parametrize("name", _cases("int8_layers"))
def test_llm_int8_layer_outputs_are_the_tools_bits(name):
    model, _, ref, params = _load(name, prepare=True)
    for i in range(model.config.num_layers):
        for proj, group in PROJECTIONS.items():
            qparam = params[f"layers_{i}"][proj]["kernel"]
            assert isinstance(qparam, QParam) and qparam.scheme.name == "llm_int8", qparam
            module = f"model.layers.{i}.{group}.{proj}"
            x, expected = ref[f"{module}.input"], ref[f"{module}.output"]
            assert (np.abs(x) >= 6).any() and (np.abs(x) < 6).any()   # both halves of the decomposition run
            actual = np.asarray(qparam.apply(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
            np.testing.assert_array_equal(actual, expected, err_msg=module)
