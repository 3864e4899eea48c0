"""MX formats: torchao and gguf goldens for every scale mode, packing, NaN/Inf/zero blocks,
round-trip bound, jit parity and bad inputs."""

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
from jquant.formats import mx, preset_options
from jquant.formats.packing import unpack_bits

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
MODES = ("floor", "ceil", "even", "rceil")
# (mantissa bits, exponent of the smallest normal) of each element type, for the half-step bound.
ELEMENT_BITS = {"mxfp4": (1, 0), "mxfp8_e4m3": (3, -6), "mxfp8_e5m2": (2, -14)}


def golden_input(g, name):
    a = g[name]
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def scale_bytes(qt):
    return np.asarray(qt.scale).view(np.uint8)


def data_bytes(qt):
    return np.asarray(qt.data).view(np.uint8)


def random(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ---- torchao 0.18 goldens ---------------------------------------------------------------------------

TORCHAO_CASES = ([("x_f32", fmt, mode) for fmt in mx.ELEMENTS for mode in MODES]
                 + [("x_bf16", "mxfp4", mode) for mode in ("floor", "rceil")]
                 + [("x_special", fmt, mode) for fmt in ("mxfp4", "mxfp8_e4m3") for mode in MODES])


@pytest.mark.parametrize("input_name,fmt,mode", TORCHAO_CASES)
def test_torchao_golden(input_name, fmt, mode):
    g = np.load(GOLDENS / "torchao_mx.npz")
    key = f"{input_name}_{fmt}_{mode}"
    qt = mx.quantize_mx(golden_input(g, input_name), fmt, scale_mode=mode)
    np.testing.assert_array_equal(scale_bytes(qt), g[f"{key}_scale"])
    # A NaN block's element codes are unspecified (its scale is NaN); every other byte must match.
    per_byte = 16 if fmt == "mxfp4" else 32
    finite_blocks = np.repeat(g[f"{key}_scale"] != 255, per_byte, axis=-1)
    np.testing.assert_array_equal(data_bytes(qt)[finite_blocks], g[f"{key}_data"][finite_blocks])
    if f"{key}_dequant_bf16" in g:
        expected = g[f"{key}_dequant_bf16"].view(ml_dtypes.bfloat16).astype(np.float32)
        got = np.asarray(qt.dequantize(jnp.bfloat16)).astype(np.float32)
        np.testing.assert_array_equal(got, expected)  # NaN positions compared as NaN


@pytest.mark.parametrize("input_name,fmt,mode", [c for c in TORCHAO_CASES if c[2] in ("floor", "rceil")])
def test_torchao_golden_preset(input_name, fmt, mode):
    """like="torchao" is to_mx's default (FLOOR); its eager RCEIL is scale_mode="rceil_log2f"."""
    g = np.load(GOLDENS / "torchao_mx.npz")
    key = f"{input_name}_{fmt}_{mode}"
    x = golden_input(g, input_name)
    qt = jquant.quantize(x, fmt, like="torchao") if mode == "floor" else \
        jquant.quantize(x, fmt, scale_mode="rceil_log2f")
    np.testing.assert_array_equal(scale_bytes(qt), g[f"{key}_scale"])
    per_byte = 16 if fmt == "mxfp4" else 32
    finite_blocks = np.repeat(g[f"{key}_scale"] != 255, per_byte, axis=-1)
    np.testing.assert_array_equal(data_bytes(qt)[finite_blocks], g[f"{key}_data"][finite_blocks])


def test_presets_and_clashes():
    assert preset_options("torchao", "mxfp8_e4m3") == {"scale_mode": "floor", "element_rounding": "even"}
    assert preset_options("gguf", "mxfp4") == {"scale_mode": "floor", "element_rounding": "ggml"}
    with pytest.raises(ValueError, match="element_rounding='ggml'"):
        jquant.quantize(np.ones((1, 32), np.float32), "mxfp4", like="gguf", element_rounding="even")
    with pytest.raises(ValueError, match="no 'gguf' preset for format 'mxfp8_e4m3'"):
        jquant.quantize(np.ones((1, 32), np.float32), "mxfp8_e4m3", like="gguf")


def test_rceil_is_exact_where_torchao_eager_log2_rounds():
    # amax/6 one float32 step above 2^-10: the exact ceiling is 2^-9 (byte 118); torchao's eager
    # fallback takes ceil of a float32 log2 that rounds to -10 (byte 117), recorded in the golden.
    g = np.load(GOLDENS / "torchao_mx.npz")
    amax = np.nextafter(np.float32(6 * 2.0 ** -10), np.float32(1))
    x = np.full((1, 32), amax / 2, np.float32)
    x[0, 0] = amax
    assert int(g["rceil_log2_window_scale"]) == 117
    assert scale_bytes(mx.quantize_mx(x, "mxfp4", scale_mode="rceil"))[0, 0] == 118
    assert scale_bytes(mx.quantize_mx(x, "mxfp4", scale_mode="rceil_log2f"))[0, 0] == 117  # torchao eager


# ---- gguf-py 0.19 goldens (GGML MXFP4) --------------------------------------------------------------

def gguf_scales_and_codes(g):
    blocks = g["gguf_blocks"].reshape(*g["x"].shape[:-1], -1, 17)
    nibbles = blocks[..., 1:]  # low nibbles: elements 0-15; high nibbles: 16-31
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(g["x"].shape)
    return blocks[..., 0], codes


@pytest.mark.parametrize("options", [{"element_rounding": "ggml"}, {"like": "gguf"}], ids=["option", "preset"])
def test_gguf_golden_ggml_rounding(options):
    g = np.load(GOLDENS / "gguf_mxfp4.npz")
    scales, codes = gguf_scales_and_codes(g)
    qt = jquant.quantize(g["x"], "mxfp4", **options)
    np.testing.assert_array_equal(scale_bytes(qt), scales)
    np.testing.assert_array_equal(np.asarray(unpack_bits(qt.data, 4)), codes)
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), g["dequantized"])


