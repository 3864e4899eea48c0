"""HF checkpoints beyond the round trip: float tensors in any float dtype, config ignore lists, and
static-activation FP8 (per-weight input_scale) through save → load → forward."""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant import scheme_from_config
from jquant.flax.orbax_io import restore_quantized, save_quantized
from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint, skip_from_config
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.flax import QParam, quantize_params, quantized_apply
from jquant.flax.rules import DEFAULT_SKIP
from jquant.checkpoint.safetensors_file import load_file, save_file

CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=32, tie_word_embeddings=True)
PROJ = r".*_proj/kernel"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}


@pytest.fixture(scope="module")
def tiny():
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (1, 6), 0, CONFIG.vocab_size)
    return model, model.init(jax.random.key(1), ids)["params"], ids


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x if isinstance(x, QParam) else x.astype(dtype), tree,
                        is_leaf=lambda x: isinstance(x, QParam))


def _assert_leaves_equal(a, b):
    """Same tree, bit-identical leaves (so any forward pass over them agrees too)."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                      np.atleast_1d(np.asarray(y)).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float_checkpoint_in_any_float_dtype_loads(tmp_path, tiny, dtype):
    # bf16 and fp8 are ml_dtypes ('V' kind): the loader used to refuse them as "no quantization_config".
    _, params, _ = tiny
    save_hf_checkpoint(_cast(params, dtype), tmp_path)
    loaded = load_hf_checkpoint(tmp_path, params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(dtype).astype(jnp.float32)), loaded, params)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(loaded))


def test_gptqmodel_style_bf16_embeddings_and_norms(tmp_path, tiny):
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(r"layers_1/(o|up)_proj/kernel", scheme_from_config(GPTQ)),
                                          (PROJ, None)], prepare=False)
    qparams = _cast(qparams, jnp.bfloat16)  # what GPTQModel writes for every unquantized tensor
    save_hf_checkpoint(qparams, tmp_path, quantization_config=GPTQ)
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    np.testing.assert_array_equal(loaded["embed_tokens"]["embedding"],
                                  params["embed_tokens"]["embedding"].astype(jnp.bfloat16).astype(jnp.float32))
    assert isinstance(loaded["layers_1"]["o_proj"]["kernel"], QParam)
    _assert_leaves_equal(loaded, _cast(qparams, jnp.float32))


CT_FP8_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
IGNORING = {
    "awq_substring": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                       "modules_to_not_convert": ["down_proj"]}, {"down_proj"}),
    "ct_regex": (dict(CT_FP8_CHANNEL, ignore=["re:.*self_attn\\.[kv]_proj$"]), {"k_proj", "v_proj"}),
    "modelopt_glob": ({"quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                        "exclude_modules": ["model.layers.*.mlp.gate_proj"]}}, {"gate_proj"}),
    "bnb_component": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                       "llm_int8_skip_modules": ["o_proj"]}, {"o_proj"}),
}


@pytest.mark.parametrize("name", sorted(IGNORING))
def test_ignored_modules_stay_float_through_quantize_save_and_load(tmp_path, tiny, name):
    model, params, ids = tiny
    config, kept = IGNORING[name]
    scheme = scheme_from_config(config)
    qparams, report = quantize_params(params, [(PROJ, scheme)], skip=DEFAULT_SKIP + (skip_from_config(config),),
                                      prepare=False)
    for layer in ("layers_0", "layers_1"):
        for proj, leaf in qparams[layer].items():
            if proj.endswith("_proj"):
                assert isinstance(leaf["kernel"], QParam) == (proj not in kept), (layer, proj)
    assert len(report.quantized) == 2 * (7 - len(kept))
    qparams = _cast(qparams, jnp.bfloat16)  # float modules as HF stores them
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config)
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    for proj in kept:
        assert not isinstance(loaded["layers_1"][proj]["kernel"], QParam)
    _assert_leaves_equal(loaded, _cast(qparams, jnp.float32))


def test_ignored_module_with_quantized_tensors_is_an_error(tmp_path, tiny):
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(GPTQ))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=GPTQ)
    config = dict(GPTQ, dynamic={"-:.*layers\\.1\\.mlp\\.up_proj": {}})
    with pytest.raises(ValueError, match=r"'layers_1/up_proj/kernel'.*keeps model.layers.1.mlp.up_proj in float"):
        load_hf_checkpoint(tmp_path, params, quantization_config=config)


# ---- static FP8 -------------------------------------------------------------------------------------

STATIC = {
    "fp8_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "modelopt_fp8": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}},
    "modelopt_fp8_flat": {"quant_method": "modelopt", "quant_algo": "FP8"},
    "ct_static_tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                          "dynamic": False}}}},
    "ct_static_channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                          "dynamic": False}}}},
}
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _calibrated(params, config):
    """Static-FP8 QParams with a distinct, non-power-of-two input_scale per projection."""
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(config))], prepare=False)
    scales = {}
    for i, layer in enumerate(("layers_0", "layers_1")):
        for j, proj in enumerate(sorted(p for p in qparams[layer] if p.endswith("_proj"))):
            q = qparams[layer][proj]["kernel"]
            scales[(layer, proj)] = np.float32(0.0031 * (1 + 0.37 * j) * (1 + i))
            qparams[layer][proj]["kernel"] = QParam(q.weight, q.scheme, jnp.float32(scales[(layer, proj)]))
    return qparams, scales


def _vllm_static_linear(x, qt, input_scale):
    """vLLM's static FP8 linear, in numpy: e4m3 codes sat(x · (1/s)) with the per-tensor input scale s,
    then (codes · W_codesᵀ) · s · w_scale (per tensor or per output channel), accumulated in float64."""
    codes = np.clip(np.asarray(x, np.float32) * (np.float32(1) / np.float32(input_scale)), -448, 448)
    codes = codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w = np.asarray(qt.data).astype(np.float64)
    return codes @ w.T * float(input_scale) * np.asarray(qt.scale, np.float64).reshape(1, -1)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_fp8_checkpoint_forward_follows_vllm(tmp_path, tiny, name):
    model, params, ids = tiny
    config = STATIC[name]
    qparams, scales = _calibrated(params, config)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=config)
    stored = load_file(str(tmp_path / "model.safetensors"))
    in_scale = stored["model.layers.0.self_attn.q_proj.input_scale"]
    assert in_scale.dtype == np.float32 and in_scale.shape == ((1,) if name.startswith("ct") else ())
    if name.startswith("ct"):  # llm-compressor writes scales in the model's dtype
        stored = {k: v.astype(ml_dtypes.bfloat16) if k.endswith("input_scale") else v for k, v in stored.items()}
        save_file(stored, str(tmp_path / "model.safetensors"))
    loaded = load_hf_checkpoint(tmp_path, params)
    granularity = "channel" if name.endswith("channel") else "tensor"
    qt = loaded["layers_0"]["q_proj"]["kernel"].qtensor
    assert qt.block[0] == (1 if granularity == "channel" else qt.shape[0])

    x = jax.random.normal(jax.random.key(7), (5, CONFIG.hidden_size), jnp.float32) * 0.3
    x = x.at[0, :3].set(jnp.array([30.0, -30.0, -0.0]))  # saturates at ±448 for the smaller scales
    for (layer, proj), s in scales.items():
        group = [p for (lay, p) in scales if lay == layer and FUSED.get(p, p) == FUSED.get(proj, proj)]
        shared = max(np.float32(scales[(layer, p)]) for p in group)
        if name.startswith("ct"):
            shared = max(np.float32(ml_dtypes.bfloat16(scales[(layer, p)])) for p in group)
        q = loaded[layer][proj]["kernel"]
        assert float(q.input_scale) == float(shared), (layer, proj)  # vLLM: one scale per fused GEMM
        if proj in ("o_proj", "down_proj"):
            continue  # fed by other activations: K differs from the hidden size for down_proj
        np.testing.assert_allclose(np.asarray(q.apply(x)), _vllm_static_linear(x, q.qtensor, shared),
                                   rtol=1e-5, atol=1e-4)
    if name == "fp8_static":  # the whole model runs on the loaded params (jitted: the scales are leaves)
        logits = jax.jit(lambda p: quantized_apply(model, {"params": p}, ids)[0])(loaded)
        assert bool(jnp.all(jnp.isfinite(logits)))


def test_static_fp8_input_scale_survives_orbax(tmp_path, tiny):
    _, params, _ = tiny
    qparams, _ = _calibrated(params, STATIC["fp8_static"])
    save_quantized(tmp_path / "ckpt", qparams)
    restored = restore_quantized(tmp_path / "ckpt")
    x = jax.random.normal(jax.random.key(3), (4, CONFIG.hidden_size), jnp.bfloat16)
    for layer in ("layers_0", "layers_1"):
        a, b = qparams[layer]["k_proj"]["kernel"], restored[layer]["k_proj"]["kernel"]
        assert b.input_scale is not None and float(b.input_scale) == float(a.input_scale)
        np.testing.assert_array_equal(jax.jit(lambda q, x: q.apply(x))(b, x), a.apply(x))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.input_scale"), r"no model.layers.1.mlp.up_proj.input_scale"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.input_scale", np.float32(0).reshape(())),
     r"o_proj.input_scale must hold positive finite"),
])
def test_static_fp8_bad_input_scale_names_the_tensor(tmp_path, tiny, edit, match):
    _, params, _ = tiny
    qparams, _ = _calibrated(params, STATIC["fp8_static"])
    save_hf_checkpoint(qparams, tmp_path, quantization_config=STATIC["fp8_static"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(tmp_path, params)


def test_tensors_the_layout_does_not_read_are_refused(tmp_path, tiny):
    # A bias (or any tensor) beside a quantized weight used to be counted as loaded and dropped.
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(GPTQ))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=GPTQ)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros((128,), np.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'layers_0/q_proj/kernel'.*q_proj\.bias'\] are not part of the 'gptq'"):
        load_hf_checkpoint(tmp_path, params, prepare=False)


def test_kv_cache_scales_beside_quantized_weights_still_load(tmp_path, tiny):
    # compressed-tensors kv_cache_scheme stores k_proj/v_proj.output_scale: no linear layer reads them.
    _, params, _ = tiny
    qparams, _ = quantize_params(params, [(PROJ, scheme_from_config(CT_FP8_CHANNEL))], prepare=False)
    save_hf_checkpoint(qparams, tmp_path, quantization_config=CT_FP8_CHANNEL)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in range(CONFIG.num_layers):
        for proj in ("k_proj", "v_proj"):
            tensors[f"model.layers.{layer}.self_attn.{proj}.output_scale"] = np.ones((1,), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_hf_checkpoint(tmp_path, params, prepare=False)
    assert isinstance(loaded["layers_0"]["k_proj"]["kernel"], QParam)
