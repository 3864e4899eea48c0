"""NVFP4: torchao (ModelOpt convention) and compressed-tensors goldens, per-tensor scale options,
zero / NaN handling, packing, round-trip bound, jit parity and bad inputs."""

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
from jquant.formats import nvfp4
from jquant.formats.packing import unpack_bits

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return jax.jit if request.param else (lambda fn: fn)


def golden_input(g, name):
    a = g[name]
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def scale_bytes(qt):
    return np.asarray(qt.scale).view(np.uint8)


def bf16_bits(array):
    return np.asarray(array).view(np.uint16)


def random(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ---- torchao 0.18 NVFP4Tensor (ModelOpt convention) ---------------------------------------------------

@pytest.mark.parametrize("input_name", ["x_f32", "x_bf16"])
@pytest.mark.parametrize("case", ["tensor", "static", "none"])
def test_torchao_golden(input_name, case, maybe_jit):
    g = np.load(GOLDENS / "torchao_nvfp4.npz")
    key = f"{input_name}_{case}_"
    global_scale = {"tensor": "dynamic", "static": g.get(key + "per_tensor_scale"), "none": None}[case]
    quantize = maybe_jit(functools.partial(nvfp4.quantize_nvfp4, convention="modelopt",
                                           global_scale=global_scale))
    qt = quantize(golden_input(g, input_name))
    np.testing.assert_array_equal(np.asarray(qt.data), g[key + "packed"])
    np.testing.assert_array_equal(scale_bytes(qt), g[key + "scale"])
    if case != "none":
        np.testing.assert_array_equal(np.asarray(qt.global_scale), g[key + "per_tensor_scale"])
    np.testing.assert_array_equal(bf16_bits(qt.dequantize(jnp.bfloat16)), g[key + "dequant_bf16"])
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), g[key + "dequant_f32"])


@pytest.mark.parametrize("like", ["torchao", "modelopt"])
@pytest.mark.parametrize("input_name", ["x_f32", "x_bf16"])
def test_torchao_golden_preset(input_name, like):
    g = np.load(GOLDENS / "torchao_nvfp4.npz")
    key = f"{input_name}_tensor_"
    qt = jquant.quantize(golden_input(g, input_name), "nvfp4", like=like)
    np.testing.assert_array_equal(np.asarray(qt.data), g[key + "packed"])
    np.testing.assert_array_equal(scale_bytes(qt), g[key + "scale"])
    np.testing.assert_array_equal(np.asarray(qt.global_scale), g[key + "per_tensor_scale"])


# ---- compressed-tensors 0.20.1 ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["w_f32", "w_bf16"])
def test_compressed_tensors_golden_preset(case):
    g = np.load(GOLDENS / "compressed_tensors_nvfp4.npz")
    qt = jquant.quantize(golden_input(g, case), "nvfp4", like="compressed-tensors")
    np.testing.assert_array_equal(np.asarray(qt.data), g[f"{case}_weight_packed"])
    np.testing.assert_array_equal(scale_bytes(qt), g[f"{case}_weight_scale"])
    with pytest.raises(ValueError, match="convention='compressed-tensors'"):
        jquant.quantize(golden_input(g, case), "nvfp4", like="compressed-tensors", convention="modelopt")


@pytest.mark.parametrize("case", ["w_f32", "w_bf16", "w_bf16_noglobal"])
def test_compressed_tensors_weight_golden(case, maybe_jit):
    g = np.load(GOLDENS / "compressed_tensors_nvfp4.npz")
    with_global = not case.endswith("noglobal")
    global_scale = "dynamic" if with_global else None
    quantize = maybe_jit(functools.partial(nvfp4.quantize_nvfp4, global_scale=global_scale))
    qt = quantize(golden_input(g, case.removesuffix("_noglobal")))
    np.testing.assert_array_equal(np.asarray(qt.data), g[f"{case}_weight_packed"])
    np.testing.assert_array_equal(scale_bytes(qt), g[f"{case}_weight_scale"])
    if with_global:
        np.testing.assert_array_equal(np.asarray(qt.global_scale).reshape(1),
                                      g[f"{case}_weight_global_scale"])
        np.testing.assert_array_equal(bf16_bits(qt.dequantize(jnp.bfloat16)), g[f"{case}_dequantized_bf16"])


@pytest.mark.parametrize("case", ["act_f32", "act_bf16"])
def test_compressed_tensors_activation_golden(case, maybe_jit):
    """Static input_global_scale (calibrated below the batch amax) + dynamic per-16 block scales."""
    g = np.load(GOLDENS / "compressed_tensors_nvfp4.npz")
    x = golden_input(g, case)
    calibration_amax = np.abs(x * x.dtype.type(0.75)).max()
    input_global_scale = nvfp4.global_scale_from_amax(calibration_amax)
    np.testing.assert_array_equal(np.asarray(input_global_scale).reshape(1),
                                  g[f"{case}_input_global_scale"])
    qt = maybe_jit(functools.partial(nvfp4.quantize_nvfp4, global_scale=input_global_scale))(x)
    np.testing.assert_array_equal(np.asarray(qt.data), g[f"{case}_packed"])
    np.testing.assert_array_equal(scale_bytes(qt), g[f"{case}_scale"])