def test_gguf_ties_differ_from_round_half_even():
    g = np.load(GOLDENS / "gguf_mxfp4.npz")
    scales, codes = gguf_scales_and_codes(g)
    qt = jquant.quantize(g["x"], "mxfp4")  # torchao / OCP rounding: same exponents, other ties
    np.testing.assert_array_equal(scale_bytes(qt), scales)
    ours = np.asarray(unpack_bits(qt.data, 4))
    # Outside the block of exact ties they differ only in the sign of zero (GGML always stores +0).
    differs = ours != codes
    differs[1, 32:64] = False
    assert ((ours[differs] == 8) & (codes[differs] == 0)).all()
    # Ties: 0.25 → 0 (both), 0.75 → 1 (GGML 0.5), 1.25 → 1 (both), 1.75 → 2 (GGML 1.5).
    np.testing.assert_array_equal(codes[1, 32:36], [0, 1, 2, 3])
    np.testing.assert_array_equal(ours[1, 32:36], [0, 2, 2, 4])


# ---- E2M1 rounding and packing ----------------------------------------------------------------------

def test_e2m1_round_half_even_and_saturation():
    values = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e30, -0.0, -0.1, -7.0, 0.26])
    codes = np.asarray(mx.e2m1_codes(values))
    np.testing.assert_array_equal(codes, [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 8, 15, 1])
    np.testing.assert_array_equal(np.asarray(mx.e2m1_values(jnp.asarray(codes))),
                                  [0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -0.0, -6, 0.5])
    np.testing.assert_array_equal(np.asarray(mx.e2m1_codes(values, "zero", "nonzero"))[:9],
                                  [0, 1, 2, 3, 4, 5, 6, 7, 7])
    negative = mx.e2m1_codes(jnp.array([-0.0, -0.1]), sign="negative")
    np.testing.assert_array_equal(np.asarray(negative), [0, 8])


