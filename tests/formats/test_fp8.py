"""FP8 formats: torchao goldens, scale formulas, saturation, UE8M0, NaN/Inf, round-trip bound, errors."""

import functools
import pathlib

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jquant
from jquant.formats import fp8

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
# (mantissa bits, exponent of the smallest normal) of each format, for the half-step bound.
FORMAT_BITS = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return jax.jit if request.param else (lambda fn: fn)


def codes(qt):
    return np.asarray(qt.data).view(np.uint8)


def golden_input(g, name):
    a = g[name]
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def random(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ---- torchao 0.18 goldens -------------------------------------------------------------------------

TORCHAO_CASES = {
    "row_e4m3": ("x_f32", "fp8_e4m3", {"granularity": "channel"}),
    "row_e5m2": ("x_f32", "fp8_e5m2", {"granularity": "channel"}),
    "tensor_e4m3": ("x_f32", "fp8_e4m3", {"granularity": "tensor"}),
    "row_bf16_e4m3": ("x_bf16", "fp8_e4m3", {"granularity": "channel"}),
    "block_bf16_e4m3": ("x_block_bf16", "fp8_e4m3", {"granularity": "block", "block_size": (128, 128)}),
}


@pytest.mark.parametrize("case", sorted(TORCHAO_CASES))
def test_torchao_golden(case, maybe_jit):
    g = np.load(GOLDENS / "torchao_fp8.npz")
    input_name, fmt, opts = TORCHAO_CASES[case]
    # torchao divides in fp32 (compressed-tensors divides bf16 weights in bf16).
    quantize = maybe_jit(functools.partial(fp8.quantize_fp8, fmt=fmt, divide_dtype=jnp.float32, **opts))
    qt = quantize(jnp.asarray(golden_input(g, input_name)))
    expected_scale = g[f"{case}_scale"]
    np.testing.assert_array_equal(codes(qt), g[f"{case}_codes"])
    np.testing.assert_array_equal(np.asarray(qt.scale).reshape(expected_scale.shape), expected_scale)


def test_bf16_division_dtype_matters():
    """compressed-tensors rounds x / s to bf16 before the FP8 cast, torchao does not: the default
    (x's dtype) differs from torchao's bytes on the bf16 golden, which divide_dtype=float32 matches."""
    g = np.load(GOLDENS / "torchao_fp8.npz")
    qt = fp8.quantize_fp8(jnp.asarray(golden_input(g, "x_bf16")), granularity="channel")
    assert (codes(qt) != g["row_bf16_e4m3_codes"]).any()


# ---- scale formulas --------------------------------------------------------------------------------

def test_weight_scale_is_amax_over_max_and_zero_blocks_get_eps():
    x = np.array([[1.0, -896.0], [0.0, 0.0]], np.float32)
    qt = fp8.quantize_fp8(x, granularity="channel")
    np.testing.assert_array_equal(np.asarray(qt.scale), [[2.0], [np.finfo(np.float32).eps]])
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), x)


def test_block_pads_edges_and_scale_grid_is_ceil():
    x = random((5, 7), seed=1)
    qt = fp8.quantize_fp8(x, granularity="block", block_size=(4, 4))
    assert qt.scale.shape == (2, 2) and qt.block == (4, 4)
    amax = np.abs(np.asarray(x))
    expected = [[amax[:4, :4].max(), amax[:4, 4:].max()], [amax[4:, :4].max(), amax[4:, 4:].max()]]
    np.testing.assert_array_equal(np.asarray(qt.scale), np.float32(expected) / np.float32(448))


def test_per_token_scale_has_vllm_floor():
    x = np.stack([np.linspace(-3, 3, 16), np.linspace(-1e-4, 1e-4, 16)]).astype(np.float32)
    qt = fp8.quantize_fp8_per_token(x)
    assert qt.block == (1, 16) and qt.scale.shape == (2, 1)
    floor = np.float32(1.0) / np.float32(448 * 512)
    np.testing.assert_array_equal(np.asarray(qt.scale)[:, 0], [np.float32(3) / np.float32(448), floor])
    dynamic = fp8.quantize_fp8_dynamic_per_tensor(x)
    np.testing.assert_array_equal(np.asarray(dynamic.scale), [[np.float32(3) / np.float32(448)]])


def test_per_token_group_scale_formula():
    x = np.concatenate([np.full((2, 4), 0.0), np.linspace(-5, 7, 8).reshape(2, 4)], axis=1).astype(np.float32)
    qt = fp8.quantize_fp8_per_token_group(x, group_size=4)
    assert qt.scale.shape == (2, 2) and qt.block == (1, 4)
    eps = np.float32(1e-10) / np.float32(448)
    amax = np.abs(x[:, 4:]).max(axis=1)
    np.testing.assert_array_equal(np.asarray(qt.scale), np.stack([np.full(2, eps), amax / np.float32(448)], 1))
    np.testing.assert_array_equal(codes(qt)[:, :4], 0)


