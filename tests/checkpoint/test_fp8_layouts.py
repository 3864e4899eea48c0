"""FP8 checkpoint layouts: compressed-tensors goldens, export → import identity, detection, errors."""

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.formats import fp8

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def weight(shape=(40, 72), seed=0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.05).astype(dtype)


def from_bits(a):
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def assert_same_qtensor(a, b):
    assert (a.fmt, a.shape, a.block, a.options, a.dtype) == (b.fmt, b.shape, b.block, b.options, b.dtype)
    assert a.scale.dtype == b.scale.dtype and a.scale.shape == b.scale.shape
    np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(a.scale).view(np.uint8), np.asarray(b.scale).view(np.uint8))


# ---- compressed-tensors 0.20.1 goldens ---------------------------------------------------------------

CT_CASES = {
    "channel_f32": ("x_f32", {"granularity": "channel"}),
    "tensor_f32": ("x_f32", {"granularity": "tensor"}),
    # llm-compressor keeps scales in the weight's dtype.
    "channel_bf16": ("x_bf16", {"granularity": "channel", "scale_dtype": jnp.bfloat16}),
    "block128_bf16": ("x_block_bf16", {"granularity": "block", "scale_dtype": jnp.bfloat16}),
    "block32_f32": ("x_block_f32", {"granularity": "block", "block_size": (32, 32)}),
}


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_golden(case, use_jit):
    g = np.load(GOLDENS / "compressed_tensors_fp8.npz")
    input_name, opts = CT_CASES[case]

    def quantize(x):
        return fp8.quantize_fp8(x, **opts)

    qt = (jax.jit(quantize) if use_jit else quantize)(jnp.asarray(from_bits(g[input_name])))
    tensors = to_checkpoint(qt, "compressed-tensors")
    assert sorted(tensors) == list(g[f"{case}_names"])
    for name in tensors:
        expected = g[f"{case}_{name}"]
        expected = expected.view(E4M3) if name == "weight" else from_bits(expected)
        assert tensors[name].dtype == expected.dtype and tensors[name].shape == expected.shape, name
        np.testing.assert_array_equal(tensors[name].view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_golden_imports(case):
    g = np.load(GOLDENS / "compressed_tensors_fp8.npz")
    tensors = {"weight": g[f"{case}_weight"].view(E4M3), "weight_scale": from_bits(g[f"{case}_weight_scale"])}
    block_size = CT_CASES[case][1].get("block_size", (128, 128))
    qt = from_checkpoint(tensors, "compressed-tensors", block_size=block_size)
    assert qt.option("granularity") == CT_CASES[case][1]["granularity"]
    scale = np.asarray(tensors["weight_scale"], np.float32)
    if qt.option("granularity") == "block":
        scale = np.kron(scale, np.ones(block_size, np.float32))[: qt.shape[0], : qt.shape[1]]
    expected = tensors["weight"].astype(np.float32) * scale
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), expected)


# ---- export → import ----------------------------------------------------------------------------------

ROUND_TRIPS = [
    ("compressed-tensors", {"granularity": "tensor"}, {}),
    ("compressed-tensors", {"granularity": "channel", "scale_dtype": jnp.bfloat16}, {}),
    ("compressed-tensors", {"granularity": "block", "block_size": (16, 32)}, {"block_size": (16, 32)}),
    ("modelopt", {"granularity": "tensor"}, {}),
    ("fp8", {"granularity": "tensor"}, {}),
    ("fp8", {"granularity": "channel"}, {}),
    ("fp8-block", {"granularity": "block", "block_size": (16, 32)}, {"block_size": (16, 32)}),
    ("fp8-block", {"granularity": "block", "block_size": (16, 32), "ue8m0": True}, {"block_size": (16, 32)}),
]


@pytest.mark.parametrize("layout, opts, meta", ROUND_TRIPS,
                         ids=[f"{layout}-{opts['granularity']}-{i}" for i, (layout, opts, _) in enumerate(ROUND_TRIPS)])
def test_export_import_is_identical(layout, opts, meta):
    qt = fp8.quantize_fp8(weight(), **opts)
    tensors = to_checkpoint(qt, layout, input_scale=0.25) if layout != "fp8-block" else to_checkpoint(qt, layout)
    assert tensors["weight"].dtype == E4M3 and tensors["weight"].shape == (40, 72)
    back = from_checkpoint(tensors, layout, dtype=qt.dtype, **meta)
    assert_same_qtensor(back, qt)