def test_sign_of_zero_per_convention():
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [6.0, -0.0, -0.1, 0.0]
    ct = np.asarray(unpack_bits(nvfp4.quantize_nvfp4(x).data, 4))[0, :4]
    modelopt = np.asarray(unpack_bits(nvfp4.quantize_nvfp4(x, convention="modelopt").data, 4))[0, :4]
    np.testing.assert_array_equal(ct, [7, 0, 8, 0])  # sign(x)·|q|: -0.0 → +0
    np.testing.assert_array_equal(modelopt, [7, 8, 8, 0])  # the sign bit is kept


# ---- per-tensor scale ----------------------------------------------------------------------------------

@pytest.mark.parametrize("convention", nvfp4.CONVENTIONS)
def test_explicit_global_scale_equals_dynamic(convention):
    x = random((8, 64), seed=1)
    dynamic = nvfp4.quantize_nvfp4(x, convention=convention)
    amax = jnp.max(jnp.abs(x))
    static = nvfp4.quantize_nvfp4(x, convention=convention,
                                  global_scale=nvfp4.global_scale_from_amax(amax, convention))
    chex.assert_trees_all_equal(dynamic, static)


def test_conventions_are_reciprocal():
    amax = jnp.float32(3.5)
    ct = nvfp4.global_scale_from_amax(amax, "compressed-tensors")
    modelopt = nvfp4.global_scale_from_amax(amax, "modelopt")
    np.testing.assert_allclose(np.asarray(ct) * np.asarray(modelopt), 1.0, rtol=1e-6)
    assert float(nvfp4.global_scale_from_amax(jnp.float32(0), "compressed-tensors")) == 1.0
    assert float(nvfp4.global_scale_from_amax(jnp.float32(0), "modelopt")) == 1.0


@pytest.mark.parametrize("convention", nvfp4.CONVENTIONS)
def test_all_zero_tensor(convention):
    qt = nvfp4.quantize_nvfp4(np.zeros((2, 32), np.float32), convention=convention)
    assert float(qt.global_scale) == 1.0
    # compressed-tensors replaces a zero block scale by 0.125; torchao clamps to 2^-6.
    expected = 0.125 if convention == "compressed-tensors" else 2.0 ** -6
    assert (np.asarray(qt.scale.astype(jnp.float32)) == expected).all()
    assert (np.asarray(qt.data) == 0).all() and (np.asarray(qt.dequantize()) == 0).all()


def test_nan_spoils_only_its_block_in_compressed_tensors():
    x = np.array(random((2, 64), seed=2))
    x[0, 3] = np.nan
    out = np.asarray(nvfp4.quantize_nvfp4(x).dequantize(jnp.float32))
    assert np.isnan(out[0, :16]).all() and not np.isnan(out[0, 16:]).any() and not np.isnan(out[1]).any()


@pytest.mark.parametrize("convention", nvfp4.CONVENTIONS)
def test_inf(convention):
    x = np.array(random((2, 32), seed=4))
    x[0, 2] = np.inf
    single = nvfp4.quantize_nvfp4(x, convention=convention, global_scale=None)
    out = np.asarray(single.dequantize(jnp.float32))
    assert out[0, 2] == 6 * 448 and np.isfinite(out).all()  # saturates: code 6 under scale 448
    # A dynamic per-tensor scale from an Inf amax is 0 or Inf: the whole tensor dequantizes to NaN.
    dynamic = nvfp4.quantize_nvfp4(x, convention=convention)
    assert np.isnan(np.asarray(dynamic.dequantize(jnp.float32))).all()


# ---- packing, round trip, jit ----------------------------------------------------------------------------

def test_packing_is_real():
    x = np.zeros((2, 32), np.float32)
    x[:, 0], x[:, 1] = 6.0, -1.0
    qt = nvfp4.quantize_nvfp4(x, convention="modelopt", global_scale=None)  # block scale 1
    assert qt.data.dtype == jnp.uint8 and qt.data.shape == (2, 16) and qt.scale.shape == (2, 2)
    assert np.asarray(qt.data)[0, 0] == 0x7 | (0xA << 4)  # element 0 (6) low nibble, element 1 (-1) high
    assert qt.scale.dtype == jnp.float8_e4m3fn and qt.bits_per_weight == 4 + 8 / 16


def error_bound(x, qt):
    """Per element: half the E2M1 spacing at |x|/s, or the overshoot past 6 (E4M3 rounds s down),
    plus two float32 ulps of x for the rounding of ``s / global`` and of the products."""
    multiplier = np.asarray(qt.expand(nvfp4.block_scales(qt)))
    v = np.abs(x) / multiplier
    half_step = np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))
    return np.where(v > 6, v - 6, half_step) * multiplier + 2 * np.spacing(np.abs(x))


@given(values=hnp.arrays(np.float32, (4, 32), elements=st.floats(-1, 1, width=32)),
       exponent=st.integers(-20, 20), convention=st.sampled_from(nvfp4.CONVENTIONS),
       global_scale=st.sampled_from(["dynamic", None]))
