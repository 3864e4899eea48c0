"""int2..int8 / uint2..uint8 formats, quantize_int_with_params (GPTQ act-order) and GGUF Q8_0."""

import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jquant.formats import formats, quantize
from jquant.formats.integer import (BITS, GGUF_Q8_0_OPTIONS, int_codes, quantize_int,
                                    quantize_int_with_params)

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
ALL_FORMATS = [f"{p}{b}" for b in BITS for p in ("int", "uint")]


def _normal(seed, shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _step(qt):
    """The quantization step of every element (the scale of its block), float32."""
    return np.asarray(qt.expand(qt.scale.astype(jnp.float32)))


def test_registered():
    assert set(ALL_FORMATS + ["gguf_q8_0"]) <= set(formats())


@functools.lru_cache(maxsize=None)
def _quantize_dequantize(fmt, granularity, group):
    """One jitted round trip per option set (eager dispatch would compile every op separately)."""
    opts = {"group_size": group} if granularity == "group" else {}

    def run(x):
        qt = quantize(x, fmt, granularity=granularity, **opts)
        return qt.dequantize(), qt.expand(qt.scale.astype(jnp.float32))
    return jax.jit(run)


@settings(max_examples=15)
@given(fmt=st.sampled_from(ALL_FORMATS), granularity=st.sampled_from(["tensor", "channel", "group"]),
       group=st.sampled_from([8, 32]), magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**16))
def test_round_trip_within_half_step(fmt, granularity, group, magnitude, seed):
    x = _normal(seed, (3, 64), magnitude)
    x[seed % 3] *= 10.0  # blocks of different magnitudes
    w, step = _quantize_dequantize(fmt, granularity, group)(x)
    err = np.abs(np.asarray(w) - x)
    bound = np.asarray(step) / 2 * (1 + 1e-5) + 1e-6 * np.abs(x)
    assert np.all(err <= bound), float(np.max(err - bound))


@pytest.mark.parametrize("symmetric_range", ["restricted", "full"])
def test_symmetric_scale_conventions(symmetric_range):
    x = _normal(1, (4, 64))
    qt = quantize(x, "int4", group_size=32, symmetric_range=symmetric_range)
    divisor = np.float32(7.0 if symmetric_range == "restricted" else 7.5)
    amax = np.abs(x.reshape(4, 2, 32)).max(-1)
    np.testing.assert_array_equal(np.asarray(qt.scale), amax / divisor)  # IEEE division, like torch
    codes = np.asarray(int_codes(qt))
    assert codes.min() >= -8 and codes.max() <= 7
    if symmetric_range == "restricted":
        assert codes.min() >= -7  # -x quantizes to -q


def test_asymmetric_range_contains_zero():
    x = np.abs(_normal(2, (4, 64))) + 1.0  # all positive: min is forced to 0
    qt = quantize(x, "uint4", group_size=32)
    np.testing.assert_array_equal(np.asarray(qt.zero), 0)
    np.testing.assert_array_equal(np.asarray(qt.scale), x.reshape(4, 2, 32).max(-1) / np.float32(15))


@pytest.mark.parametrize("fmt,bits", [("int2", 2), ("uint3", 3), ("int4", 4), ("uint4", 4), ("int8", 8)])
def test_codes_are_packed(fmt, bits):
    qt = quantize(_normal(3, (8, 64)), fmt, group_size=32)
    assert qt.data.dtype == jnp.uint8 and qt.data.nbytes == 8 * 64 * bits // 8
    assert qt.pack_axis == (None if bits == 8 else 1)
    assert qt.scale.shape == (8, 2) and qt.block == (1, 32)
    if fmt.startswith("uint"):
        assert qt.zero.dtype == jnp.uint8 and qt.zero.shape == qt.scale.shape
    else:
        assert qt.zero is None


def test_axis_zero_and_scale_dtype():
    x = _normal(4, (64, 6))
    qt = quantize(x, "uint4", axis=0, group_size=16, scale_dtype=jnp.bfloat16)
    assert qt.block == (16, 1) and qt.scale.shape == (4, 6) and qt.scale.dtype == jnp.bfloat16
    assert qt.data.shape == (32, 6) and qt.pack_axis == 0
    err = np.abs(np.asarray(qt.dequantize()) - x)
    assert np.all(err <= _step(qt) * 0.52)


def test_logical_dtype_kept():
    x = jnp.asarray(_normal(5, (2, 32)), jnp.bfloat16)
    qt = quantize(x, "int8")
    assert qt.dtype == jnp.bfloat16 and qt.dequantize(qt.dtype).dtype == jnp.bfloat16
    assert qt.dequantize().dtype == jnp.float32 and qt.dequantize(jnp.float32).dtype == jnp.float32


