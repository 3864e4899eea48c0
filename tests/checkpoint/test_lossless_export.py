"""Every checkpoint layout stores a QTensor quantized for it exactly, and refuses to round one that is not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant import scheme_from_config
from jquant.formats import fp8
from qtensor_checks import assert_same_qtensor


def _x(shape=(32, 128), seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    # Adversarial rows: all zero, powers of two ± an ulp, -0.0, near float16's largest value.
    x = x.at[0].set(0.0).at[1, :4].set(jnp.array([1.0, np.nextafter(1.0, 2.0), -0.0, 2.0 ** -14]))
    return x.at[2].multiply(6e4)


def _gptq_scheme(sym):
    # Asymmetric: gptq_v2, since v1 (zero - 1) refuses the zero point 0 of an all-positive group.
    return scheme_from_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": sym,
                               "checkpoint_format": "gptq" if sym else "gptq_v2"})


# name: (layout, quantize x → QTensor quantized for the layout, to_checkpoint options, from_checkpoint options)
CASES = {
    "gptq_int4": ("gptq", lambda x: jquant.quantize(x, "int4", axis=1, group_size=32, scale_dtype=jnp.float16), {}, {}),
    "gptq_v2_uint3": ("gptq", lambda x: jquant.quantize(x, "uint3", axis=1, group_size=64, scale_dtype=jnp.float16),
                      {"checkpoint_format": "gptq_v2"}, {"checkpoint_format": "gptq_v2"}),
    "gptq_scheme": ("gptq", lambda x: _gptq_scheme(False).quantize_weight(x), {"checkpoint_format": "gptq_v2"},
                    {"checkpoint_format": "gptq_v2"}),
    "gptq_bf16_scales": ("gptq", lambda x: jquant.quantize(x, "uint8", axis=1, group_size=-1,
                                                           scale_dtype=jnp.bfloat16),
                         {"checkpoint_format": "gptq_v2"}, {"checkpoint_format": "gptq_v2"}),
    "awq_uint4": ("awq", lambda x: jquant.quantize(x, "uint4", axis=1, group_size=64, scale_dtype=jnp.float16), {}, {}),
    "ct_int4": ("compressed-tensors", lambda x: jquant.quantize(x, "int4", axis=1, group_size=32), {}, {}),
    "ct_uint8_channel": ("compressed-tensors", lambda x: jquant.quantize(x, "uint8", axis=1), {}, {}),
    "ct_fp8_channel": ("compressed-tensors", lambda x: fp8.quantize_fp8(x, granularity="channel"), {}, {}),
    "ct_fp8_block_bf16": ("compressed-tensors", lambda x: fp8.quantize_fp8(x, granularity="block", block_size=(16, 32),
                                                                           scale_dtype=jnp.bfloat16),
                          {}, {"block_size": (16, 32)}),
    "modelopt_fp8": ("modelopt", lambda x: fp8.quantize_fp8(x, granularity="tensor"), {}, {}),
    "fp8_channel": ("fp8", lambda x: fp8.quantize_fp8(x, granularity="channel"), {}, {}),
    "fp8_block": ("fp8-block", lambda x: fp8.quantize_fp8(x, granularity="block", block_size=(16, 32)),
                  {}, {"block_size": (16, 32)}),
    "gpt_oss": ("gpt-oss", lambda x: jquant.quantize(x, "mxfp4"), {}, {}),
    "ct_nvfp4": ("compressed-tensors", lambda x: jquant.quantize(x, "nvfp4"), {}, {}),
    "modelopt_nvfp4": ("modelopt", lambda x: jquant.quantize(x, "nvfp4", convention="modelopt"), {}, {}),
    "bnb_nf4_dq": ("bnb", lambda x: jquant.quantize(x, "nf4", blocksize=64, compress_statistics=True), {}, {}),
    "bnb_fp4": ("bnb", lambda x: jquant.quantize(x, "fp4_bnb", blocksize=64), {}, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_for_the_layout_round_trips_exactly(case):
    layout, quantize, to_opts, from_opts = CASES[case]
    qt = quantize(_x())
    back = jquant.from_checkpoint(jquant.to_checkpoint(qt, layout, **to_opts), layout, **from_opts)
    assert back.dtype == jnp.float32  # the logical dtype is float32 whatever the stored scales' dtype
    assert_same_qtensor(back, qt)
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(qt.dequantize()))


MISMATCHED = {
    "gptq_float32_scales": ("gptq", lambda x: jquant.quantize(x, "int4", axis=1, group_size=32),
                            r"gptq: tensor 'scales' \(float32 QTensor scales stored as float16\).*scale_dtype=jnp.float16"),
    "awq_float32_scales": ("awq", lambda x: jquant.quantize(x, "uint4", axis=1, group_size=32),
                           r"awq: tensor 'scales' \(float32 .*scale_dtype=jnp.float16"),
    "modelopt_ct_convention": ("modelopt", lambda x: jquant.quantize(x, "nvfp4"),
                               r"modelopt/nvfp4: tensor 'weight_scale_2'.*convention='modelopt'"),
    "ct_modelopt_convention": ("compressed-tensors", lambda x: jquant.quantize(x, "nvfp4", convention="modelopt"),
                               r"tensor 'weight_global_scale'.*convention='compressed-tensors'"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHED))
def test_mismatched_qtensor_raises_unless_lossy(case):
    layout, quantize, pattern = MISMATCHED[case]
    qt = quantize(_x())
    with pytest.raises(ValueError, match=pattern + r".*or pass lossy=True to round them"):
        jquant.to_checkpoint(qt, layout)
    with pytest.warns(UserWarning, match=r"changes \d+ of \d+ values, by up to .*\(lossy=True\)"):
        tensors = jquant.to_checkpoint(qt, layout, lossy=True)
    back = jquant.from_checkpoint(tensors, layout)
    assert back.fmt == qt.fmt and back.shape == qt.shape


def test_layouts_that_store_exactly_accept_lossy():
    qt = fp8.quantize_fp8(_x(), granularity="channel")
    assert sorted(jquant.to_checkpoint(qt, "fp8", lossy=True)) == ["weight", "weight_scale"]
    with pytest.raises(TypeError, match="lossy must be a bool"):
        jquant.to_checkpoint(qt, "fp8", lossy="yes")


def test_float16_overflow_is_reported():
    qt = jquant.quantize(_x(), "int4", axis=1, group_size=32, scale_dtype=jnp.float16)
    huge = qt.replace(scale=qt.scale.astype(jnp.float32).at[5, 0].set(1e5))  # past float16's 65504
    with pytest.raises(ValueError, match="changes 1 of 128 values, by up to inf"):
        jquant.to_checkpoint(huge, "gptq")