def test_round_trip_within_half_step(values, exponent, convention, global_scale):
    x = values * np.float32(2.0 ** exponent)
    qt = nvfp4.quantize_nvfp4(x, convention=convention, global_scale=global_scale)
    err = np.abs(np.asarray(qt.dequantize(jnp.float32)) - x)
    assert (err <= error_bound(x, qt)).all()


def torchao_nvfp4_numpy(x, global_scale):
    """torchao 0.18 ``nvfp4_quantize`` with a per-tensor scale, restated in numpy float32 (IEEE, one
    rounding per operation): block scale ``(amax / 6) / g`` to E4M3, data times ``(1 / g) / s``."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 16)
    g = np.float32(global_scale)
    scale = (np.abs(blocks).max(-1) / np.float32(6)) / g
    scale = np.clip(scale, np.float32(2.0**-9), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    reciprocal = (np.float32(1) / g) / scale.astype(np.float32)
    scaled = np.clip(blocks * reciprocal[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return scale.view(np.uint8), scaled.reshape(x.shape)


def near_scale_midpoints(rows, seed):
    """Blocks whose ``(amax / 6) / g`` lies within 3 float32 ulps of a midpoint between two E4M3 scales:
    one rounding (XLA regrouped it to ``amax / (6 · g)``) and two land on different bytes there."""
    rng = np.random.default_rng(seed)
    e4m3 = np.arange(8, 120, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = np.float32(rng.uniform(1e-4, 1e-2))
    mid = (e4m3[:-1] + e4m3[1:]) / 2
    amax = (rng.choice(mid, rows).astype(np.float32) * np.float32(6)) * g
    amax = np.nextafter(amax, np.float32(np.inf) * rng.choice([-1, 1], rows)).astype(np.float32)
    x = (rng.standard_normal((rows, 16)) * 0.3).astype(np.float32) * amax[:, None]
    x[:, 0] = amax
    return x, g


@pytest.mark.parametrize("like", ["torchao", "modelopt"])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_roundings_of_block_scales_and_data_under_jit(like, seed):
    # XLA turned (amax / 6) / g into amax / (6 · g) and (1 / g) / s into 1 / (g · s) (one rounding), and
    # 1 in ~10^5 random blocks (and nearly every block built near a midpoint) took another E4M3 byte.
    x, g = near_scale_midpoints(2048, seed)
    expected_scale, expected_data = torchao_nvfp4_numpy(x, g)
    qt = jax.jit(lambda x: jquant.quantize(x, "nvfp4", like=like, global_scale=g))(x)
    np.testing.assert_array_equal(scale_bytes(qt).reshape(expected_scale.shape), expected_scale)
    codes = np.asarray(unpack_bits(qt.data, 4)).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(codes.astype(np.float32), expected_data.astype(np.float32))
    # The global scale computed from x in the same jitted call (torchao's per_tensor_amax_to_scale).
    x[0, 1] = x.max() * 1.5
    qt = jax.jit(lambda x: jquant.quantize(x, "nvfp4", like=like, global_scale="dynamic"))(x)
    expected_scale, _ = torchao_nvfp4_numpy(x, qt.global_scale)
    np.testing.assert_array_equal(scale_bytes(qt).reshape(expected_scale.shape), expected_scale)


class JitParityTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_matches_eager(self):
        x = random((4, 48), seed=3).astype(jnp.bfloat16)
        for convention in nvfp4.CONVENTIONS:
            quantize = self.variant(functools.partial(nvfp4.quantize_nvfp4, convention=convention))
            expected = nvfp4.quantize_nvfp4(x, convention=convention)
            chex.assert_trees_all_equal(quantize(x), expected)
            dequantize = self.variant(lambda qt: qt.dequantize(jnp.bfloat16))
            chex.assert_trees_all_equal(dequantize(expected), expected.dequantize(jnp.bfloat16))


def test_axis_zero():
    x = random((32, 3))
    qt = jquant.quantize(x, "nvfp4", axis=0)
    assert qt.block == (16, 1) and qt.data.shape == (16, 3) and qt.pack_axis == 0
    chex.assert_trees_all_equal(qt.dequantize(), jquant.quantize(x.T, "nvfp4").dequantize().T)


# ---- bad inputs ----------------------------------------------------------------------------------------

def test_axis_not_divisible_by_16():
    with pytest.raises(ValueError, match=r"shape \(4, 24\).*16"):
        jquant.quantize(np.ones((4, 24), np.float32), "nvfp4")


def test_bad_options():
    x = np.ones((2, 16), np.float32)
    with pytest.raises(ValueError, match="convention"):
        jquant.quantize(x, "nvfp4", convention="vllm")
    with pytest.raises(ValueError, match="global_scale"):
        jquant.quantize(x, "nvfp4", global_scale="static")
    with pytest.raises(ValueError, match=r"global_scale.*shape \(2,\)"):
        jquant.quantize(x, "nvfp4", global_scale=np.ones(2, np.float32))
    with pytest.raises(TypeError, match="block_size"):
        jquant.quantize(x, "nvfp4", block_size=32)
