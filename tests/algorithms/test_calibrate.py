"""Layer-by-layer calibration plumbing: each group of projections gets the inputs it sees under the
weights quantized before it, and round-to-nearest through it equals quantize_params."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.calibrate import calibrate_llama
from jquant.checkpoint.hf_checkpoint import PROJECTIONS
from jquant.flax.linen import quantized_apply
from jquant.flax.rules import quantize_params
from jquant.models.fused import fuse_projections
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import get_scheme

CONFIG = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64)
SCHEME = get_scheme("int4_g32")


def _rtn(calls=None):
    def quantize_group(kernels, inputs):
        if calls is not None:
            calls.append((tuple(kernels), np.asarray(inputs)))
        return {name: QParam(SCHEME.quantize_kernel(k), SCHEME) for name, k in kernels.items()}
    return quantize_group


@pytest.fixture(scope="module")
def params():
    return LlamaForCausalLM(CONFIG).init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"]


def _ids(rows=3, length=9):
    return jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (rows, length)), jnp.int32)


@pytest.mark.parametrize("fused", [False, True])
def test_round_to_nearest_through_calibration_equals_quantize_params(params, fused):
    model = LlamaForCausalLM(CONFIG, fused_projections=fused)
    p = fuse_projections(params) if fused else params
    got = calibrate_llama(model, p, _ids(), _rtn(), progress=False)
    want, _ = quantize_params(p, [(PROJECTIONS, SCHEME)], prepare=False)
    chex.assert_trees_all_equal(got, want)


def test_groups_see_inputs_under_the_weights_quantized_before_them(params):
    model = LlamaForCausalLM(CONFIG)
    calls = []
    ids = _ids()
    quantized = calibrate_llama(model, params, ids, _rtn(calls), progress=False)
    assert [c[0] for c in calls[:4]] == [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                         ("down_proj",)]
    assert len(calls) == 4 * CONFIG.num_layers
    # The down projection of the last layer reads silu(gate) * up computed with quantized gate/up, on the
    # hidden state the quantized earlier layers produced: record it from the quantized model itself.
    record = {}

    def spy(next_fun, args, kwargs, context):
        if context.module.name == "down_proj" and context.module.parent.name == f"layers_{CONFIG.num_layers - 1}":
            record["x"] = args[0]
        return next_fun(*args, **kwargs)

    import flax.linen as nn
    with nn.intercept_methods(spy):
        quantized_apply(model, {"params": quantized}, ids)
    np.testing.assert_allclose(calls[-1][1], np.asarray(record["x"]).reshape(-1, CONFIG.intermediate_size),
                               rtol=1e-4, atol=1e-5)  # jit vs op-by-op rounding


def test_calibration_ids_must_be_rows(params):
    with pytest.raises(ValueError, match="rows, seq_len"):
        calibrate_llama(LlamaForCausalLM(CONFIG), params, jnp.zeros((5,), jnp.int32), _rtn(), progress=False)


def test_gptq_through_calibration_beats_round_to_nearest_on_the_model_output(params):
    from jquant.algorithms.calibrate import gptq_group, rtn_group
    model = LlamaForCausalLM(CONFIG)
    ids = _ids(rows=8, length=16)
    want, _ = model.apply({"params": params}, ids)

    def err(p):
        got, _ = quantized_apply(model, {"params": p}, ids)
        return float(jnp.mean((got - want) ** 2))
    rtn = err(calibrate_llama(model, params, ids, rtn_group("int4_g32"), progress=False))
    gptq = err(calibrate_llama(model, params, ids, gptq_group("int4_g32"), progress=False))
    assert gptq < 0.9 * rtn, (gptq, rtn)


def test_a_calibrated_model_saves_as_a_gptq_checkpoint_and_loads_back(params, tmp_path):
    from jquant.algorithms import gptq_group
    from jquant.checkpoint.scheme_config import gptq_config
    from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from jquant.checkpoint.hf_config import scheme_from_config

    config = gptq_config(4, 32, symmetric=False, act_order=True)
    model = LlamaForCausalLM(CONFIG)
    ids = _ids(rows=4, length=16)
    quantized = calibrate_llama(model, params, ids, gptq_group(scheme_from_config(config), act_order=True),
                                progress=False)
    assert config["checkpoint_format"] == "gptq_v2"   # asymmetric: zero points as they are (v1 cannot hold 0)
    save_hf_checkpoint(quantized, tmp_path, quantization_config=config, model_config=CONFIG.to_hf_config())
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["quantization_config"] == config
    assert written["num_key_value_heads"] == CONFIG.num_kv_heads
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    want, _ = quantized_apply(model, {"params": quantized}, ids)
    got, _ = quantized_apply(model, {"params": loaded}, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert loaded["layers_0"]["q_proj"]["kernel"].weight.group_index is not None   # act-order's g_idx