@pytest.mark.parametrize("scale", [2.0, np.float32([2.0]), np.full((3, 1), 2.0, np.float32)])
def test_static_scale(scale):
    x = np.float32([[1.0, -3.0], [96.0, 0.5], [-0.25, 7.0]])
    qt = jquant.quantize(x, "fp8_e4m3", scale=scale)
    assert qt.option("granularity") == "static"
    np.testing.assert_array_equal(np.asarray(qt.data, np.float32), x / 2)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), x)


# ---- saturation and non-finite values --------------------------------------------------------------

@pytest.mark.parametrize("fmt, limit", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_static_saturates_inf_and_keeps_nan(fmt, limit):
    x = np.float32([limit * 1.07, -limit * 3, np.inf, -np.inf, np.nan, 1.0])
    qt = fp8.quantize_fp8_static(x, 1.0, fmt=fmt)
    values = np.asarray(qt.data, np.float32)
    np.testing.assert_array_equal(values[:4], [limit, -limit, limit, -limit])
    assert np.isnan(values[4]) and values[5] == 1.0


def test_dynamic_nan_or_inf_poisons_only_its_block():
    x = np.array(random((4, 8), seed=2))
    x[1, 3], x[2, 5] = np.nan, np.inf
    for qt in (fp8.quantize_fp8(x, granularity="channel"), fp8.quantize_fp8_per_token(x)):
        out = np.asarray(qt.dequantize())
        assert np.isnan(qt.scale[1, 0]) and np.isinf(qt.scale[2, 0])
        assert np.isnan(out[1]).all() and np.isnan(out[2, 5]) and np.isfinite(out[[0, 3]]).all()


def test_saturating_cast_is_needed():
    """XLA's cast alone turns out-of-range values into NaN for e4m3fn; saturating_cast clips."""
    big = jnp.float32([500.0, -1e6])
    assert np.isnan(np.asarray(big.astype(jnp.float8_e4m3fn), np.float32)).all()
    np.testing.assert_array_equal(np.asarray(fp8.saturating_cast(big, "fp8_e4m3"), np.float32), [448, -448])


# ---- UE8M0 -----------------------------------------------------------------------------------------

def test_round_scale_up_to_pow2_is_exact():
    s = jnp.float32([0.75, 1.0, 1.0000001, 2.0**-20, 3.0 * 2.0**-30, np.inf, np.nan])
    out = np.asarray(fp8.round_scale_up_to_pow2(s))
    np.testing.assert_array_equal(out[:5], [1.0, 1.0, 2.0, 2.0**-20, 2.0**-28])
    assert np.isinf(out[5]) and np.isnan(out[6])


@pytest.mark.parametrize("quantize", [
    functools.partial(fp8.quantize_fp8_per_token_group, group_size=16, ue8m0=True),
    functools.partial(fp8.quantize_fp8, granularity="block", block_size=(4, 16), ue8m0=True),
], ids=["token_group", "block"])
def test_ue8m0_scales_are_powers_of_two_at_least_the_raw_scale(quantize):
    x = random((8, 64), seed=3) * 37.0
    raw = quantize(x, ue8m0=False).scale
    qt = quantize(x)
    mantissa, _ = np.frexp(np.asarray(qt.scale))
    assert (mantissa == 0.5).all()
    assert (qt.scale >= raw).all() and (qt.scale < 2 * raw).all()
    stored = quantize(x, scale_dtype=jnp.float8_e8m0fnu)
    assert stored.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(codes(stored), codes(qt))
    chex.assert_trees_all_equal(stored.dequantize(), qt.dequantize())


# ---- jit, registry, round-trip bound -----------------------------------------------------------------

QUANTIZERS = {
    "tensor": functools.partial(fp8.quantize_fp8, granularity="tensor"),
    "channel_axis0": functools.partial(fp8.quantize_fp8, granularity="channel", axis=0),
    "block": functools.partial(fp8.quantize_fp8, granularity="block", block_size=(8, 16)),
    "block_e5m2_ue8m0": functools.partial(fp8.quantize_fp8, fmt="fp8_e5m2", granularity="block",
                                          block_size=(8, 16), ue8m0=True),
    "dynamic_tensor": fp8.quantize_fp8_dynamic_per_tensor,
    "token": fp8.quantize_fp8_per_token,
    "token_group": functools.partial(fp8.quantize_fp8_per_token_group, group_size=16),
    "static": functools.partial(fp8.quantize_fp8_static, scale=0.01),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_jit_matches_eager(name):
    x = random((20, 48), seed=4) * 3.0
    eager = QUANTIZERS[name](x)
    jitted = jax.jit(QUANTIZERS[name])(x)
    chex.assert_trees_all_equal(jax.tree.map(lambda a: np.asarray(a).view(np.uint8), jitted),
                                jax.tree.map(lambda a: np.asarray(a).view(np.uint8), eager))
    chex.assert_trees_all_equal(jax.jit(lambda q: q.dequantize())(jitted), eager.dequantize())


@pytest.mark.parametrize("granularity, opts", [
    ("tensor", {}), ("channel", {"axis": 1}), ("block", {"block_size": (8, 16)}),
    ("dynamic_tensor", {}), ("token", {}), ("token_group", {"group_size": 16}),
])
def test_registry_dispatch(granularity, opts):
    x = random((16, 32), seed=5)
    qt = jquant.quantize(x, "fp8_e5m2", granularity=granularity, **opts)
    assert qt.fmt == "fp8_e5m2" and qt.option("granularity") == granularity
    assert qt.data.dtype == jnp.float8_e5m2 and qt.scale.ndim == 2 and qt.dtype == jnp.float32
    assert jquant.dequantize(qt, jnp.bfloat16).dtype == jnp.bfloat16


def half_step(values, fmt):
    """Half the FP8 spacing at each |value| (in code units), the subnormal spacing below the normals."""
    mantissa_bits, min_exponent = FORMAT_BITS[fmt]
    magnitude = np.maximum(np.abs(values), 2.0 ** min_exponent)
    return 2.0 ** (np.floor(np.log2(magnitude)) - mantissa_bits - 1)


@functools.lru_cache(maxsize=None)
def jitted_round_trip(name, fmt):
    def round_trip(x):
        qt = QUANTIZERS[name](x, fmt=fmt)
        return qt.dequantize(), qt.expand(qt.scale.astype(jnp.float32)), qt.data.astype(jnp.float32)
    return jax.jit(round_trip)


# One shape (5 rows: not a multiple of the 8-row blocks) keeps the compilations few.
@given(x=hnp.arrays(np.float32, (5, 48), elements=st.floats(-1e4, 1e4, width=32)).filter(
           lambda a: np.abs(a).max() > 0),
       name=st.sampled_from(sorted(QUANTIZERS)), fmt=st.sampled_from(sorted(FORMAT_BITS)))
def test_round_trip_within_half_a_step(x, name, fmt):
    dequantized, scale, values = (np.asarray(a, np.float64) for a in jitted_round_trip(name, fmt)(x))
    scaled = x.astype(np.float64) / scale
    limit = fp8.fp8_max(fmt)
    # Static scales may clip; beyond ±max the error is the clipping, checked separately.
    inside = np.abs(scaled) <= limit * (1 + 2.0**-20)
    error = np.abs(dequantized - x)
    bound = half_step(scaled, fmt) * scale * (1 + 2.0**-20) + np.abs(x) * 2.0**-22
    assert (error[inside] <= bound[inside]).all()
    np.testing.assert_array_equal(np.abs(values[~inside]), limit)


# ---- bad inputs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda: fp8.quantize_fp8(np.arange(4)), TypeError, "floating"),
    (lambda: fp8.quantize_fp8(np.float32(1.0)), ValueError, "at least 1 dimension"),
    (lambda: fp8.quantize_fp8(np.zeros((0, 4), np.float32)), ValueError, "empty"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), fmt="fp8_e3m4"), ValueError, "fmt"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), granularity="row"), ValueError, "granularity"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), granularity="block"), ValueError, "2 dimensions"),
    (lambda: fp8.quantize_fp8(np.ones((4, 4), np.float32), granularity="block", block_size=(0, 4)),
     ValueError, "block_size"),
    (lambda: fp8.quantize_fp8(np.ones((4, 4), np.float32), granularity="channel", axis=2),
     ValueError, "axis"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), scale_dtype=jnp.float8_e8m0fnu), ValueError, "ue8m0"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), scale_dtype=jnp.int8), TypeError, "scale_dtype"),
    (lambda: fp8.quantize_fp8(np.ones(4, np.float32), rounding="up"), TypeError, "rounding"),
    (lambda: fp8.quantize_fp8_per_token_group(np.ones((2, 48), np.float32)), ValueError, "divisible"),
    (lambda: fp8.quantize_fp8_per_token_group(np.ones((2, 48), np.float32), group_size=0),
     ValueError, "group_size"),
    (lambda: fp8.quantize_fp8_static(np.ones((2, 4), np.float32), np.ones((4, 2), np.float32)),
     ValueError, "does not fit"),
    (lambda: fp8.quantize_fp8_static(np.ones((2, 4), np.float32), np.int32(2)), TypeError, "floating"),
    (lambda: jquant.quantize(np.ones(4, np.float32), "fp8_e4m3", granularity="static"), ValueError, "scale="),
    (lambda: jquant.quantize(np.ones(4, np.float32), "fp8_e4m3", granularity="channel", scale=1.0),
     ValueError, "scale="),
    (lambda: jquant.quantize(np.ones(4, np.float32), "fp8_e4m3", granularity="rows"), ValueError, "granularity"),
])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
