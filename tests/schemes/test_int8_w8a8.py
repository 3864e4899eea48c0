"""INT8 W8A8: vLLM's activation quantization (per token, static), the int32 GEMM, the compressed-tensors
``int-quantized`` checkpoint layout and its ``quantization_config``."""

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.checkpoint.hf_config import scheme_from_config
from jquant.formats.int8_activations import quantize_int8_per_token, quantize_int8_static, signed_int8
from jquant.schemes import builtin


def _vllm_per_token(x):
    """vLLM's dynamic per-token kernel in numpy float32: amax skipping NaN (fmaxf), scale amax/127,
    codes rint_sat(x · (127/amax)), NaN → 0."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.where(np.isnan(x), np.float32(0), np.abs(x)), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint(x * (np.float32(127) / amax))
    q = np.clip(np.nan_to_num(q, nan=0.0), -128, 127)
    return q.astype(np.int8), amax / np.float32(127)


def test_per_token_matches_vllm_on_midpoints_zeros_nan_inf_subnormals():
    rng = np.random.default_rng()
    x = rng.standard_normal((64, 384)).astype(np.float32) * rng.uniform(1e-3, 1e3, (64, 1)).astype(np.float32)
    x[0, :8] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -0.0]     # amax 127: codes exactly at the midpoints
    x[0, 8:] = 0
    x[1] = 0                                                    # all-zero row: scale 0, codes 0
    x[2, 7] = np.nan                                            # NaN: skipped by amax, code 0
    x[3, 3] = np.inf                                            # Inf: scale Inf, codes 0
    x[4] = rng.standard_normal(384) * 1e-40                     # subnormal row
    qt = quantize_int8_per_token(jnp.asarray(x))
    q, s = _vllm_per_token(x)
    normal = np.arange(64) != 4
    np.testing.assert_array_equal(np.asarray(signed_int8(qt))[normal], q[normal])
    np.testing.assert_array_equal(np.asarray(qt.scale)[normal], s[normal])
    # XLA flushes subnormals (as the GPU does in fast-math kernels): that row dequantizes to ~0, its value
    assert np.abs(np.asarray(qt.dequantize())[4]).max() < 1e-38
    assert signed_int8(qt)[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 0]
    assert not np.asarray(signed_int8(qt))[1].any() and float(qt.scale[1, 0]) == 0.0
    assert int(signed_int8(qt)[2, 7]) == 0 and np.isfinite(np.asarray(qt.scale)[2]).all()
    assert np.isinf(np.asarray(qt.scale)[3]).all()
    # a bf16 input quantizes from its float32 value
    xb = jnp.asarray(x[5:9], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(signed_int8(quantize_int8_per_token(xb))),
                                  _vllm_per_token(np.asarray(xb, np.float32))[0])


def test_static_rounds_half_to_even_and_saturates():
    x = jnp.array([[0.5, 1.5, 2.5, -2.5, 126.5, 127.5, -128.4, -129.0, 1e30, np.nan]], jnp.float32)
    assert signed_int8(quantize_int8_static(x, 1.0)).tolist() == [[0, 2, 2, -2, 126, 127, -128, -128, 127, 0]]
    assert signed_int8(quantize_int8_static(x * 0.25, 0.25)).tolist()[0][:4] == [0, 2, 2, -2]
    with pytest.raises(ValueError, match="one value"):
        quantize_int8_static(x, jnp.ones(2))


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_apply_is_the_int32_gemm_of_the_codes(static):
    rng = np.random.default_rng()
    scheme = builtin.int8_w8a8(static_activations=static, input_scale=0.035 if static else None)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    x = rng.standard_normal((2, 5, 256)).astype(np.float32)
    qw = scheme.quantize_weight(w)
    y = scheme.apply(x, scheme.process_weights_after_loading(qw))
    xq = quantize_int8_static(x.reshape(10, 256), 0.035) if static else quantize_int8_per_token(x.reshape(10, 256))
    acc = np.asarray(signed_int8(xq), np.int64) @ np.asarray(signed_int8(qw), np.int64).T
    ref = acc * np.asarray(xq.scale, np.float64).reshape(-1, 1) * np.asarray(qw.scale, np.float64).reshape(1, -1)
    chex.assert_trees_all_close(np.asarray(y).reshape(10, 96), ref, rtol=1e-5, atol=1e-5)
    x = np.clip(x, -127 * 0.035, 127 * 0.035)   # inside the static scale's range
    y = scheme.apply(x, scheme.process_weights_after_loading(qw))
    assert float(np.abs(np.asarray(y) - x @ w.T).max()) < 0.05 * float(np.abs(x @ w.T).max())


def test_int_quantized_checkpoint_round_trip_and_bad_tensors():
    rng = np.random.default_rng()
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for qt in (jquant.quantize(w, "int8"), jquant.quantize(w, "int8", granularity="tensor")):
        tensors = to_checkpoint(qt, "compressed-tensors/int-quantized", input_scale=0.5)
        assert tensors["weight"].dtype == np.int8 and tensors["input_scale"].shape == (1,)
        back = from_checkpoint(tensors, "compressed-tensors/int-quantized")
        chex.assert_trees_all_equal(back.dequantize(), qt.dequantize())
        assert from_checkpoint(tensors, "compressed-tensors").fmt == "int8"     # detected among the variants
    tensors = to_checkpoint(jquant.quantize(w, "int8"), "compressed-tensors/int-quantized")
    bf16 = dict(tensors, weight_scale=tensors["weight_scale"].astype(ml_dtypes.bfloat16))
    assert from_checkpoint(bf16, "compressed-tensors/int-quantized").scale.dtype == jnp.bfloat16
    for bad, message in ((dict(tensors, weight=tensors["weight"].astype(np.int16)), "must be int8"),
                         (dict(tensors, weight_scale=np.ones((8, 2), np.float32)), "needs \\[8, 1\\]"),
                         (dict(tensors, weight_zero_point=np.ones((8, 1), np.int8)), "nonzero 'weight_zero_point'"),
                         ({"weight": tensors["weight"]}, "weight_scale")):
        with pytest.raises(ValueError, match=message):
            from_checkpoint(bad, "compressed-tensors/int-quantized")
    with pytest.raises(ValueError, match="cannot store QTensor.fmt='uint8'"):
        to_checkpoint(jquant.quantize(w, "uint8", group_size=32), "compressed-tensors/int-quantized")
    with pytest.raises(ValueError, match="per-channel or per-tensor"):
        to_checkpoint(jquant.quantize(w, "int8", group_size=32), "compressed-tensors/int-quantized")


def _ct_config(weights=None, acts=None):
    group = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", **(weights or {})},
             "input_activations": None if acts is False else
             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, **(acts or {})},
             "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group}}


def test_quantization_config_builds_int8_w8a8():
    assert scheme_from_config(_ct_config()).name == "int8_w8a8"
    static = scheme_from_config(_ct_config(acts={"strategy": "tensor", "dynamic": False}))
    assert static.name == "int8_w8a8_static" and static.activation.mode == "static"
    assert static.checkpoint_layout == "compressed-tensors/int-quantized"
    for cfg, message in ((_ct_config(acts={"symmetric": False}), "azp"),
                         (_ct_config(weights={"symmetric": False}), "asymmetric INT8 weights"),
                         (_ct_config(acts=False), "weight-only"),
                         (_ct_config(acts={"strategy": "tensor"}), "dynamic per token or static per tensor"),
                         (_ct_config(weights={"num_bits": 4}), "num_bits 8")):
        with pytest.raises(ValueError, match=message):
            scheme_from_config(cfg)


def test_int8_activation_spec_refuses_other_modes():
    with pytest.raises(ValueError, match="int8 activations"):
        jquant.ActivationSpec("dynamic_per_token_group", "int8", group_size=128)
    assert "int8_w8a8" in jquant.schemes()
