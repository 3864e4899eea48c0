"""8-bit W8A8 schemes against numpy transcriptions of vLLM's arithmetic (its CUDA quantization kernels,
the CUTLASS ``ScaledEpilogue``, the block-FP8 linear op and the quantization-config dispatch). Each test
also checks that its inputs tell vLLM's formula apart from the plausible alternative jquant had."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jquant
from jquant.formats.fp8 import quantize_fp8_per_token_group
from jquant.formats.int8_activations import signed_int8

F32 = np.float32
CPU = jax.devices("cpu")[0]


# ---- reference formulas (numpy, float32 throughout like the kernels) ---------------------------------

def ceil_pow2(s):
    """2^ceil(log2 s) for positive normal float32 s (exponent bump when the mantissa is nonzero)."""
    mantissa, exponent = np.frexp(s.astype(np.float64))
    return np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent)).astype(F32)


def vllm_group_scale_ue8m0(x, group):
    """per_token_group_quant_8bit's scale with UE8M0: amax starts at eps = 1e-10, y_s = amax / 448,
    then exp2(ceil(log2(fmaxf(|y_s|, 1e-10))))."""
    amax = np.maximum(np.abs(x.reshape(x.shape[0], -1, group)).max(-1), F32(1e-10)).astype(F32)
    y_s = (amax / F32(448.0)).astype(F32)
    return ceil_pow2(np.maximum(y_s, F32(1e-10)))


def vllm_int8_per_token(x):
    """dynamic_scaled_int8_quant: scale amax / 127, codes cvt.rni.sat(x · (127 / amax))."""
    amax = np.abs(x).max(-1, keepdims=True).astype(F32)
    inv = np.where(amax == 0, F32(0), F32(127.0) / np.where(amax == 0, F32(1), amax)).astype(F32)
    return np.clip(np.rint((x * inv).astype(F32)), -128, 127), (amax / F32(127.0)).astype(F32)


# ---- tests --------------------------------------------------------------------------------------------

def test_per_token_group_ue8m0_floors_scale_before_rounding():
    # Groups of tiny magnitude (amax below 448e-10): vLLM's scale is 2^-33, not 2^ceil(log2(amax / 448)).
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 256)) * np.array([1e-12, 1e-9, 1e-8, 1.0])[:, None]).astype(F32)
    qt = quantize_fp8_per_token_group(jnp.asarray(x), 128, ue8m0=True)
    want = vllm_group_scale_ue8m0(x, 128)
    np.testing.assert_array_equal(np.asarray(qt.scale, F32).reshape(want.shape), want)
    # Codes follow: x / s saturated, RNE to e4m3.
    codes = np.clip(x / np.repeat(want, 128, axis=1), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), codes.view(np.uint8))
    # Without the 1e-10 floor the tiny rows would get smaller scales.
    unfloored = ceil_pow2(np.maximum(np.abs(x.reshape(4, 2, 128)).max(-1), F32(1e-10)) / F32(448))
    assert (unfloored[:3] < want[:3]).all() and (unfloored[3] == want[3]).all()


def test_int8_w8a8_epilogue_order_matches_cutlass():
    # ScaledEpilogue: D = s_a · (s_b · acc) in float32; (acc · s_a) · s_b rounds differently.
    rng = np.random.default_rng(1)
    scheme = jquant.get_scheme("int8_w8a8")
    w = rng.standard_normal((64, 96)).astype(F32)
    x = rng.standard_normal((32, 96)).astype(F32)
    qw = scheme.quantize_weight(w)
    y = np.asarray(scheme.apply(jnp.asarray(x), scheme.process_weights_after_loading(qw, CPU)))
    xq, sa = vllm_int8_per_token(x)
    wq = np.asarray(signed_int8(qw), np.int64)
    sb = np.asarray(qw.scale, F32).reshape(1, -1)
    acc = (xq.astype(np.int64) @ wq.T).astype(F32)
    want = (sa * (sb * acc).astype(F32)).astype(F32)
    np.testing.assert_array_equal(y, want)
    assert not np.array_equal(want, ((acc * sa).astype(F32) * sb).astype(F32))


def test_block_fp8_bias_added_after_the_cast():
    # W8A8BlockFp8LinearOp: the GEMM returns bf16, then ``output + bias`` in bf16 (two roundings).
    rng = np.random.default_rng(2)
    scheme = jquant.get_scheme("fp8_e4m3_block128x128")
    w = rng.standard_normal((128, 256)).astype(F32) * 0.05
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(128) * 3.0, jnp.bfloat16)
    prepared = scheme.process_weights_after_loading(scheme.quantize_weight(w), CPU)
    y = np.asarray(scheme.apply(x, prepared, bias), F32)
    no_bias = np.asarray(scheme.apply(x, prepared), F32)
    want = (no_bias + np.asarray(bias, F32)).astype(ml_dtypes.bfloat16).astype(F32)
    np.testing.assert_array_equal(y, want)
    # One rounding of the fp32 sum gives a different answer on these inputs.
    qx = jquant.schemes.xla.quantize_activation(scheme, x)
    fp32 = (np.asarray(qx.dequantize(jnp.float32)) @ np.asarray(prepared.data.dequantize(jnp.float32)).T)
    once = (fp32.astype(F32) + np.asarray(bias, F32)).astype(ml_dtypes.bfloat16).astype(F32)
    assert not np.array_equal(once, want)


def test_dynamic_fp8_configs_quantize_activations_per_token():
    # vLLM (CUTLASS FP8, sm_89+): Fp8LinearMethod and CompressedTensorsW8A8Fp8 quantize dynamic
    # activations per token, also for per-tensor weight scales and an input strategy of "tensor".
    fp8 = jquant.scheme_from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    ct = jquant.scheme_from_config({"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                        "num_bits": 8, "type": "float", "strategy": "tensor"},
                                        "input_activations": {"num_bits": 8, "type": "float",
                                                              "strategy": "tensor", "dynamic": True}}}})
    for scheme in (fp8, ct):
        assert (scheme.weight.granularity, scheme.activation.mode) == ("tensor", "dynamic_per_token")
    # Per-token scales change the answer for rows of different magnitude.
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 64)).astype(F32)
    x = (rng.standard_normal((4, 64)) * np.array([1e-3, 1.0, 10.0, 300.0])[:, None]).astype(F32)
    qw = fp8.quantize_weight(w)
    y = np.asarray(fp8.apply(jnp.asarray(x), qw))
    amax = np.abs(x).max(-1, keepdims=True)
    sa = np.maximum(amax / F32(448), F32(1 / (448 * 512))).astype(F32)
    xq = np.clip(x / sa, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    want = (xq * sa) @ np.asarray(qw.dequantize(jnp.float32)).T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    per_tensor = np.asarray(jquant.get_scheme("fp8_e4m3_tensor").apply(jnp.asarray(x), qw))
    assert not np.allclose(per_tensor, want, rtol=1e-3)