def test_mxfp4_packs_two_codes_per_byte_low_nibble_first():
    x = np.zeros((2, 64), np.float32)
    x[:, 0], x[:, 1], x[:, 33] = 6.0, -0.5, 3.0  # block 0 amax 6 → scale 2^0
    x[:, 32] = 1.0
    qt = mx.quantize_mx(x, "mxfp4")
    assert qt.data.dtype == jnp.uint8 and qt.data.shape == (2, 32) and qt.pack_axis == 1
    assert qt.bits_per_weight == 4 + 8 / 32
    assert data_bytes(qt)[0, 0] == 0x7 | (0x9 << 4)  # element 0 (6.0) low, element 1 (-0.5) high
    np.testing.assert_array_equal(scale_bytes(qt)[0], [127, 126])  # 2^(floor(log2 3) - 2) = 2^-1
    assert qt.scale.dtype == jnp.float8_e8m0fnu


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_mxfp8_stores_float8_codes(fmt):
    qt = jquant.quantize(random((4, 64)), fmt, scale_mode="rceil")
    assert qt.data.dtype == {"mxfp8_e4m3": jnp.float8_e4m3fn, "mxfp8_e5m2": jnp.float8_e5m2}[fmt]
    assert qt.pack_axis is None and qt.scale.shape == (4, 2) and qt.bits_per_weight == 8 + 8 / 32


def test_other_axis_equals_transposed_last_axis():
    x = random((64, 3, 5))
    along0 = mx.quantize_mx(x, "mxfp4", axis=0, scale_mode="even")
    last = mx.quantize_mx(jnp.moveaxis(x, 0, -1), "mxfp4", axis=-1, scale_mode="even")
    assert along0.block == (32, 1, 1) and along0.scale.shape == (2, 3, 5)
    np.testing.assert_array_equal(np.moveaxis(scale_bytes(along0), 0, -1), scale_bytes(last))
    np.testing.assert_array_equal(np.moveaxis(np.asarray(along0.dequantize()), 0, -1),
                                  np.asarray(last.dequantize()))


# ---- zero / NaN / Inf blocks --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_special_blocks(mode):
    x = np.tile(np.linspace(-2, 2, 32, dtype=np.float32), 4)[None].repeat(2, 0)
    x[0, 3] = np.nan
    x[0, 32 + 4] = np.inf
    x[1, 64:96] = 0.0
    qt = mx.quantize_mx(x, "mxfp4", scale_mode=mode)
    out = np.asarray(qt.dequantize(jnp.float32))
    assert scale_bytes(qt)[0, 0] == 255 and np.isnan(out[0, :32]).all()  # NaN spoils its block only
    assert not np.isnan(out[0, 32:]).any() and not np.isnan(out[1]).any()
    # Inf saturates to code ±6 under a 2^126 (2^127 for rceil) scale, so it dequantizes to Inf again;
    # the rest of its block rounds to zero.
    assert np.asarray(unpack_bits(qt.data, 4))[0, 36] == 7 and out[0, 36] == np.inf
    assert (out[0, 32:64][np.arange(32) != 4] == 0).all()
    assert scale_bytes(qt)[1, 2] == 0 and (out[1, 64:96] == 0).all()  # all-zero block: byte 0


# ---- round trip, jit ----------------------------------------------------------------------------------

def element_values(qt):
    """The stored elements as float64 (before the scale)."""
    if qt.pack_axis is None:
        return np.asarray(qt.data.astype(jnp.float32), np.float64)
    return np.asarray(mx.e2m1_values(unpack_bits(qt.data, 4, axis=qt.pack_axis)), np.float64)


def test_scale_byte_zero_blocks_dequantize_like_torchao():
    """amax just above 2^-112 gives an e5m2 "floor" scale of 2^-127, a float32 subnormal: the
    elements come from x / 2^-126 (torchao's clamp) and dequantize with 2^-127, not to 0."""
    x = np.full((1, 32), 3.4195976e-34, np.float32)
    qt = mx.quantize_mx(x, "mxfp8_e5m2", scale_mode="floor")
    assert scale_bytes(qt)[0, 0] == 0 and float(qt.data[0, 0].astype(jnp.float32)) == 28672.0
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)),
                                  np.full((1, 32), 28672.0 * 2.0 ** -127, np.float32))


