"""Adversarial parity (tests/goldens/adversarial_fp4.npz): MX, NVFP4 and bitsandbytes 4-bit codes and
scales against torchao, compressed-tensors, gguf-py and bitsandbytes on rounding midpoints, amaxes a
few float32 steps around powers of two, -0.0, zero blocks, subnormals and near-max values, plus a
NaN and an Inf in a [256, 4096] tensor (XLA's CPU max reductions drop NaN at that size)."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.formats import mx, preset_options
from jquant.formats.packing import unpack_bits

G = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "adversarial_fp4.npz")
X = G["x"]
BIG_SHAPE = (256, 4096)
KEEP = 4  # rows of the big outputs kept in the golden
MX_MODES = ("floor", "ceil", "even", "rceil")


def hashed_input():
    """tools/goldens/adversarial_fp4.py's ``hashed_input`` (integer hash, exact in numpy)."""
    i = np.arange(BIG_SHAPE[0] * BIG_SHAPE[1], dtype=np.uint64)
    h = (i * np.uint64(2654435761)) % np.uint64(2 ** 32)
    return ((h.astype(np.float64) / 2.0 ** 32 - 0.5) * 4).astype(np.float32).reshape(BIG_SHAPE)


@functools.cache
def big_input(kind):
    x = hashed_input()
    if kind in ("nan", "both"):
        x[1, 100] = np.nan
    if kind in ("inf", "both"):
        x[2, 2000] = np.inf
    x.setflags(write=False)
    return x


def u8(a):
    return np.asarray(a).view(np.uint8)


def e4m3(a):
    return u8(a).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def i32(a):
    return np.asarray(a, np.float32).view(np.int32)


# ---- MX (torchao 0.18 to_mx) ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(mx.ELEMENTS))
@pytest.mark.parametrize("mode", ["floor", "ceil", "even"])
def test_mx_torchao_bit_exact(fmt, mode):
    qt = jquant.quantize(X, fmt, like="torchao", scale_mode=mode) if mode == "floor" else \
        jquant.quantize(X, fmt, scale_mode=mode)
    np.testing.assert_array_equal(u8(qt.scale), G[f"mx_{fmt}_{mode}_scale"])
    np.testing.assert_array_equal(u8(qt.data), G[f"mx_{fmt}_{mode}_data"])


@pytest.mark.parametrize("fmt", sorted(mx.ELEMENTS))
def test_mx_rceil_log2f_is_torchao_eager(fmt):
    """Quotients just above 2^k (also in the float32 subnormal range) where float32 log2 rounds down."""
    qt = jquant.quantize(X, fmt, scale_mode="rceil_log2f")
    np.testing.assert_array_equal(u8(qt.scale), G[f"mx_{fmt}_rceil_scale"])
    np.testing.assert_array_equal(u8(qt.data), G[f"mx_{fmt}_rceil_data"])


@pytest.mark.parametrize("fmt", sorted(mx.ELEMENTS))
def test_mx_rceil_is_the_exact_ceiling(fmt):
    """"rceil" is ceil(log2(amax / max)) exactly (numpy keeps the subnormal quotients); it differs from
    torchao's eager bytes only where torchao's float32 log2 rounds down onto the integer."""
    element = mx.ELEMENTS[fmt]
    amax = np.abs(X.reshape(X.shape[0], -1, 32)).max(-1)
    quotient = (amax / np.float32(element.max)).astype(np.float64)  # numpy keeps subnormals
    mantissa, exponent = np.frexp(quotient)
    exact = np.clip(np.where(mantissa == 0.5, exponent - 1, exponent), -127, 127) + 127
    exact = np.where(quotient == 0, 0, exact)  # log2(0) = -inf, clamped to byte 0
    ours = u8(jquant.quantize(X, fmt, scale_mode="rceil").scale)
    np.testing.assert_array_equal(ours, exact)
    differs = ours != G[f"mx_{fmt}_rceil_scale"]
    assert differs.any()  # the inputs do reach the log2 window
    np.testing.assert_array_equal(ours[differs], G[f"mx_{fmt}_rceil_scale"][differs] + 1)