def test_stored_shapes_and_dtypes():
    w = weight()
    tensor, channel = (fp8.quantize_fp8(w, granularity=g) for g in ("tensor", "channel"))
    block = fp8.quantize_fp8(w, granularity="block")
    ct = to_checkpoint(tensor, "compressed-tensors", input_scale=0.5)
    assert ct["weight_scale"].shape == (1,) and ct["input_scale"].shape == (1,)
    assert ct["input_scale"].dtype == np.float32
    assert to_checkpoint(channel, "compressed-tensors")["weight_scale"].shape == (40, 1)
    assert to_checkpoint(block, "compressed-tensors")["weight_scale"].shape == (1, 1)
    modelopt = to_checkpoint(tensor, "modelopt", input_scale=0.5)
    assert modelopt["weight_scale"].shape == () and modelopt["input_scale"].shape == ()
    assert modelopt["weight_scale"].dtype == np.float32
    assert to_checkpoint(channel, "fp8")["weight_scale"].shape == (40, 1)
    ds = to_checkpoint(block, "fp8-block")
    assert sorted(ds) == ["weight", "weight_scale_inv"] and ds["weight_scale_inv"].shape == (1, 1)


def test_variant_detection():
    qt = fp8.quantize_fp8(weight(), granularity="channel")
    ct = to_checkpoint(qt, "compressed-tensors")
    assert_same_qtensor(from_checkpoint(ct, "compressed-tensors"), qt)
    tensor_qt = fp8.quantize_fp8(weight(), granularity="tensor")
    modelopt = to_checkpoint(tensor_qt, "modelopt", input_scale=1.0)
    assert_same_qtensor(from_checkpoint(modelopt, "modelopt"), tensor_qt)


def test_imports_accept_scalar_or_one_element_scales():
    qt = fp8.quantize_fp8(weight(), granularity="tensor")
    tensors = to_checkpoint(qt, "fp8")
    for shape in ((), (1,)):
        scaled = {**tensors, "weight_scale": tensors["weight_scale"].reshape(shape)}
        assert_same_qtensor(from_checkpoint(scaled, "fp8"), qt)
        assert_same_qtensor(from_checkpoint(scaled, "compressed-tensors", variant="float-quantized"), qt)


# ---- errors ----------------------------------------------------------------------------------------------

def _ct_tensors():
    return to_checkpoint(fp8.quantize_fp8(weight(), granularity="channel"), "compressed-tensors")


@pytest.mark.parametrize("layout, tensors, match", [
    ("compressed-tensors/float-quantized", {"weight_scale": np.ones((40, 1), np.float32)}, "missing.*weight"),
    ("compressed-tensors/float-quantized", {**_ct_tensors(), "weight": np.ones((40, 72), np.float32)},
     "'weight' must be float8_e4m3fn"),
    ("compressed-tensors/float-quantized", {**_ct_tensors(), "weight_scale": np.ones((40, 2), np.float32)},
     r"'weight_scale' has shape \(40, 2\)"),
    ("compressed-tensors/float-quantized", {**_ct_tensors(), "weight_scale": np.ones((40, 1), np.int32)},
     "'weight_scale' must be"),
    ("compressed-tensors/float-quantized", {**_ct_tensors(), "input_scale": np.ones((2,), np.float32)},
     "'input_scale'"),
    ("compressed-tensors/float-quantized", {**_ct_tensors(), "weight_zero_point": np.ones((40, 1), np.float32)},
     "zero_point"),
    ("fp8", {**_ct_tensors(), "weight_scale": np.ones((40, 1), np.float16)}, "'weight_scale' must be"),
    ("modelopt/fp8", _ct_tensors(), r"'weight_scale' has shape \(40, 1\)"),
    ("fp8-block", {"weight": _ct_tensors()["weight"], "weight_scale_inv": np.ones((2, 2), np.float32)},
     r"'weight_scale_inv' has shape \(2, 2\).*\[1, 1\]"),
    ("fp8-block", _ct_tensors(), "missing.*weight_scale_inv"),
    ("fp8", {**_ct_tensors(), "weight": _ct_tensors()["weight"][None]}, r"\[N, K\]"),
])
def test_import_errors_name_the_tensor(layout, tensors, match):
    with pytest.raises(ValueError, match=match):
        from_checkpoint(tensors, layout)


