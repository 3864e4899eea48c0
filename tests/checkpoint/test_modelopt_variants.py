"""ModelOpt quant_algo variants as vLLM's ModelOptFp8Config / ModelOptNvFp4Config read them: per-channel
FP8 with dynamic per-token activations (FP8_PER_CHANNEL_PER_TOKEN), 128 × 128 block FP8 (FP8_PB_WO, which vLLM
runs W8A8 despite its name) and W4A16_NVFP4; the scale shapes each stores, and what is refused."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant import scheme_from_config
from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from jquant.checkpoint.safetensors_file import load_file, save_file
from jquant.flax import QParam, quantized_apply
from jquant.formats import fp8
from jquant.models.llama import LlamaConfig, LlamaForCausalLM

# Every projection's N and K a multiple of 128, as vLLM's FP8_PB_WO method requires.
CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=32, tie_word_embeddings=True)
PROJS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _flat(algo, **extra):
    return {"quant_method": "modelopt", "quant_algo": algo, **extra}


def _nested(algo, **extra):
    """hf_quant_config.json's shape: no quant_method, the settings under "quantization"."""
    return {"producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"],
                             **extra}}


@pytest.fixture(scope="module")
def tiny():
    model = LlamaForCausalLM(CONFIG)
    ids = jax.random.randint(jax.random.key(0), (1, 6), 0, CONFIG.vocab_size)
    return model, model.init(jax.random.key(1), ids)["params"], ids


# ---- configs --------------------------------------------------------------------------------------------

VARIANTS = {
    "FP8_PER_CHANNEL_PER_TOKEN": ("channel", None, "dynamic_per_token", None),
    "FP8_PB_WO": ("block", (128, 128), "dynamic_per_token_group", 128),
    "fp8_pb_wo": ("block", (128, 128), "dynamic_per_token_group", 128),  # ModelOpt may write it lowercase
}


@pytest.mark.parametrize("wrap", [_flat, _nested])
@pytest.mark.parametrize("algo", sorted(VARIANTS))
def test_fp8_variants_map_to_what_vllm_runs(algo, wrap):
    granularity, block, activation, group = VARIANTS[algo]
    s = scheme_from_config(wrap(algo))
    assert (s.weight.format, s.weight.granularity, s.weight.block_size) == ("fp8_e4m3", granularity, block)
    assert (s.activation.mode, s.activation.format, s.activation.group_size) == (activation, "fp8_e4m3", group)
    assert s.checkpoint_layout == "modelopt" and not s.weight.ue8m0


@pytest.mark.parametrize("wrap", [_flat, _nested])
def test_w4a16_nvfp4_is_modelopt_nvfp4_weight_only(wrap):
    s = scheme_from_config(wrap("W4A16_NVFP4", group_size=16))
    assert (s.weight.format, s.weight.convention, s.activation.mode, s.checkpoint_layout) == (
        "nvfp4", "modelopt", "none", "modelopt")


@pytest.mark.parametrize("wrap", [_flat, _nested])
def test_mxfp8_is_modelopt_mxfp8_weight_only(wrap):
    """vLLM's ModelOptMxFp8LinearMethod: E4M3 codes with E8M0 scales per 32, weight-only on Hopper."""
    s = scheme_from_config(wrap("MXFP8"))
    assert s.name == "mxfp8_modelopt" and s.checkpoint_layout == "modelopt" and s.activation.mode == "none"
    assert (s.weight.format, s.weight.scale_mode, s.weight.element_rounding) == ("mxfp8_e4m3", "rceil_log2f",
                                                                                "modelopt")


@pytest.mark.parametrize("config, match", [
    (_flat("INT8_SQ"), r"quantization_config\['quant_algo'\] must be 'FP8', 'FP8_PER_CHANNEL_PER_TOKEN', "
                       r"'FP8_PB_WO', 'NVFP4', 'W4A16_NVFP4' or 'MXFP8' for modelopt, got 'INT8_SQ'"),
    (_nested("W4A8_AWQ"), r"quantization_config\['quantization'\]\['quant_algo'\] must be .* got 'W4A8_AWQ'"),
    (_nested("MIXED_PRECISION"), r"\['quantization'\]\['quant_algo'\] 'MIXED_PRECISION' is not supported: it "
                                 r"sets a quant_algo per layer"),
    (_nested("W4A16_NVFP4", group_size=32), r"\['quantization'\]\['group_size'\] must be 16"),
    ({"quantization": {"kv_cache_quant_algo": "FP8"}}, r"quantization_config\['quantization'\] needs 'quant_algo'"),
])
def test_refusals_name_the_quant_algo(config, match):
    with pytest.raises(ValueError, match=match):
        scheme_from_config(config)


# ---- the modelopt/fp8 layout ----------------------------------------------------------------------------