def test_mx_tiny_rceil_blocks_are_not_flushed():
    """amax / 6 just above 2^-127 is a float32 subnormal: the scale must be 2^-126 (byte 1), not 0."""
    amax = np.nextafter(np.float32(6 * 2.0 ** -127), np.float32(1))
    amax = np.nextafter(amax, np.float32(1))  # 2 steps: fl(amax / 6) = 2^-127 + 2^-149
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = amax
    assert np.float32(amax) / np.float32(6) > np.float32(2.0 ** -127)  # numpy keeps the subnormal
    assert u8(mx.quantize_mx(x, "mxfp4", scale_mode="rceil").scale)[0, 0] == 1


def test_mx_subnormal_elements_scale_exactly():
    """A normal amax (2^-124) over subnormal elements: x / 2^-126 (floor) and x · 2^126 (rceil: the
    quotient 2^-124 / 6 is a subnormal, so the scale is 2^-126 there too) are normal."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 4 * 2.0 ** -126
    x[0, 1:4] = np.array([2 ** 22, 2 ** 22, 3 * 2 ** 21], np.int32).view(np.float32) * [1, -1, 1]  # 0.5·2^-126...
    for mode in ("floor", "rceil"):
        codes = np.asarray(unpack_bits(mx.quantize_mx(x, "mxfp4", scale_mode=mode).data, 4))[0, :4]
        np.testing.assert_array_equal(codes, [6, 1, 9, 2])  # 4, 0.5, -0.5, 0.75 → 1 (ties to even)


# ---- compressed-tensors 0.20.1 MXFP4A16 / MXFP8A16 -----------------------------------------------------

# compressed-tensors rounds the amax on its bits: from 1.75 · 2^127 up that overflows to Inf, and the
# block comes out with scale byte 127 and zero codes (its values ~1e38 dequantize to 0). jquant keeps
# torchao's saturation there (scale 2^126 for MXFP4, 2^120 for MXFP8), as for non-finite blocks.
CT_OVERFLOW_AMAX = np.float32(1.75 * 2.0 ** 127)


def ct_mx_deviating_blocks(x):
    """[rows, K/32] blocks where compressed-tensors' scale overflows or the block is not finite."""
    blocks = np.abs(x.reshape(x.shape[0], -1, 32))
    return ~np.isfinite(blocks).all(-1) | (blocks.max(-1) >= CT_OVERFLOW_AMAX)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
def test_mx_compressed_tensors_adversarial(fmt):
    qt = jquant.quantize(X, fmt, like="compressed-tensors")
    scale, data = u8(qt.scale), u8(qt.data)
    deviating = ct_mx_deviating_blocks(X)
    assert deviating.sum() == 3   # the two near-float32-max rows
    np.testing.assert_array_equal(scale[~deviating], G[f"ct_mx_{fmt}_scale"][~deviating])
    per_code = 16 if fmt == "mxfp4" else 32
    same = np.repeat(~deviating, per_code, axis=-1)
    np.testing.assert_array_equal(data[same], G[f"ct_mx_{fmt}_data"][same])
    assert (scale[deviating] == (253 if fmt == "mxfp4" else 247)).all()
    out = np.asarray(qt.dequantize(jnp.float32)).reshape(X.shape[0], -1, 32)[deviating]
    big = np.abs(X.reshape(X.shape[0], -1, 32)[deviating]).max(-1)
    # Not zeroed: the block keeps its magnitude (float32's max itself dequantizes to ±Inf under the
    # rounded-up scale, 4 · 2^126 for MXFP4, as torchao's "even" gives too).
    assert not np.isnan(out).any() and (np.abs(out).max(-1) >= big / 2).all()


# ---- gguf-py MXFP4 (element_rounding="ggml") ---------------------------------------------------------

def gguf_scales_codes():
    blocks = G["gguf_blocks"].reshape(X.shape[0], -1, 17)
    nibbles = blocks[..., 1:]
    return blocks[..., 0], np.concatenate([nibbles & 15, nibbles >> 4], -1).reshape(X.shape)