def test_export_errors():
    w = weight()
    channel = fp8.quantize_fp8(w, granularity="channel")
    with pytest.raises(ValueError, match="128 × 128 block scales"):  # FP8_PB_WO's blocks, as vLLM reads them
        to_checkpoint(fp8.quantize_fp8(w, granularity="block", block_size=(8, 8)), "modelopt")
    with pytest.raises(ValueError, match="block scales"):
        to_checkpoint(channel, "fp8-block")
    with pytest.raises(ValueError, match="cannot store"):
        to_checkpoint(fp8.quantize_fp8(w, fmt="fp8_e5m2"), "fp8")
    with pytest.raises(ValueError, match="block"):
        to_checkpoint(fp8.quantize_fp8(w, granularity="channel", axis=0), "fp8")
    with pytest.raises(ValueError, match="2-D"):
        to_checkpoint(fp8.quantize_fp8(weight((2, 4, 8)), granularity="block", block_size=(2, 4)), "fp8-block")
    with pytest.raises(ValueError, match="input_scale"):
        to_checkpoint(channel, "fp8", input_scale=np.ones(3, np.float32))
    ue8m0 = fp8.quantize_fp8(w, granularity="block", ue8m0=True, scale_dtype=jnp.float8_e8m0fnu)
    with pytest.raises(ValueError, match="scale_dtype"):
        to_checkpoint(ue8m0, "compressed-tensors")
    stored = to_checkpoint(ue8m0, "fp8-block")["weight_scale_inv"]  # widened to fp32 exactly
    assert stored.dtype == np.float32
    np.testing.assert_array_equal(stored, np.asarray(ue8m0.scale, np.float32))
    with pytest.raises(TypeError, match="QTensor"):
        jquant.to_checkpoint(np.ones(3), "fp8")


def test_a_weight_of_exactly_one_block_stays_block_scaled():
    """128 × 128 with 128 × 128 blocks: its block equals its shape, but it is block FP8, not per tensor."""
    import jquant
    w = np.random.default_rng().standard_normal((128, 128)).astype(np.float32)
    qt = jquant.quantize(w, "fp8_e4m3", granularity="block", block_size=(128, 128))
    for layout in ("fp8-block", "compressed-tensors/float-quantized"):
        back = jquant.from_checkpoint(jquant.to_checkpoint(qt, layout), layout)
        assert back.option("granularity") == "block"
        np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(qt.dequantize()))
    with pytest.raises(ValueError, match="stores block scales"):
        jquant.to_checkpoint(jquant.quantize(w, "fp8_e4m3"), "fp8-block")   # per tensor: refused


# ---- compressed-tensors mxfp8-quantized ----------------------------------------------------------------

CT_MXFP8 = "compressed-tensors/mxfp8-quantized"


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", ["w_f32", "w_bf16"])
def test_compressed_tensors_mxfp8_golden(case, use_jit):
    """MXFP8A16 as compressed-tensors 0.20.1 quantizes, stores and dequantizes it: the golden holds group
    amaxes at 1.5 · 2^k and around 1.75 · 2^k (its scale rounds the amax to one mantissa bit), e4m3
    midpoints, a zero and a tiny group, and -0.0 (kept as -0)."""
    g = np.load(GOLDENS / "compressed_tensors_mxfp8.npz")
    x = from_bits(g[case])
    scheme = jquant.get_scheme("mxfp8_ct")
    qt = (jax.jit(scheme.quantize_weight) if use_jit else scheme.quantize_weight)(x)
    tensors = to_checkpoint(qt, "compressed-tensors")
    assert sorted(tensors) == ["weight", "weight_scale"] and tensors["weight"].dtype == E4M3
    np.testing.assert_array_equal(tensors["weight"].view(np.uint8), g[f"{case}_weight"])
    assert tensors["weight_scale"].dtype == np.uint8
    np.testing.assert_array_equal(tensors["weight_scale"], g[f"{case}_weight_scale"])
    assert (g[f"{case}_weight"] == 0x80).any()          # a -0.0 weight stays -0 in e4m3
    restored = from_checkpoint({"weight": g[f"{case}_weight"].view(E4M3),
                                "weight_scale": g[f"{case}_weight_scale"]}, "compressed-tensors")
    assert restored.fmt == "mxfp8_e4m3" and restored.shape == x.shape
    np.testing.assert_array_equal(np.asarray(restored.dequantize(jnp.bfloat16)).view(np.uint16),
                                  g[f"{case}_dequantized"])
    # torchao's "even" rounds the amax to e4m3's three mantissa bits, OCP's "floor" not at all: both
    # choose other scales than compressed-tensors for some of these groups.
    for mode in ("even", "floor"):
        other = to_checkpoint(jquant.quantize(x, "mxfp8_e4m3", scale_mode=mode), CT_MXFP8)
        assert (other["weight_scale"] != g[f"{case}_weight_scale"]).any(), mode


