"""A checkpoint's KV-cache settings as vLLM reads them (kv_cache_settings): the dtype a ModelOpt config's
kv_cache_quant_algo implies, the per-layer k_scale / v_scale wherever vLLM finds them, their defaults, and
the refusals; a quantized checkpoint that carries them loads and runs with its FP8 cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant import scheme_from_config
from jquant.checkpoint import kv_cache_settings, load_hf_checkpoint, save_hf_checkpoint
from jquant.checkpoint.kv_cache import kv_cache_dtype_from_config
from jquant.checkpoint.safetensors_file import load_file, load_tensors, save_file
from jquant.flax import quantize_params
from jquant.models.llama import LlamaConfig, LlamaForCausalLM, decode_step, new_cache

CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=2,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=32, tie_word_embeddings=True)
MODELOPT = {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_quant_algo": "FP8"}}


def _scalar(v):
    return np.asarray(v, np.float32).reshape(())


def _write(directory, tensors):
    save_file(tensors, directory / "model.safetensors")
    return directory


def test_modelopt_checkpoint_loads_and_runs_with_its_fp8_cache(tmp_path):
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (1, 5), 0, CONFIG.vocab_size)
    params = model.init(jax.random.key(1), ids)["params"]
    qparams, _ = quantize_params(params, [(r".*_proj/kernel", scheme_from_config(MODELOPT))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=MODELOPT)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    k = [0.03, 0.05, 0.07]
    for i in range(CONFIG.num_layers):   # ModelOpt stores them under k_proj / v_proj
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = _scalar(k[i])
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = _scalar(2 * k[i])
    _write(tmp_path, tensors)
    loaded = load_hf_checkpoint(tmp_path, params, quantization_config=MODELOPT)
    settings = kv_cache_settings(tmp_path, CONFIG.num_layers, quantization_config=MODELOPT)
    assert settings.kv_cache_dtype == "fp8"
    np.testing.assert_array_equal(settings.k_scales, np.float32(k))
    np.testing.assert_array_equal(settings.v_scales, 2 * np.float32(k))
    cache = new_cache(model, 1, 16, settings.kv_cache_dtype, **settings.cache_options())
    assert [float(layer.k_scale) for layer in cache.layers] == list(settings.k_scales)
    assert [float(layer.v_scale) for layer in cache.layers] == list(settings.v_scales)
    logits, cache = decode_step(model, {"params": loaded}, ids, cache)
    assert bool(jnp.isfinite(logits).all()) and int(cache.lengths[0]) == ids.shape[1]


def test_attention_level_scales_of_a_float_checkpoint_load(tmp_path):
    """compressed-tensors and fp8 checkpoints store ``self_attn.k_scale``; no parameter reads it, and the
    loader refused it as a stray tensor before; no config: the cache stays in the model's dtype."""
    model = LlamaForCausalLM(CONFIG)
    params = model.init(jax.random.key(1), jnp.zeros((1, 2), jnp.int32))["params"]
    save_hf_checkpoint(params, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = _scalar(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = _scalar(0.25)
    _write(tmp_path, tensors)
    load_hf_checkpoint(tmp_path, params)
    settings = kv_cache_settings(tmp_path, CONFIG.num_layers)
    assert settings.kv_cache_dtype is None
    assert settings.k_scales == (1.0, 0.5, 1.0) and settings.v_scales == (1.0, 0.25, 1.0)


def test_a_single_scale_serves_both_and_none_means_no_scales(tmp_path):
    _write(tmp_path, {"model.layers.0.self_attn.kv_scale": _scalar(3.0),           # deprecated single scale
                      "model.layers.2.self_attn.k_proj.k_scale": _scalar(0.125),   # v missing: k serves both
                      "model.embed_tokens.weight": np.ones((4, 4), np.float32)})
    settings = kv_cache_settings(tmp_path, 3)
    assert settings.k_scales == (3.0, 1.0, 0.125) and settings.v_scales == (3.0, 1.0, 0.125)
    empty = tmp_path / "none"
    empty.mkdir()
    _write(empty, {"model.embed_tokens.weight": np.ones((4, 4), np.float32)})
    assert kv_cache_settings(empty, 3, quantization_config=MODELOPT) == type(settings)("fp8", None, None)
    assert kv_cache_settings(empty, 3).cache_options() == {}


@pytest.mark.parametrize("name,value,match", [
    ("model.layers.0.self_attn.k_scale", -1.0, "one positive finite float"),
    ("model.layers.0.self_attn.k_scale", np.nan, "one positive finite float"),
    ("model.layers.0.self_attn.k_scale", 0.0, "one positive finite float"),
    ("model.layers.0.self_attn.k_scale", np.ones(2, np.float32), r"shape \(2,\)"),
    ("model.layers.5.self_attn.v_proj.v_scale", 1.0, "layer 5, but the model has 3 layers"),
    ("model.layers.0.self_attn.v_proj.k_scale", 1.0, "a k_scale under v_proj"),
])
def test_bad_scales_are_refused_naming_the_tensor(tmp_path, name, value, match):
    _write(tmp_path, {name: np.asarray(value, np.float32).reshape(np.shape(value))})
    with pytest.raises(ValueError, match=match) as e:
        kv_cache_settings(tmp_path, 3)
    assert name in str(e.value)


def test_a_scale_stored_twice_is_refused(tmp_path):
    _write(tmp_path, {"model.layers.1.self_attn.k_scale": _scalar(1.0),
                      "model.layers.1.self_attn.k_proj.k_scale": _scalar(2.0)})
    with pytest.raises(ValueError, match="layer 1's k_scale is stored twice"):
        kv_cache_settings(tmp_path, 3)


def test_kv_cache_dtype_from_config():
    assert kv_cache_dtype_from_config(MODELOPT) == "fp8"
    assert kv_cache_dtype_from_config({"quant_method": "modelopt", "quant_algo": "FP8",
                                       "kv_cache_quant_algo": "fp8"}) == "fp8"
    assert kv_cache_dtype_from_config({"quant_method": "modelopt", "quant_algo": "FP8"}) is None
    assert kv_cache_dtype_from_config({"quant_method": "fp8"}) is None and kv_cache_dtype_from_config(None) is None
    with pytest.raises(ValueError, match="kv_cache_quant_algo 'NVFP4'"):
        kv_cache_dtype_from_config({"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4"}})
    # Newer ModelOpt writes kv_cache_scheme into config.json (the KV cache stayed bf16 where vLLM runs FP8).
    fp8_scheme = {"dynamic": False, "num_bits": 8, "type": "float"}
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": fp8_scheme, "ignore": ["lm_head"]}
    assert kv_cache_dtype_from_config(flat) == "fp8"
    assert kv_cache_dtype_from_config({**flat, "kv_cache_quant_algo": "NVFP4"}) == "fp8"   # the scheme first
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        kv_cache_dtype_from_config({**flat, "kv_cache_scheme": {**fp8_scheme, "num_bits": 4}})


def test_load_tensors_reads_only_what_is_asked(tmp_path):
    rng = np.random.default_rng()
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int8),
               "c": rng.standard_normal(()).astype(np.float32)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    got = load_tensors(path, ["c", "a", "missing"])
    assert sorted(got) == ["a", "c"]
    for k in got:
        np.testing.assert_array_equal(got[k], tensors[k])
        assert got[k].shape == tensors[k].shape and got[k].flags.writeable