def test_gguf_mxfp4_adversarial():
    scales, codes = gguf_scales_codes()
    qt = jquant.quantize(X, "mxfp4", like="gguf")
    ours = u8(qt.scale)
    np.testing.assert_array_equal(np.asarray(unpack_bits(qt.data, 4)), codes)
    # The one documented difference: gguf's wrapped byte 255 (amax in [2^-126, 2^-125), log2f
    # rounding included) is NaN in E8M0, so jquant stores 254, which codes the same zeros.
    differs = ours != scales
    assert (scales[differs] == 255).all() and (ours[differs] == 254).all() and differs.any()
    assert (codes.reshape(X.shape[0], -1, 32)[differs] == 0).all()
    # log2f rounds amaxes just below 2^k up (rows 0-74 hold 2^k - 3..1 steps), and bytes wrap.
    assert (scales != u8(jquant.quantize(X, "mxfp4", scale_mode="floor").scale)).sum() > 20


def test_gguf_exponent_below_power_of_two():
    """floor(log2f(8 - one step)) is 3 (float32 log2 rounds up onto 3): gguf's exponent is 1."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.nextafter(np.float32(8), np.float32(0))
    assert np.floor(np.log2(x[0, 0])) == 3  # what gguf-py computes
    assert u8(jquant.quantize(x, "mxfp4", like="gguf").scale)[0, 0] == 128
    assert u8(jquant.quantize(x, "mxfp4").scale)[0, 0] == 127  # OCP floor reads the exponent bits


# ---- NVFP4 ------------------------------------------------------------------------------------------

def nvfp4_rows(like, global_scale):
    qts = [jquant.quantize(X[r:r + 1], "nvfp4", like=like, global_scale=global_scale) for r in range(X.shape[0])]
    packed = np.stack([np.asarray(q.data) for q in qts])
    scale = np.stack([u8(q.scale) for q in qts])
    glob = None if global_scale is None else np.stack([np.asarray(q.global_scale).reshape(1) for q in qts])
    return packed, scale, glob


@pytest.mark.parametrize("case", ["dynamic", "none"])
def test_nvfp4_compressed_tensors_adversarial(case):
    """Includes amax past 2^126 (the reciprocal in the global scale is a subnormal) and subnormal
    elements (sign(x) · |q| keeps their sign)."""
    packed, scale, glob = nvfp4_rows("compressed-tensors", "dynamic" if case == "dynamic" else None)
    key = f"ct_nvfp4_{case}_"
    np.testing.assert_array_equal(packed, G[key + "packed"])
    np.testing.assert_array_equal(scale, G[key + "scale"])
    if glob is not None:
        np.testing.assert_array_equal(i32(glob), i32(G[key + "global"]))


def test_nvfp4_torchao_adversarial():
    packed, scale, _ = nvfp4_rows("torchao", None)
    np.testing.assert_array_equal(packed, G["torchao_nvfp4_none_packed"])
    np.testing.assert_array_equal(scale, G["torchao_nvfp4_none_scale"])
    packed, scale, glob = nvfp4_rows("modelopt", "dynamic")
    ref_glob = G["torchao_nvfp4_dynamic_global"]
    # Documented: torchao's scale_2 = amax / 2688 is a float32 subnormal (amax < 2688 · 2^-126) or
    # zero there; jquant, whose arithmetic cannot hold it, uses scale_2 = 1 for those tensors.
    tiny = (np.abs(ref_glob) < 2.0 ** -126).reshape(-1)
    assert tiny.sum() >= 10 and (glob[tiny] == 1).all()
    np.testing.assert_array_equal(i32(glob[~tiny]), i32(ref_glob[~tiny]))
    np.testing.assert_array_equal(packed[~tiny], G["torchao_nvfp4_dynamic_packed"][~tiny])
    np.testing.assert_array_equal(scale[~tiny], G["torchao_nvfp4_dynamic_scale"][~tiny])


# ---- bitsandbytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dq", [False, True], ids=["plain", "dq"])
def test_bnb_adversarial(quant_type, dq):
    """Subnormal absmax and elements, absmax past 2^126 (1 / absmax subnormal), tiny FP4 signs."""
    fmt = {"nf4": "nf4", "fp4": "fp4_bnb"}[quant_type]
    qt = jquant.quantize(X, fmt, like="bitsandbytes", compress_statistics=dq)
    key = f"bnb_{quant_type}_{'dq' if dq else 'plain'}_"
    np.testing.assert_array_equal(np.asarray(qt.data), G[key + "packed"])
    if dq:
        np.testing.assert_array_equal(np.asarray(qt.scale.data), G[key + "absmax"])
    else:
        np.testing.assert_array_equal(i32(qt.scale), i32(G[key + "absmax"]))


# ---- NaN / Inf at realistic size --------------------------------------------------------------------

KINDS = ("nan", "inf", "both")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt, mode", [("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp8_e4m3", "floor")])
def test_big_mx(kind, fmt, mode):
    x = big_input(kind)
    mode = "rceil_log2f" if mode == "rceil" else mode
    qt = jquant.quantize(x, fmt, scale_mode=mode)
    key = f"big_{kind}_mx_{fmt}_{mode.removesuffix('_log2f')}_"
    scale = u8(qt.scale)[:KEEP]
    np.testing.assert_array_equal(scale, G[key + "scale"])
    finite = np.repeat(scale != 255, 16 if fmt == "mxfp4" else 32, axis=-1)  # NaN blocks: codes unspecified
    np.testing.assert_array_equal(u8(qt.data)[:KEEP][finite], G[key + "data"][finite])
    out = np.asarray(qt.dequantize(jnp.float32))
    if kind in ("nan", "both"):
        assert np.isnan(out[1, 96:128]).all() and np.isnan(out).sum() == 32  # that block only
    if kind in ("inf", "both"):
        assert out[2, 2000] == np.inf and np.isfinite(np.delete(out[2], 2000)).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
def test_big_mx_compressed_tensors(kind, fmt):
    """compressed-tensors gives a NaN block scale byte 0 (its other values then saturate to ±max under
    2^-127, and dequantize to ~1e-38) and an Inf block byte 127 with zero codes, the Inf itself NaN:
    jquant keeps torchao's NaN block and ±Inf (test_big_mx). Every finite block is bit for bit."""
    x = big_input(kind)
    qt = jquant.quantize(x, fmt, like="compressed-tensors")
    key = f"big_{kind}_ct_mx_{fmt}_"
    scale, data = u8(qt.scale)[:KEEP], u8(qt.data)[:KEEP]
    finite = ~ct_mx_deviating_blocks(x[:KEEP])
    assert (~finite).sum() == (2 if kind == "both" else 1)
    np.testing.assert_array_equal(scale[finite], G[key + "scale"][finite])
    same = np.repeat(finite, 16 if fmt == "mxfp4" else 32, axis=-1)
    np.testing.assert_array_equal(data[same], G[key + "data"][same])
    out = np.asarray(qt.dequantize(jnp.float32))
    if kind in ("nan", "both"):
        assert np.isnan(out[1, 96:128]).all() and np.isnan(out).sum() == 32
    if kind in ("inf", "both"):
        assert out[2, 2000] == np.inf and np.isfinite(np.delete(out[2], 2000)).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("like", ["modelopt", "compressed-tensors"])