class JitTest(chex.TestCase):
    """Quantize + dequantize give the same leaves and values under jit and eagerly."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_quantize_and_dequantize(self):
        x = _normal(6, (4, 64))
        for fmt in ("int3", "uint4", "int8", "gguf_q8_0"):
            opts = {} if fmt == "gguf_q8_0" else {"group_size": 32}

            @self.variant
            def run(x, fmt=fmt, opts=opts):
                qt = quantize(x, fmt, **opts)
                return qt, qt.dequantize()

            reference = quantize(x, fmt, **opts)
            chex.assert_trees_all_equal(run(x), (reference, reference.dequantize()))


def test_rounding_modes_on_ties():
    x = np.array([[7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0]], np.float32)  # amax 7 → s = 1
    even = np.asarray(int_codes(quantize(x, "int4", granularity="tensor")))
    away = np.asarray(int_codes(quantize(x, "int4", granularity="tensor", rounding="half_away")))
    np.testing.assert_array_equal(even, [[7, 0, 2, 2, 0, -2, -2, 3]])
    np.testing.assert_array_equal(away, [[7, 1, 2, 3, -1, -2, -3, 3]])


def test_compressed_tensors_arithmetic_in_bfloat16():
    x = jnp.asarray(_normal(13, (4, 64)), jnp.bfloat16)
    x = x.at[2, :32].set(0)
    qt = quantize(x, "uint4", group_size=32, arithmetic="compressed-tensors", scale_dtype=jnp.bfloat16)
    # A zero scale becomes bfloat16's eps (compressed-tensors avoids dividing by 0); the block stays 0.
    assert float(qt.scale[2, 0]) == float(jnp.finfo(jnp.bfloat16).eps)
    w = np.asarray(qt.dequantize(jnp.float32))
    assert np.all(w[2, :32] == 0)
    # bfloat16 rounding of x/s + zp can move a code by one step at most.
    assert np.all(np.abs(w - np.asarray(x, np.float32)) <= _step(qt) * 1.02)
    sym = quantize(x, "int4", group_size=32, arithmetic="compressed-tensors")
    np.testing.assert_array_equal(  # the "full" range is that arithmetic's default
        np.asarray(sym.scale), np.asarray(quantize(x, "int4", group_size=32, arithmetic="compressed-tensors",
                                                   symmetric_range="full").scale))


def test_all_zero_group_is_exact_zero():
    x = _normal(7, (4, 64))
    x[1, 32:] = 0.0
    for fmt in ("int4", "uint4"):
        qt = quantize(x, fmt, group_size=32)
        assert float(qt.scale[1, 1]) == 0.0
        w = np.asarray(qt.dequantize())
        assert np.all(np.isfinite(w)) and np.all(w[1, 32:] == 0.0)


@pytest.mark.parametrize("fmt,arithmetic", [("int4", "float32"), ("uint4", "float32"), ("int8", "float32"),
                                            ("uint4", "compressed-tensors")])
def test_nan_and_inf_poison_only_their_block(fmt, arithmetic):
    x = _normal(8, (4, 64))
    clean = np.asarray(quantize(x, fmt, group_size=32, arithmetic=arithmetic).dequantize())
    bad = x.copy()
    bad[0, 3], bad[1, 40] = np.nan, np.inf
    qt = quantize(bad, fmt, group_size=32, arithmetic=arithmetic)
    w = np.asarray(qt.dequantize())
    assert np.all(np.isnan(w[0, :32])) and not np.any(np.isfinite(w[1, 32:]))
    np.testing.assert_array_equal(w[0, 32:], clean[0, 32:])
    np.testing.assert_array_equal(w[1, :32], clean[1, :32])


def test_quantize_with_params_matches_formula_and_act_order():
    n, k, group = 4, 64, 16
    rng = np.random.default_rng(9)
    scale = rng.uniform(0.01, 0.1, (n, k // group)).astype(np.float32)
    zero = rng.integers(0, 16, (n, k // group))
    g_idx = (np.argsort(rng.permutation(k)) // group).astype(np.int32)
    x = _normal(10, (n, k), 0.3)
    qt = quantize_int_with_params(x, 4, scale, zero, g_idx, axis=1)
    assert qt.fmt == "uint4" and qt.block == (1, group)
    np.testing.assert_array_equal(np.asarray(qt.group_index), g_idx)
    s, z = scale[:, g_idx], zero[:, g_idx]
    expected = np.clip(np.round(x / s) + z, 0, 15)
    np.testing.assert_array_equal(np.asarray(int_codes(qt)), expected)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), ((expected - z) * s).astype(np.float32))


def test_quantize_with_params_symmetric_and_trivial_group_index():
    x = _normal(11, (2, 32))
    scale = np.full((2, 2), 0.25, np.float32)
    qt = quantize_int_with_params(x, 4, scale, group_index=np.arange(32) // 16, scale_dtype=jnp.float16)
    assert qt.fmt == "int4" and qt.group_index is None and qt.scale.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(int_codes(qt)), np.clip(np.round(x / 0.25), -8, 7))


def test_quantize_with_params_jits():
    x = _normal(12, (2, 32))
    scale, zero = np.full((2, 2), 0.1, np.float32), np.full((2, 2), 3)
    g_idx = np.arange(32, dtype=np.int32)[::-1] // 16
    eager = quantize_int_with_params(x, 3, scale, zero, g_idx)
    jitted = jax.jit(lambda x, s, z, g: quantize_int_with_params(x, 3, s, z, g))(x, scale, zero, g_idx)
    chex.assert_trees_all_equal(eager, jitted)


def test_gguf_q8_0_matches_gguf_py():
    golden = np.load(GOLDENS / "gguf_q8_0.npz")
    qt = quantize(golden["x"], "gguf_q8_0")
    assert qt.fmt == "int8" and qt.scale.dtype == jnp.float16 and qt.block == (1, 32)
    np.testing.assert_array_equal(np.asarray(qt.scale), golden["d"])
    np.testing.assert_array_equal(np.asarray(int_codes(qt)), golden["qs"])
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), golden["dequant"])
    same = quantize(golden["x"], "int8", **GGUF_Q8_0_OPTIONS)
    chex.assert_trees_all_equal(qt, same)


# ---- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("x,err,match", [
    (np.ones((4, 32), np.int32), TypeError, "floating dtype"),
    (np.ones((0, 32), np.float32), ValueError, "empty"),
    (np.float32(1.0), ValueError, "at least 1 dimension"),
    (np.ones((4, 48), np.float32), ValueError, "not divisible by group_size 32"),
])
def test_bad_x(x, err, match):
    with pytest.raises(err, match=match):
        quantize(x, "int4", group_size=32)


@pytest.mark.parametrize("options,match", [
    ({"granularity": "row"}, "granularity must be one of"),
    ({"granularity": "tensor", "group_size": 32}, "takes no group_size"),
    ({"granularity": "group"}, "needs a group_size"),
    ({"group_size": 0}, "group_size must be positive"),
    ({"rounding": "stochastic"}, "rounding must be one of"),
    ({"symmetric_range": "wide"}, "symmetric_range must be one of"),
    ({"scale_dtype": jnp.int8}, "scale_dtype must be a floating dtype"),
    ({"arithmetic": "float64"}, "arithmetic must be one of"),
    ({"arithmetic": "compressed-tensors", "rounding": "half_away"}, "must keep their defaults"),
    ({"arithmetic": "compressed-tensors", "reciprocal": True}, "must keep their defaults"),
    ({"axis": 2}, "axis=2 is out of range"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.ones((4, 32), np.float32), "int4", **options)


def test_bad_bits_packing_and_unknown_option():
    x = np.ones((4, 32), np.float32)
    for bits in (1, 9, 4.0, True):
        with pytest.raises(ValueError, match="bits must be an int"):
            quantize_int(x, bits=bits, symmetric=True)
        with pytest.raises(ValueError, match="bits must be an int"):
            quantize_int_with_params(x, bits, np.ones((4, 1), np.float32))
    with pytest.raises(ValueError, match="multiple of 8 to pack 3-bit"):
        quantize(np.ones((4, 12), np.float32), "int3")
    with pytest.raises(ValueError, match="symmetric int formats only"):
        quantize(x, "uint4", symmetric_range="full")
    with pytest.raises(TypeError, match="unexpected keyword"):
        quantize(x, "int4", block_size=32)


def test_bad_params():
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match=r"scale with shape \(4, 3\)"):
        quantize_int_with_params(x, 4, np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match="scale must have a floating dtype"):
        quantize_int_with_params(x, 4, np.ones((4, 2), np.int32))
    with pytest.raises(ValueError, match=r"zero with shape \(4, 1\)"):
        quantize_int_with_params(x, 4, np.ones((4, 2), np.float32), np.ones((4, 1)))
    with pytest.raises(ValueError, match=r"group_index must be an integer array of shape \(32,\)"):
        quantize_int_with_params(x, 4, np.ones((4, 2), np.float32), group_index=np.zeros(16, np.int32))
    with pytest.raises(ValueError, match=r"group_index values must lie in \[0, 2\)"):
        quantize_int_with_params(x, 4, np.ones((4, 2), np.float32), group_index=np.full(32, 2, np.int32))
    with pytest.raises(ValueError, match="group_index needs groups along axis 1 only"):
        quantize_int_with_params(x, 4, np.ones((2, 2), np.float32), group_index=np.zeros(32, np.int32))