def _weight(shape=(256, 384), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_per_channel_and_block_export_the_shapes_vllm_loads():
    channel = fp8.quantize_fp8(_weight(), granularity="channel")
    block = fp8.quantize_fp8(_weight(), granularity="block", block_size=(128, 128))
    stored = jquant.to_checkpoint(channel, "modelopt")
    assert sorted(stored) == ["weight", "weight_scale"] and stored["weight_scale"].shape == (256,)
    stored = jquant.to_checkpoint(block, "modelopt")
    assert stored["weight_scale"].shape == (2, 1, 3, 1) and stored["weight_scale"].dtype == np.float32
    for qt, granularity in ((channel, "channel"), (block, "block")):
        tensors = jquant.to_checkpoint(qt, "modelopt")
        for meta in ({}, {"variant": "fp8", "granularity": granularity}):  # detected, or as the config says
            back = jquant.from_checkpoint(tensors, "modelopt", **meta)
            assert back.block == qt.block and back.option("granularity") == granularity
            np.testing.assert_array_equal(back.dequantize(jnp.float32), qt.dequantize(jnp.float32))


def test_layout_refusals():
    channel = fp8.quantize_fp8(_weight(), granularity="channel")
    with pytest.raises(ValueError, match="only per-tensor weights .* store a static input_scale"):
        jquant.to_checkpoint(channel, "modelopt", input_scale=0.5)
    with pytest.raises(ValueError, match=r"128 × 128 block scales .* block \(64, 64\)"):
        jquant.to_checkpoint(fp8.quantize_fp8(_weight(), granularity="block", block_size=(64, 64)), "modelopt")
    # vLLM refuses FP8_PB_WO weights whose N or K is not a multiple of 128.
    odd = {"weight": _weight((64, 128)).astype(E4M3), "weight_scale": np.ones((1, 1, 1, 1), np.float32)}
    with pytest.raises(ValueError, match=r"needs N and K multiples of 128 for block scales \(FP8_PB_WO\)"):
        jquant.from_checkpoint(odd, "modelopt", granularity="block")
    stray = {**jquant.to_checkpoint(channel, "modelopt"), "input_scale": np.float32(0.5).reshape(())}
    with pytest.raises(ValueError, match="channel scaled weights .* take dynamic activations; tensor "
                                         "'input_scale' has no place"):
        jquant.from_checkpoint(stray, "modelopt")


# ---- checkpoints ----------------------------------------------------------------------------------------

def _scale(granularity, n, k, rng):
    """Non-power-of-two fp32 scales in the shape ModelOpt stores for ``granularity``; MXFP8 ("mx"): E8M0
    bytes [n, k/32] from 2^-15 to 2^-4, and 2^-127 (byte 0, subnormal products) in the first block."""
    if granularity == "mx":
        scale = rng.integers(112, 124, (n, k // 32)).astype(np.uint8)
        scale[0, 0] = 0
        return scale
    shape = {"tensor": (), "channel": (n,), "block": (n // 128, 1, k // 128, 1)}[granularity]
    return rng.uniform(0.001, 0.01, shape).astype(np.float32)


def _expanded(scale, n, k):
    """A per-channel [n], block [n/128, 1, k/128, 1] or E8M0 [n, k/32] ``scale`` per element of an [n, k]
    weight."""
    if scale.dtype == np.uint8:
        return np.repeat(np.exp2(scale.astype(np.float64) - 127), 32, axis=1)
    if scale.ndim == 4:
        return np.kron(scale.reshape(scale.shape[0], scale.shape[2]), np.ones((128, 128), np.float32))
    return np.broadcast_to(scale.reshape(-1, 1), (n, k))


def _write(directory, params, granularity, *, config=None, float_modules=(), input_scale=False):
    """A ModelOpt-style checkpoint of ``params``: every projection as e4m3 codes with ``granularity`` scales
    (``float_modules`` kept in float), FP8 KV-cache scales beside k_proj / v_proj. Returns name → (codes, scale)."""
    save_hf_checkpoint(params, directory, quantization_config=config, model_config=CONFIG.to_hf_config())
    tensors = load_file(str(directory / "model.safetensors"))
    rng = np.random.default_rng(3)
    stored = {}
    for group, projs in PROJS.items():
        for proj in projs:
            name = f"model.layers.0.{group}.{proj}"
            if proj in ("k_proj", "v_proj"):
                tensors[f"{name}.{proj[0]}_scale"] = np.float32(rng.uniform(0.01, 0.1)).reshape(())
            if proj in float_modules:
                continue
            n, k = tensors[f"{name}.weight"].shape
            codes = (rng.standard_normal((n, k)) * 64).astype(E4M3)
            scale = _scale(granularity, n, k, rng)
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = codes, scale
            if input_scale:
                tensors[f"{name}.input_scale"] = np.float32(0.02).reshape(())
            stored[name] = codes, scale
    save_file(tensors, str(directory / "model.safetensors"))
    return stored


@pytest.mark.parametrize("nested", [False, True], ids=["config.json", "hf_quant_config"])
@pytest.mark.parametrize("algo, granularity", [("FP8_PER_CHANNEL_PER_TOKEN", "channel"), ("FP8_PB_WO", "block"),
                                               ("MXFP8", "mx")])
def test_loaded_weights_are_the_stored_codes_times_scales(tmp_path, tiny, algo, granularity, nested):
    model, params, ids = tiny
    config = _nested(algo) if nested else _flat(algo)
    stored = _write(tmp_path, params, granularity, config=None if nested else config)
    loaded = load_hf_checkpoint(tmp_path, params, quantization_config=config if nested else None, prepare=False)
    for group, projs in PROJS.items():
        for proj in projs:
            q = loaded["layers_0"][proj]["kernel"]
            codes, scale = stored[f"model.layers.0.{group}.{proj}"]
            n, k = codes.shape
            assert isinstance(q, QParam) and q.input_scale is None and q.scheme == scheme_from_config(config)
            assert q.qtensor.shape == (n, k) and (q.qtensor.option("granularity") == granularity
                                                   or q.qtensor.fmt == "mxfp8_e4m3" and granularity == "mx")
            np.testing.assert_array_equal(np.asarray(q.qtensor.dequantize(jnp.float32)),
                                          (codes.astype(np.float64) * _expanded(scale, n, k)).astype(np.float32))
    prepared = load_hf_checkpoint(tmp_path, params, quantization_config=config if nested else None)
    x = jax.random.normal(jax.random.key(5), (4, CONFIG.hidden_size), jnp.float32)
    q = prepared["layers_0"]["q_proj"]["kernel"]
    want = x @ jnp.asarray(loaded["layers_0"]["q_proj"]["kernel"].qtensor.dequantize(jnp.float32)).T
    # W8A8: FP8 activations cost a few percent against the dequantized weight in float (MXFP8: weight-only).
    assert float(jnp.linalg.norm(q.apply(x) - want) / jnp.linalg.norm(want)) < 0.05
    logits = jax.jit(lambda p: quantized_apply(model, {"params": p}, ids)[0])(prepared)
    assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("algo, stored_as, match", [
    # The scale shapes of another quant_algo must not load as what they look like.
    ("FP8", "channel", r"'weight_scale' has shape \(128,\), but weight \(128, 128\) needs \[\] or \[1\] \(tensor\)"),
    ("FP8_PER_CHANNEL_PER_TOKEN", "tensor", r"'weight_scale' has shape \(\), but weight \(128, 128\) needs "
                                            r"\[128\] \(channel\)"),
    ("FP8_PB_WO", "channel", r"'weight_scale' has shape \(128,\), but weight \(128, 128\) needs \[1, 1, 1, 1\] "
                             r"\(block\)"),
])
def test_scales_of_another_quant_algo_are_refused(tmp_path, tiny, algo, stored_as, match):
    _, params, _ = tiny
    _write(tmp_path, params, stored_as, config=_flat(algo), input_scale=stored_as == "tensor")
    with pytest.raises(ValueError, match=r"'layers_0/q_proj/kernel'.*" + match):
        load_hf_checkpoint(tmp_path, params, prepare=False)


def test_static_input_scale_beside_dynamic_variant_is_refused(tmp_path, tiny):
    # vLLM's FP8_PER_CHANNEL_PER_TOKEN method has no input_scale: a calibrated one would be dropped.
    _, params, _ = tiny
    _write(tmp_path, params, "channel", config=_flat("FP8_PER_CHANNEL_PER_TOKEN"), input_scale=True)
    with pytest.raises(ValueError, match=r"'layers_0/q_proj/kernel'.*'input_scale' has no place"):
        load_hf_checkpoint(tmp_path, params, prepare=False)


def test_kv_cache_scales_beside_float_excluded_projections_load(tmp_path, tiny):
    """kv_cache_quant_algo FP8 stores k_proj.k_scale / v_proj.v_scale even where exclude_modules keeps the
    projection in float; no linear layer reads them (the KV-cache dtype and scales are new_cache's)."""
    _, params, _ = tiny
    config = _nested("FP8_PER_CHANNEL_PER_TOKEN")
    config["quantization"]["exclude_modules"] += ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    _write(tmp_path, params, "channel", float_modules=("k_proj", "v_proj"))
    loaded = load_hf_checkpoint(tmp_path, params, quantization_config=config, prepare=False)
    for proj in ("k_proj", "v_proj"):
        np.testing.assert_array_equal(loaded["layers_0"][proj]["kernel"], params["layers_0"][proj]["kernel"])
    assert isinstance(loaded["layers_0"]["q_proj"]["kernel"], QParam)