def test_big_nvfp4(kind, like):
    x = big_input(kind)
    qt = jquant.quantize(x, "nvfp4", like=like)
    key = f"big_{kind}_{'torchao' if like == 'modelopt' else 'ct'}_nvfp4_"
    glob = np.asarray(qt.global_scale).reshape(1)
    ref_glob = G[key + "global"]
    np.testing.assert_array_equal(np.isnan(glob), np.isnan(ref_glob))
    np.testing.assert_array_equal(glob[~np.isnan(glob)], ref_glob[~np.isnan(ref_glob)])
    out = np.asarray(qt.dequantize(jnp.float32))
    if np.isnan(ref_glob).any():  # modelopt with a NaN: scale_2 is NaN, so is every value (torchao)
        assert like == "modelopt" and np.isnan(out).all()
        return
    scale = e4m3(qt.scale)[:KEEP]
    np.testing.assert_array_equal(scale, e4m3(G[key + "scale"]))  # torch's NaN scales may be 0xFF
    finite = np.repeat(~np.isnan(scale), 8, axis=-1)  # NaN blocks: codes unspecified
    np.testing.assert_array_equal(np.asarray(qt.data)[:KEEP][finite], G[key + "packed"][finite])
    if kind != "inf":  # compressed-tensors: a NaN global falls back to 1; only its block is NaN
        assert np.isnan(out[1, 96:112]).all() and np.isnan(out).sum() == 16
        if kind == "both":  # under global 1 the Inf saturates: 6 · 448
            assert out[2, 2000] == 6 * 448
    else:  # an Inf makes the dynamic global 0 (ct) or Inf (modelopt): every value NaN, as the libraries
        assert np.isnan(out).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dq", [False, True], ids=["plain", "dq"])