def error_bound(x, qt, fmt):
    """Per element: half the element grid spacing at |x|/scale, or the clipping overshoot."""
    mantissa_bits, min_normal_exp = ELEMENT_BITS[fmt]
    scale = np.asarray(qt.expand(qt.scale.astype(jnp.float32)))
    v = np.abs(x) / scale
    top = mx.ELEMENTS[fmt].max
    exponent = np.floor(np.log2(np.maximum(v, 2.0 ** min_normal_exp)))
    half_step = 0.5 * 2.0 ** (exponent - mantissa_bits)
    return np.where(v > top, v - top, half_step) * scale


@given(values=hnp.arrays(np.float32, (3, 64), elements=st.floats(-1, 1, width=32)),
       exponent=st.integers(-40, 40), fmt=st.sampled_from(sorted(mx.ELEMENTS)), mode=st.sampled_from(MODES))
def test_round_trip_within_half_step(values, exponent, fmt, mode):
    x = values * np.float32(2.0 ** exponent)
    qt = mx.quantize_mx(x, fmt, scale_mode=mode)
    out = np.asarray(qt.dequantize(jnp.float32))
    err = np.abs(out - x)
    # Scale byte 0 (2^-127) is torchao's quirk: elements are taken against 2^-126 (its clamp) but
    # dequantized with 2^-127; those blocks get their own exact check below.
    byte0 = np.asarray(qt.expand(scale_bytes(qt).astype(np.int32))) == 0
    assert (err <= error_bound(x, qt, fmt))[~byte0].all()
    np.testing.assert_array_equal(out[byte0], (element_values(qt) * 2.0 ** -127)[byte0])
    if mode in ("ceil", "rceil"):  # these never clip
        scale = np.asarray(qt.expand(qt.scale.astype(jnp.float32)))
        assert (np.abs(x) / scale <= mx.ELEMENTS[fmt].max).all()


class JitParityTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_matches_eager(self):
        x = random((4, 96), seed=3)
        cases = [("mxfp4", mode) for mode in MODES] + [("mxfp8_e4m3", "even"), ("mxfp8_e5m2", "rceil")]
        for fmt, mode in cases:
            quantize = self.variant(functools.partial(mx.quantize_mx, fmt=fmt, scale_mode=mode))
            expected = mx.quantize_mx(x, fmt, scale_mode=mode)
            chex.assert_trees_all_equal(quantize(x), expected)
        dequantize = self.variant(lambda qt: qt.dequantize(jnp.bfloat16))
        chex.assert_trees_all_equal(dequantize(expected), expected.dequantize(jnp.bfloat16))


# ---- bad inputs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(mx.ELEMENTS))
def test_axis_not_divisible_by_32(fmt):
    with pytest.raises(ValueError, match=r"shape \(4, 48\).*32"):
        jquant.quantize(np.ones((4, 48), np.float32), fmt)


def test_bad_options():
    x = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match="scale_mode"):
        jquant.quantize(x, "mxfp4", scale_mode="nearest")
    with pytest.raises(ValueError, match="element_rounding"):
        jquant.quantize(x, "mxfp4", element_rounding="up")
    with pytest.raises(ValueError, match="ggml"):
        jquant.quantize(x, "mxfp8_e4m3", element_rounding="ggml")
    with pytest.raises(TypeError, match="block_size"):
        jquant.quantize(x, "mxfp4", block_size=16)
    with pytest.raises(ValueError, match="axis=2"):
        jquant.quantize(x, "mxfp4", axis=2)


@pytest.mark.parametrize("fmt", sorted(mx.ELEMENTS))
def test_dequantized_subnormals_are_kept(fmt):
    """Scale byte 0 (2^-127) times an element under 2 is a float32 subnormal, which PyTorch keeps and
    XLA's product flushed (a block of 2^-126 under "floor" dequantized to zeros)."""
    x = np.full((2, 32), np.float32(2.0 ** -126))
    x[1] *= np.float32(0.3)
    qt = mx.quantize_mx(x, fmt, scale_mode="floor")
    assert (scale_bytes(qt) == 0).all()
    for dequantize in (qt.dequantize, jax.jit(qt.dequantize, static_argnums=0)):
        out = np.asarray(dequantize(jnp.float32))
        np.testing.assert_array_equal(out, element_values(qt) * 2.0 ** -127)
        assert (out > 0).all() and (out < np.float32(2.0 ** -126)).all()