def test_compressed_tensors_mxfp8_scale_rounds_the_amax_to_one_mantissa_bit():
    x = np.zeros((4, 32), np.float32)
    x[:, 0] = [1.7499999, 1.75, 3.5, 448.0]    # 1.75 · 2^k and up round to 2^(k+1); E4M3's emax is 8
    scale = np.asarray(jquant.quantize(x, "mxfp8_e4m3", like="compressed-tensors").scale).view(np.uint8)
    np.testing.assert_array_equal(scale[:, 0].astype(int) - 127, [0 - 8, 1 - 8, 2 - 8, 9 - 8])


def test_compressed_tensors_mxfp8_round_trip_and_refusals():
    qt = jquant.quantize(weight((8, 64), seed=3), "mxfp8_e4m3", like="compressed-tensors")
    tensors = to_checkpoint(qt, CT_MXFP8)
    assert_same_qtensor(from_checkpoint(tensors, "compressed-tensors"), qt)
    with pytest.raises(ValueError, match="group_size=16"):
        from_checkpoint(tensors, CT_MXFP8, group_size=16)
    with pytest.raises(ValueError, match=r"\[N, K/32\]"):
        from_checkpoint(dict(tensors, weight_scale=np.zeros((8, 4), np.uint8)), CT_MXFP8)
    with pytest.raises(ValueError, match="'weight_scale' must be"):
        from_checkpoint(dict(tensors, weight_scale=tensors["weight_scale"].astype(np.float32)), CT_MXFP8)
    with pytest.raises(ValueError, match="'weight' must be float8_e4m3fn"):
        from_checkpoint(dict(tensors, weight=tensors["weight"].view(np.uint8)), CT_MXFP8)
    with pytest.raises(ValueError, match="stores \\[N, K\\] 'mxfp8_e4m3' QTensors"):
        to_checkpoint(jquant.quantize(weight((64, 64)), "mxfp8_e4m3", axis=0), CT_MXFP8)
    # Float scales still mean float-quantized FP8, uint8 exponents MXFP8.
    fp8_channel = to_checkpoint(jquant.quantize(weight((8, 64)), "fp8_e4m3", granularity="channel"),
                                "compressed-tensors")
    assert from_checkpoint(fp8_channel, "compressed-tensors").fmt == "fp8_e4m3"


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", ["x", "w_f32", "w_bf16"])
def test_modelopt_mxfp8_golden(case, use_jit):
    """Model Optimizer 0.47.0's MXFP8QTensor export (2^ceil(log2(amax / 448)) in float32, elements times
    2^(127 - b), 2^127 under byte 0) on the adversarial rows and on groups from 2^-140 to 2^120, through
    the mxfp8_modelopt scheme and the modelopt layout, and its dequantization."""
    g = np.load(GOLDENS / "modelopt_mxfp8.npz")
    x = from_bits(g[case])
    scheme = jquant.scheme_from_config({"quant_method": "modelopt", "quant_algo": "MXFP8"})
    qt = (jax.jit(scheme.quantize_weight) if use_jit else scheme.quantize_weight)(x)
    tensors = to_checkpoint(qt, "modelopt")
    np.testing.assert_array_equal(tensors["weight_scale"], g[f"{case}_scale"])
    np.testing.assert_array_equal(tensors["weight"].view(np.uint8), g[f"{case}_codes"])
    assert (g[f"{case}_scale"] == 0).any()   # byte 0: the 2^127 multiplier is tested
    restored = from_checkpoint(tensors, "modelopt")
    assert restored.fmt == "mxfp8_e4m3"
    np.testing.assert_array_equal(np.asarray(restored.dequantize(jnp.float32)).view(np.uint32),
                                  g[f"{case}_dequantized"].view(np.uint32))
    # torchao's rceil multiplies byte-0 blocks by 1: other codes there.
    torchao = np.asarray(jquant.quantize(x, "mxfp8_e4m3", scale_mode="rceil_log2f").data).view(np.uint8)
    assert (torchao != g[f"{case}_codes"]).any()


def test_mx_element_rounding_refusals_name_the_options():
    w = weight((4, 64))
    with pytest.raises(ValueError, match="element_rounding='modelopt' .* got fmt='mxfp4', scale_mode='rceil'"):
        jquant.quantize(w, "mxfp4", scale_mode="rceil", element_rounding="modelopt")
    with pytest.raises(ValueError, match="an rceil scale_mode, got fmt='mxfp8_e4m3', scale_mode='floor'"):
        jquant.quantize(w, "mxfp8_e4m3", scale_mode="floor", element_rounding="modelopt")
    with pytest.raises(ValueError, match="scale_mode must be one of"):
        jquant.quantize(w, "mxfp8_e4m3", scale_mode="even1")