def test_big_bnb(kind, quant_type, dq):
    x = big_input(kind)
    fmt = {"nf4": "nf4", "fp4": "fp4_bnb"}[quant_type]
    qt = jquant.quantize(x, fmt, like="bitsandbytes", compress_statistics=dq)
    key = f"big_{kind}_bnb_{quant_type}_{'dq' if dq else 'plain'}_"
    np.testing.assert_array_equal(np.asarray(qt.data).reshape(BIG_SHAPE[0], -1)[:KEEP], G[key + "packed"])
    if dq:
        np.testing.assert_array_equal(np.asarray(qt.scale.data).reshape(BIG_SHAPE[0], -1)[:KEEP], G[key + "absmax"])
        np.testing.assert_array_equal(i32(qt.scale.scale), i32(G[key + "nested_absmax"]))
        np.testing.assert_array_equal(i32(np.asarray(qt.scale.zero).reshape(1)), i32(G[key + "offset"]))
    else:
        np.testing.assert_array_equal(i32(np.asarray(qt.scale).reshape(BIG_SHAPE[0], -1)[:KEEP]),
                                      i32(G[key + "absmax"]))
    out = np.asarray(qt.dequantize(jnp.float32))
    if kind in ("nan", "both") and not dq:
        assert np.isnan(out[1, 64:128]).all() and np.isnan(out[[0, 3]]).sum() == 0  # its block of 64
    if kind in ("inf", "both") and not dq:
        assert out[2, 2000] == np.inf and np.isnan(np.delete(out[2, 1984:2048], 16)).all()  # 0 · Inf


# ---- NVFP4 scales are true divisions, eager and under jit -------------------------------------------

def e4m3_of(values):
    return np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@functools.cache
