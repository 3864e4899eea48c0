"""checkpoint_config: each registered scheme's checkpoint config reads back as the same scheme (same
numerics), and a model written under it loads back bit-identically."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant import get_scheme, scheme_from_config
from jquant.checkpoint.hf_checkpoint import PROJECTIONS, load_hf_checkpoint, save_hf_checkpoint
from jquant.checkpoint.scheme_config import _NO_CONFIG, checkpoint_config, writable_schemes
from jquant.flax import quantize_params
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.schemes.scheme import schemes

# K = 128 and 256: whole FP8 blocks of 128, groups of 128, NVFP4's 16 and bitsandbytes' 64.
CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=32, tie_word_embeddings=True)


def test_every_registered_scheme_has_a_checkpoint_or_a_reason():
    assert set(writable_schemes()) | set(_NO_CONFIG) == set(schemes())
    assert not set(writable_schemes()) & set(_NO_CONFIG)


@pytest.mark.parametrize("name", writable_schemes())
def test_the_config_reads_back_as_the_same_numerics(name):
    registered, written = get_scheme(name), scheme_from_config(checkpoint_config(name))
    assert written.name == name and written.checkpoint_layout is not None
    key = jax.random.key(len(name))
    w = jax.random.normal(key, (256, 512)) * 0.05
    w = w.at[3].set(0.0).at[7, :64].set(-0.0)   # a zero row and a zero group
    x = jax.random.normal(jax.random.fold_in(key, 1), (5, 512)).astype(jnp.bfloat16)
    qa, qb = registered.quantize_weight(w), written.quantize_weight(w)
    np.testing.assert_array_equal(np.asarray(qa.dequantize(), np.float32), np.asarray(qb.dequantize(), np.float32))
    ya = registered.apply(x, registered.process_weights_after_loading(qa))
    yb = written.apply(x, written.process_weights_after_loading(qb))
    np.testing.assert_array_equal(np.asarray(ya, np.float32), np.asarray(yb, np.float32))


@pytest.mark.parametrize("name", writable_schemes())
def test_a_model_written_under_the_config_loads_back_bit_identically(name, tmp_path):
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (1, 6), 0, CONFIG.vocab_size)
    params = model.init(jax.random.key(1), ids)["params"]
    config = checkpoint_config(name)
    qparams, _ = quantize_params(params, [(PROJECTIONS, scheme_from_config(config))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config, model_config=CONFIG.to_hf_config())
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(qparams)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(qparams)):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))   # a 0-d global scale
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_act_order_is_gptq_desc_act():
    assert checkpoint_config("int4_g32", act_order=True)["desc_act"] is True
    assert checkpoint_config("int4_g32")["desc_act"] is False
    assert checkpoint_config("nvfp4", act_order=True) == checkpoint_config("nvfp4")


def test_the_returned_config_is_a_copy():
    config = checkpoint_config("fp8_e4m3_channel")
    config["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    assert checkpoint_config("fp8_e4m3_channel")["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


@pytest.mark.parametrize("name, match", [("mxfp4", "MoE experts"), ("fp8_e4m3_tensor", "per-token activations"),
                                         ("int5_g7", "schemes with one: int4_g32")])
def test_schemes_without_a_checkpoint_say_why(name, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_config(name)


def test_a_registered_scheme_object_is_taken_as_its_name():
    # A Scheme was looked up as a name and refused with "schemes with one: ..., int8_ch, ...".
    import dataclasses

    assert checkpoint_config(get_scheme("int8_ch")) == checkpoint_config("int8_ch")
    with pytest.raises(ValueError, match="'custom' is not a registered scheme"):
        checkpoint_config(dataclasses.replace(get_scheme("int8_ch"), name="custom"))
    with pytest.raises(TypeError, match="takes a registered scheme's name"):
        checkpoint_config(8)
