"""The int / FP8 non-finite contract at realistic sizes, reference presets (``like=``) on the existing
goldens, and options that contradict a format's name."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.checkpoint import to_checkpoint
from jquant.formats import preset_options, presets, quantize
from jquant.formats.integer import int_codes

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
SHAPE = (256, 4096)  # rows of 4096: XLA's CPU max reduction drops NaN at this width

# name: (format, options, block shape of one scale)
GRANULARITIES = {
    "int4_tensor": ("int4", {"granularity": "tensor"}, SHAPE),
    "int4_channel": ("int4", {"granularity": "channel"}, (1, 4096)),
    "uint4_channel": ("uint4", {"granularity": "channel"}, (1, 4096)),
    "uint4_group": ("uint4", {"group_size": 128}, (1, 128)),
    "int8_group_ct": ("int8", {"group_size": 128, "like": "compressed-tensors"}, (1, 128)),
    "uint8_channel_ct": ("uint8", {"granularity": "channel", "like": "compressed-tensors"}, (1, 4096)),
    "fp8_tensor": ("fp8_e4m3", {"granularity": "tensor"}, SHAPE),
    "fp8_channel": ("fp8_e4m3", {"granularity": "channel"}, (1, 4096)),
    "fp8_block": ("fp8_e4m3", {"granularity": "block"}, (128, 128)),
    "fp8_dynamic_tensor": ("fp8_e5m2", {"granularity": "dynamic_tensor"}, SHAPE),
    "fp8_token": ("fp8_e4m3", {"granularity": "token"}, (1, 4096)),
    "fp8_token_group": ("fp8_e4m3", {"granularity": "token_group", "group_size": 128}, (1, 128)),
}


@functools.lru_cache(maxsize=None)
def _quantizer(name):
    fmt, options, _ = GRANULARITIES[name]

    def run(x):
        qt = quantize(x, fmt, **options)
        return qt.scale.astype(jnp.float32), qt.dequantize(jnp.float32)
    return jax.jit(run)


@functools.lru_cache(maxsize=1)
def _clean():
    return np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _clean_result(name):
    return [np.asarray(a) for a in _quantizer(name)(_clean())]


def _poisoned_block(name, value):
    """The clean and poisoned results, and a mask of the elements sharing the poisoned scale."""
    _, _, block = GRANULARITIES[name]
    x = _clean().copy()
    row, col = 130, 1000
    x[row, col] = value
    mask = np.zeros(SHAPE, bool)
    r0, c0 = row // block[0] * block[0], col // block[1] * block[1]
    mask[r0:r0 + block[0], c0:c0 + block[1]] = True
    clean = _clean_result(name)
    bad = [np.asarray(a) for a in _quantizer(name)(x)]
    return clean, bad, mask


@pytest.mark.parametrize("name", sorted(GRANULARITIES))
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_value_poisons_exactly_its_block(name, value):
    """One NaN / ±Inf makes its block's scale non-finite and the whole block dequantize to non-finite
    values (Inf: finite values give code 0 or the zero point, Inf itself Inf / Inf = NaN, and
    0 · Inf = NaN, as torchao and compressed-tensors compute; compressed-tensors' NaN code is signed 0,
    which its zero point turns into ±Inf); every other block is unchanged. Per tensor, that is the
    tensor."""
    (clean_scale, clean_w), (scale, w), mask = _poisoned_block(name, value)
    assert not np.isfinite(scale).all()
    assert not np.isfinite(w[mask]).any()
    if np.isnan(value):
        assert np.isnan(w[mask]).all()
    np.testing.assert_array_equal(w[~mask], clean_w[~mask])
    assert np.isfinite(scale).sum() == np.isfinite(clean_scale).sum() - 1 or scale.size == 1


def test_like_presets_cover_the_reference_formats():
    table = presets()
    assert {"fp8_e4m3", "fp8_e5m2"} <= set(table["torchao"])
    assert {"fp8_e4m3", "int4", "uint4", "int8", "uint8"} <= set(table["compressed-tensors"])
    assert "int8" in table["gguf"]
    assert preset_options("torchao", "fp8_e4m3")["divide_dtype"] == jnp.float32


def _bf16(a):
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


@pytest.mark.parametrize("case,granularity", [("row_e4m3", "channel"), ("row_e5m2", "channel"),
                                              ("tensor_e4m3", "tensor"), ("row_bf16_e4m3", "channel")])
def test_torchao_golden_like(case, granularity):
    g = np.load(GOLDENS / "torchao_fp8.npz")
    x = _bf16(g["x_bf16" if "bf16" in case else "x_f32"])
    fmt = "fp8_e5m2" if "e5m2" in case else "fp8_e4m3"
    qt = jax.jit(lambda v: quantize(v, fmt, like="torchao", granularity=granularity))(x)
    np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), g[f"{case}_codes"])
    np.testing.assert_array_equal(np.asarray(qt.scale).reshape(g[f"{case}_scale"].shape), g[f"{case}_scale"])


@pytest.mark.parametrize("case,options", [("channel_bf16", {"granularity": "channel"}),
                                          ("block128_bf16", {"granularity": "block"}),
                                          ("block32_f32", {"granularity": "block", "block_size": (32, 32)})])
def test_compressed_tensors_fp8_golden_like(case, options):
    g = np.load(GOLDENS / "compressed_tensors_fp8.npz")
    x = _bf16(g["x_bf16" if case == "channel_bf16" else "x_block_bf16" if "128" in case else "x_block_f32"])
    qt = quantize(x, "fp8_e4m3", like="compressed-tensors", **options)
    assert qt.scale.dtype == x.dtype  # stored in the weight's dtype, as llm-compressor saves it
    np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), g[f"{case}_weight"])
    np.testing.assert_array_equal(np.asarray(qt.scale).view(g[f"{case}_weight_scale"].dtype),
                                  g[f"{case}_weight_scale"])


@pytest.mark.parametrize("case", ["int4_g32_asym", "int8_channel_sym", "bf16_int4_g32_sym",
                                  "bf16_int8_channel_asym"])
def test_compressed_tensors_int_golden_like(case):
    g = np.load(GOLDENS / "compressed_tensors_int.npz")
    bits, group, symmetric, bf16 = (int(v) for v in g[f"{case}_config"])
    weight = _bf16(g[f"{case}_weight"]) if bf16 else g[f"{case}_weight"]
    fmt = f"{'int' if symmetric else 'uint'}{bits}"
    qt = quantize(weight, fmt, like="compressed-tensors", group_size=group)
    tensors = to_checkpoint(qt, "compressed-tensors")
    for name in ("weight_packed", "weight_scale") + (() if symmetric else ("weight_zero_point",)):
        expected = g[f"{case}_{name}"]
        np.testing.assert_array_equal(np.asarray(tensors[name]).view(expected.dtype), expected, err_msg=name)


def test_gguf_like_is_q8_0():
    g = np.load(GOLDENS / "gguf_q8_0.npz")
    qt = quantize(g["x"], "int8", like="gguf")
    np.testing.assert_array_equal(np.asarray(qt.scale), g["d"])
    np.testing.assert_array_equal(np.asarray(int_codes(qt)), g["qs"])
    with pytest.raises(ValueError, match="group_size"):
        quantize(g["x"], "int8", like="gguf", group_size=64)


@pytest.mark.parametrize("fmt,options,match", [
    ("int4", {"bits": 8}, "use format 'int8'"),
    ("uint8", {"bits": 4}, "use format 'uint4'"),
    ("int4", {"symmetric": False}, "symmetric=True"),
    ("gguf_q8_0", {"group_size": 64}, "group_size=32"),
    ("gguf_q8_0", {"rounding": "half_even"}, "rounding='half_away'"),
])
def test_option_contradicting_the_format_raises(fmt, options, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.ones((4, 64), np.float32), fmt, **options)


def test_options_agreeing_with_the_format_pass():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    assert quantize(x, "int4", bits=4, symmetric=True).fmt == "int4"
    assert quantize(x, "gguf_q8_0", group_size=32, scale_dtype=np.float16).fmt == "int8"


def test_compressed_tensors_conventions_for_zeros():
    """compressed-tensors adds its float zero point 0.0 to x / s (-0.0 stores +0, a negative quotient
    that rounds to zero stores -0) and divides by an all-zero group's 0 scale before making it eps
    (zero point NaN → int8 0, stored 2**(b-1)); torchao keeps the zero scale (codes 0 / 0 = NaN)."""
    x = np.float32([[-0.0, 1.0, -1e-6, 448.0], [0.0, -0.0, 0.0, 0.0]])
    ct = quantize(x, "fp8_e4m3", like="compressed-tensors", granularity="channel")
    np.testing.assert_array_equal(np.asarray(ct.data).view(np.uint8), [[0x00, 0x38, 0x80, 0x7E], [0, 0, 0, 0]])
    ao = quantize(x, "fp8_e4m3", like="torchao", granularity="channel")
    np.testing.assert_array_equal(np.asarray(ao.data).view(np.uint8)[0], [0x80, 0x38, 0x80, 0x7E])
    assert float(ao.scale[1, 0]) == 0.0 and np.isnan(np.asarray(ao.data, np.float32)[1]).all()
    asym = quantize(x, "uint4", like="compressed-tensors", granularity="channel")
    assert int(asym.zero[1, 0]) == 8 and (np.asarray(int_codes(asym))[1] == 8).all()
    assert float(asym.scale[1, 0]) == float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("fmt,options", [("fp8_e4m3", {"granularity": "channel"}),
                                         ("int8", {"granularity": "channel"}),
                                         ("uint4", {"granularity": "channel", "like": "compressed-tensors"})])
def test_subnormal_blocks_are_exact_not_flushed(fmt, options):
    """XLA flushes float32 subnormals; a block of them still gets the IEEE (numpy / PyTorch) subnormal
    scale and the codes of x / s computed with it."""
    tiny = np.float32(2.0 ** -140)
    x = np.float32([[1.0, -0.5, 0.25, 0.75]]) * tiny
    qt = jax.jit(lambda v: quantize(v, fmt, **options))(x)
    scale = np.asarray(qt.scale, np.float32).reshape(())
    if fmt == "uint4":
        expected_scale = (x.max() - x.min()) / np.float32(15)
    else:
        expected_scale = np.abs(x).max() / np.float32(448 if fmt.startswith("fp8") else 127)
    assert 0 < expected_scale < np.finfo(np.float32).tiny
    assert scale.view(np.uint32) == expected_scale.view(np.uint32)
    quotient = x / expected_scale  # numpy keeps subnormals; the rounded scale can put amax past max
    if fmt.startswith("fp8"):
        expected = np.clip(quotient, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), expected)
    elif fmt == "uint4":  # compressed-tensors: zp = round(-8 - lo / s), codes round(x / s + zp) + 8
        zp = np.round(np.float32(-8) - x.min() / expected_scale)
        np.testing.assert_array_equal(np.asarray(int_codes(qt)), np.clip(np.round(quotient + zp), -8, 7) + 8)
    else:
        np.testing.assert_array_equal(np.asarray(int_codes(qt)), np.clip(np.round(quotient), -128, 127))