def reciprocal_sensitive_amaxes():
    """Block amaxes whose E4M3 scale differs between fl(amax / 6) and amax · fl(1/6), which is what
    XLA makes of a division by a constant: float32 steps around 6 × each E4M3 midpoint."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 2.0 ** -6)])
    mids = (grid[:-1] + grid[1:]) / 2
    steps = np.arange(-6, 7, dtype=np.int32)
    amax = ((mids * np.float32(6)).astype(np.float32).view(np.int32)[:, None] + steps).view(np.float32).ravel()
    exact = e4m3_of(np.clip(amax / np.float32(6), 2.0 ** -6, 448))
    rewritten = e4m3_of(np.clip(amax * (np.float32(1) / np.float32(6)), 2.0 ** -6, 448))
    return amax[exact != rewritten]


def blocks_with_amax(amax):
    x = np.full((len(amax), 16), 0.01, np.float32)
    x[:, 5] = -amax
    return x.reshape(1, -1)


@pytest.mark.parametrize("like", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("outer_jit", [False, True], ids=["eager", "jit"])
def test_nvfp4_block_scales_divide_exactly(like, outer_jit):
    amax = reciprocal_sensitive_amaxes()
    assert len(amax) >= 10
    quantize = functools.partial(jquant.quantize, fmt="nvfp4", like=like, global_scale=None)
    quantize = jax.jit(quantize) if outer_jit else quantize
    np.testing.assert_array_equal(u8(quantize(blocks_with_amax(amax)).scale).ravel(),
                                  e4m3_of(np.clip(amax / np.float32(6), 2.0 ** -6, 448)))


@pytest.mark.parametrize("outer_jit", [False, True], ids=["eager", "jit"])
def test_modelopt_global_scale_divides_exactly(outer_jit):
    rng = np.random.default_rng(3)
    amax = rng.uniform(0.5, 100, 4000).astype(np.float32)
    amax = amax[amax / np.float32(2688) != amax * (np.float32(1) / np.float32(2688))][:8]
    assert len(amax) == 8
    quantize = functools.partial(jquant.quantize, fmt="nvfp4", like="modelopt")
    quantize = jax.jit(quantize) if outer_jit else quantize
    for a in amax:
        x = np.full((1, 16), 0.25, np.float32)
        x[0, 7] = a
        qt = quantize(x)
        assert i32(qt.global_scale) == i32(a / np.float32(2688))
        assert u8(qt.scale)[0, 0] == e4m3_of(np.clip((a / np.float32(6)) / (a / np.float32(2688)), 2.0 ** -6, 448))


def test_bnb_golden_preset():
    """like="bitsandbytes" sets nothing (jquant's defaults are bnb's) and reproduces its goldens."""
    import json
    golden = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "bitsandbytes_4bit.npz")
    cases = json.loads(str(golden["cases"]))
    assert preset_options("bitsandbytes", "nf4") == {}
    for case in ("nf4_small", "fp4_small_dq"):
        params = cases[case]
        x = golden["input__" + params["input"]]
        x = x.view(ml_dtypes.bfloat16) if params["dtype"] == "bfloat16" else x
        fmt = {"nf4": "nf4", "fp4": "fp4_bnb"}[params["quant_type"]]
        qt = jquant.quantize(x, fmt, like="bitsandbytes", blocksize=params["blocksize"],
                             compress_statistics=params["compress_statistics"])
        np.testing.assert_array_equal(np.asarray(qt.data), golden[f"{case}__weight"].reshape(-1))
        absmax = qt.scale.data if params["compress_statistics"] else qt.scale
        np.testing.assert_array_equal(np.asarray(absmax), golden[f"{case}__absmax"])


def test_nvfp4_compressed_tensors_bf16_amax_past_2_126():
    """bf16 weights: 1/amax is a float32 subnormal, then rounded to bf16's subnormal grid (2^-133)."""
    x = G["x_bf16_big"].view(ml_dtypes.bfloat16)
    for r in range(x.shape[0]):
        qt = jquant.quantize(x[r:r + 1], "nvfp4", like="compressed-tensors")
        assert i32(np.asarray(qt.global_scale).reshape(1)) == i32(G["ct_nvfp4_bf16_big_global"][r])
        np.testing.assert_array_equal(u8(qt.scale), G["ct_nvfp4_bf16_big_scale"][r])
        np.testing.assert_array_equal(np.asarray(qt.data), G["ct_nvfp4_bf16_big_packed"][r])
        # Not NaN (a flushed reciprocal gave global 0); near bf16's max, code 6 · s / global may overflow.
        assert not np.isnan(np.asarray(qt.dequantize(jnp.float32))).any()


def test_gguf_mxfp4_inf_block_saturates_to_the_largest_value_it_holds():
    # Documented: like="gguf" keeps torchao's NaN / Inf scale bytes, but GGML's grid stops at 3 under
    # byte 253, so ±Inf comes back as ±3 * 2**126 (finite), and NaN stays NaN.
    x = np.random.default_rng(7).normal(size=(4, 64)).astype(np.float32)
    x[0, 3], x[1, 5], x[2, 7] = np.inf, np.nan, -np.inf
    g = jquant.quantize(jnp.asarray(x), "mxfp4", like="gguf")
    t = jquant.quantize(jnp.asarray(x), "mxfp4", like="torchao")
    np.testing.assert_array_equal(np.asarray(g.scale).view(np.uint8), np.asarray(t.scale).view(np.uint8))
    got = np.asarray(g.dequantize())
    assert got[0, 3] == np.float32(3 * 2.0**126) and got[2, 7] == -np.float32(3 * 2.0**126)
    assert np.isnan(got[1, 5]) and np.isinf(np.asarray(t.dequantize())[0, 3])
