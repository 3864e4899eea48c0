"""Hadamard-rotated quantized weights in use: a QParam with ``input_rotation`` computes ``x @ W.T`` from
``Q(W H)`` and rotated inputs; every path that rebuilds QParams keeps the rotation, and the checkpoint
writer, which cannot record it, refuses."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.calibrate import calibrate_llama, gptq_group, rtn_group
from jquant.algorithms.gptq import fp4_block_multipliers, gptq_quantize_weight
from jquant.checkpoint.hf_checkpoint import save_hf_checkpoint
from jquant.flax.linen import quantized_apply
from jquant.flax.orbax_io import restore_quantized, save_quantized
from jquant.flax.rules import prepare_params
from jquant.formats.hadamard import hadamard_blocks
from jquant.models.fused import fuse_projections
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import get_scheme

CONFIG = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)


def _outlier_data(seed=0, n=96, k=128, tokens=1024):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, rng.choice(k, 3, replace=False)] *= 15.0
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[:, rng.choice(k, 4, replace=False)] *= 20.0
    # Correlated channels, as real activations have (GPTQ gains nothing on a diagonal Hessian).
    mix = np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k)
    return w, (x @ mix).astype(np.float32)


@pytest.mark.parametrize("block", [16, 32, 128])
def test_rotated_qparam_applies_the_rotation_to_its_inputs(block):
    w, x = _outlier_data()
    scheme = get_scheme("int8_ch")
    rotated = QParam(scheme.quantize_weight(hadamard_blocks(w, block)), scheme, input_rotation=block)
    want = x @ w.T
    rel = lambda y: float(np.linalg.norm(np.asarray(y) - want) / np.linalg.norm(want))
    assert rel(rotated.apply(jnp.asarray(x))) < 0.02      # int8 per channel: 0.005-0.012 here
    plain = QParam(scheme.quantize_weight(hadamard_blocks(w, block)), scheme)
    assert rel(plain.apply(jnp.asarray(x))) > 0.5         # the rotation matters


def test_unsupported_rotation_block_is_refused():
    scheme = get_scheme("int8_ch")
    with pytest.raises(ValueError, match="Hadamard block"):
        QParam(scheme.quantize_weight(jnp.ones((4, 48))), scheme, input_rotation=48)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_fp4_gptq_exports_exactly_and_beats_round_to_nearest(name, act_order):
    w, x = _outlier_data(1)
    scheme = get_scheme(name)
    rtn = scheme.quantize_weight(jnp.asarray(w))
    got = gptq_quantize_weight(w, x, scheme=name, act_order=act_order)
    assert (got.fmt, got.shape, got.block) == (rtn.fmt, rtn.shape, rtn.block)
    chex.assert_trees_all_equal(got.scale, rtn.scale)          # the format's own scales
    chex.assert_trees_all_equal(fp4_block_multipliers(got), fp4_block_multipliers(rtn))
    err = lambda q: float(np.mean((x @ w.T - x @ np.asarray(q.dequantize(jnp.float32)).T) ** 2))
    assert err(got) < 0.6 * err(rtn), (err(got), err(rtn))
    # Every dequantized value lies on its block's E2M1 grid: re-encoding changes nothing.
    from jquant.algorithms.gptq import fp4_with_codes
    again = fp4_with_codes(rtn, got.dequantize(jnp.float32))
    chex.assert_trees_all_equal(again.dequantize(jnp.float32), got.dequantize(jnp.float32))


def test_fp4_gptq_keeps_zero_blocks_zero():
    w, x = _outlier_data(2)
    w[:5, :32] = 0.0
    w[7] = -0.0
    got = np.asarray(gptq_quantize_weight(w, x, scheme="mxfp4").dequantize(jnp.float32))
    assert np.isfinite(got).all()
    assert np.abs(got[7]).max() < np.abs(got).max()   # a zero row quantizes near zero, no NaN


@pytest.fixture(scope="module")
def params():
    return LlamaForCausalLM(CONFIG).init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"]


def _ids(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (4, 16)), jnp.int32)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_rotated_calibration_keeps_the_model_close_and_survives_fuse_prepare_and_orbax(params, method, tmp_path):
    model = LlamaForCausalLM(CONFIG)
    group = (rtn_group if method == "rtn" else gptq_group)("int4_g32", rotation=32)
    quantized = calibrate_llama(model, params, _ids(), group, progress=False)
    kernel = quantized["layers_0"]["q_proj"]["kernel"]
    assert kernel.input_rotation == 32
    want, _ = model.apply({"params": params}, _ids(1))
    got, _ = quantized_apply(model, {"params": quantized}, _ids(1))
    unrotated = dataclasses.replace
    broken = jax.tree.map(lambda l: unrotated(l, input_rotation=None) if isinstance(l, QParam) else l, quantized,
                          is_leaf=lambda l: isinstance(l, QParam))
    wrong, _ = quantized_apply(model, {"params": broken}, _ids(1))
    assert float(jnp.mean((got - want) ** 2)) < 0.1 * float(jnp.mean((wrong - want) ** 2))

    prepared = prepare_params(quantized)
    assert prepared["layers_0"]["q_proj"]["kernel"].input_rotation == 32
    fused = fuse_projections(quantized)
    assert fused["layers_0"]["qkv_proj"]["kernel"].input_rotation == 32
    fused_out, _ = quantized_apply(LlamaForCausalLM(CONFIG, fused_projections=True), {"params": fused}, _ids(1))
    np.testing.assert_allclose(np.asarray(fused_out), np.asarray(got), rtol=1e-4, atol=1e-4)

    save_quantized(tmp_path / "ckpt", quantized)
    restored = restore_quantized(tmp_path / "ckpt", prepare=False)
    assert restored["layers_1"]["down_proj"]["kernel"].input_rotation == 32
    again, _ = quantized_apply(model, {"params": restored}, _ids(1))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))

    with pytest.raises(ValueError, match="rotated basis"):
        save_hf_checkpoint(quantized, tmp_path / "hf", quantization_config={"quant_method": "gptq", "bits": 4})


def test_fusing_parts_with_different_rotations_is_refused(params):
    quantized = calibrate_llama(LlamaForCausalLM(CONFIG), params, _ids(), rtn_group("int4_g32"), progress=False)
    layer = dict(quantized["layers_0"])
    layer["k_proj"] = {"kernel": dataclasses.replace(layer["k_proj"]["kernel"], input_rotation=16)}
    with pytest.raises(ValueError, match="rotations differ"):
        fuse_projections({**quantized, "layers_0": layer})
