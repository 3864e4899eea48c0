"""FP4 checkpoint layouts: gpt-oss (transformers golden), compressed-tensors nvfp4-pack-quantized
(compressed-tensors golden), ModelOpt NVFP4; export → import bit-identical; malformed tensors."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.checkpoint import fp4_layouts

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"
CT = "compressed-tensors"
CT_VARIANT = "nvfp4-pack-quantized"


def random(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def assert_round_trip(qt, tensors, layout, **meta):
    back = jquant.from_checkpoint(tensors, layout, **meta)
    for name in ("data", "scale", "global_scale"):
        original, restored = getattr(qt, name), getattr(back, name)
        if original is None:
            continue
        assert restored.dtype == original.dtype, name
        np.testing.assert_array_equal(np.atleast_1d(restored).view(np.uint8),
                                      np.atleast_1d(original).view(np.uint8))
    for name in ("shape", "block", "pack_axis", "options"):
        assert getattr(back, name) == getattr(qt, name), name
    chex.assert_trees_all_equal(back.dequantize(jnp.bfloat16), qt.dequantize(jnp.bfloat16))
    return back


# ---- gpt-oss (MXFP4) -----------------------------------------------------------------------------------

def test_gpt_oss_matches_transformers_dequantize():
    g = np.load(GOLDENS / "transformers_gptoss.npz")
    assert jquant.from_checkpoint({"blocks": g["blocks"], "scales": g["scales"]}, "gpt-oss").dtype == jnp.float32
    qt = jquant.from_checkpoint({"blocks": g["blocks"], "scales": g["scales"]}, "gpt-oss", dtype=jnp.bfloat16)
    assert qt.fmt == "mxfp4" and qt.shape == (2, 24, 128) and qt.dtype == jnp.bfloat16
    # transformers returns the experts transposed to [E, K, N].
    expected = g["dequantized_bf16"].view(ml_dtypes.bfloat16).transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(qt.dequantize(qt.dtype)).view(np.uint16), expected.view(np.uint16))
    tensors = jquant.to_checkpoint(qt, "gpt-oss")
    np.testing.assert_array_equal(tensors["blocks"], g["blocks"])
    np.testing.assert_array_equal(tensors["scales"], g["scales"])


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_gpt_oss_round_trip(mode):
    qt = jquant.quantize(random((2, 8, 64)).astype(jnp.bfloat16), "mxfp4", scale_mode=mode)
    tensors = jquant.to_checkpoint(qt, "gpt-oss")
    assert tensors["blocks"].dtype == np.uint8 and tensors["blocks"].shape == (2, 8, 2, 16)
    assert tensors["scales"].dtype == np.uint8 and tensors["scales"].shape == (2, 8, 2)
    assert_round_trip(qt, tensors, "gpt-oss")


# ---- compressed-tensors nvfp4-pack-quantized -------------------------------------------------------------

@pytest.mark.parametrize("case", ["w_f32", "w_bf16"])
def test_compressed_tensors_golden(case):
    g = np.load(GOLDENS / "compressed_tensors_nvfp4.npz")
    x = g[case].view(ml_dtypes.bfloat16) if g[case].dtype == np.uint16 else g[case]
    tensors = jquant.to_checkpoint(jquant.quantize(x, "nvfp4"), CT)
    assert sorted(tensors) == ["weight_global_scale", "weight_packed", "weight_scale"]
    np.testing.assert_array_equal(tensors["weight_packed"], g[f"{case}_weight_packed"])
    assert tensors["weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(tensors["weight_scale"].view(np.uint8), g[f"{case}_weight_scale"])
    assert tensors["weight_global_scale"].dtype == np.float32
    np.testing.assert_array_equal(tensors["weight_global_scale"], g[f"{case}_weight_global_scale"])
    # Reading the golden's tensors back dequantizes exactly as NVFP4PackedCompressor.decompress.
    golden_tensors = {"weight_packed": g[f"{case}_weight_packed"],
                      "weight_scale": g[f"{case}_weight_scale"].view(ml_dtypes.float8_e4m3fn),
                      "weight_global_scale": g[f"{case}_weight_global_scale"]}
    restored = jquant.from_checkpoint(golden_tensors, CT, variant=CT_VARIANT)
    np.testing.assert_array_equal(np.asarray(restored.dequantize(jnp.bfloat16)).view(np.uint16),
                                  g[f"{case}_dequantized_bf16"])


def test_compressed_tensors_round_trip_and_detect():
    qt = jquant.quantize(random((8, 64)), "nvfp4")
    tensors = jquant.to_checkpoint(qt, CT, input_global_scale=np.float32(7.5))
    assert tensors["weight_packed"].shape == (8, 32) and tensors["weight_scale"].shape == (8, 4)
    assert tensors["weight_global_scale"].shape == (1,) and tensors["input_global_scale"].shape == (1,)
    assert_round_trip(qt, tensors, CT)  # the variant is detected from the tensors
    assert float(fp4_layouts.nvfp4_input_global_scale(tensors)) == 7.5
    as_modelopt = fp4_layouts.nvfp4_input_global_scale(tensors, "modelopt")
    assert float(as_modelopt) == np.float32(1) / np.float32(7.5)


# ---- ModelOpt NVFP4 -------------------------------------------------------------------------------------

def test_modelopt_round_trip():
    qt = jquant.quantize(random((8, 64), seed=1), "nvfp4", convention="modelopt")
    tensors = jquant.to_checkpoint(qt, "modelopt", input_scale=0.25)
    assert sorted(tensors) == ["input_scale", "weight", "weight_scale", "weight_scale_2"]
    assert tensors["weight"].dtype == np.uint8 and tensors["weight"].shape == (8, 32)
    assert tensors["weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    assert tensors["weight_scale"].shape == (8, 4)
    assert tensors["weight_scale_2"].dtype == np.float32 and tensors["weight_scale_2"].shape == ()
    assert_round_trip(qt, tensors, "modelopt")
    assert float(fp4_layouts.nvfp4_input_global_scale(tensors, "modelopt")) == 0.25
    assert float(fp4_layouts.nvfp4_input_global_scale(tensors)) == 4.0
    # A [1]-shaped weight_scale_2 reads the same.
    as_vector = dict(tensors, weight_scale_2=tensors["weight_scale_2"].reshape(1))
    chex.assert_trees_all_equal(jquant.from_checkpoint(as_vector, "modelopt"),
                                jquant.from_checkpoint(tensors, "modelopt"))


def test_cross_convention_export_uses_the_reciprocal():
    x = random((4, 32), seed=2)
    ct = jquant.quantize(x, "nvfp4")
    tensors = jquant.to_checkpoint(ct, "modelopt")
    np.testing.assert_array_equal(tensors["weight"], np.asarray(ct.data))
    assert tensors["weight_scale_2"] == np.float32(1) / np.asarray(ct.global_scale)
    restored = jquant.from_checkpoint(tensors, "modelopt")
    np.testing.assert_allclose(np.asarray(restored.dequantize(jnp.float32)), np.asarray(ct.dequantize()),
                               rtol=1e-6)
    # Without a per-tensor scale the layouts write 1.0, which dequantizes identically.
    single = jquant.quantize(x, "nvfp4", global_scale=None)
    written = jquant.to_checkpoint(single, CT)
    assert written["weight_global_scale"].tolist() == [1.0]
    restored = jquant.from_checkpoint(written, CT, variant=CT_VARIANT)
    chex.assert_trees_all_equal(restored.dequantize(jnp.float32), single.dequantize())


def test_cross_convention_export_that_changes_values_needs_lossy():
    x = random((4, 32), seed=1)  # its reciprocal global scale moves 61 of the 128 values by 1 ulp
    ct = jquant.quantize(x, "nvfp4")
    with pytest.raises(ValueError, match=r"modelopt/nvfp4: tensor 'weight_scale_2' \(the compressed-tensors "
                                         r"per-tensor scale .* stored as its float32 reciprocal .*\) dequantized "
                                         r"changes \d+ of 128 values, by up to .*convention='modelopt'"):
        jquant.to_checkpoint(ct, "modelopt")
    with pytest.warns(UserWarning, match="lossy=True"):
        tensors = jquant.to_checkpoint(ct, "modelopt", lossy=True)
    assert tensors["weight_scale_2"] == np.float32(1) / np.asarray(ct.global_scale)
    modelopt = jquant.quantize(x, "nvfp4", convention="modelopt")
    with pytest.raises(ValueError, match=r"tensor 'weight_global_scale'.*convention='compressed-tensors'"):
        jquant.to_checkpoint(modelopt, CT)
    # A power-of-two per-tensor scale has an exact reciprocal: no error, identical values.
    pow2 = ct.replace(global_scale=jnp.float32(1024.0))
    restored = jquant.from_checkpoint(jquant.to_checkpoint(pow2, "modelopt"), "modelopt")
    np.testing.assert_array_equal(np.asarray(restored.dequantize(jnp.float32)), np.asarray(pow2.dequantize()))


def test_nvfp4_group_size_other_than_16_is_refused():
    x = random((4, 64), seed=3)
    for layout, variant in (("modelopt", None), (CT, CT_VARIANT)):
        tensors = jquant.to_checkpoint(jquant.quantize(x, "nvfp4", convention=layout if variant is None
                                                       else "compressed-tensors"), layout)
        with pytest.raises(ValueError, match=r"group_size=32 given, but NVFP4 blocks are 16 elements"):
            jquant.from_checkpoint(tensors, layout, variant=variant, group_size=32)
        assert jquant.from_checkpoint(tensors, layout, variant=variant, group_size=16).block == (1, 16)
        scale = tensors["weight_scale"][:, ::2]  # one scale per 32 elements: a group-size-32 checkpoint
        with pytest.raises(ValueError, match=r"'weight_scale' \(4, 2\) holds one scale per 32 elements of K=64 "
                                             r".*blocks are 16 elements \(group_size 16\)"):
            jquant.from_checkpoint(dict(tensors, weight_scale=scale), layout, variant=variant)


def test_loaded_qtensors_are_float32_unless_asked():
    qt = jquant.quantize(random((4, 64), seed=4).astype(jnp.bfloat16), "nvfp4")
    tensors = jquant.to_checkpoint(qt, CT)
    assert jquant.from_checkpoint(tensors, CT, variant=CT_VARIANT).dtype == jnp.float32
    assert jquant.from_checkpoint(tensors, CT, variant=CT_VARIANT, dtype=jnp.bfloat16).dtype == jnp.bfloat16


# ---- malformed tensors and wrong QTensors --------------------------------------------------------------

def ct_tensors():
    return jquant.to_checkpoint(jquant.quantize(random((4, 32)), "nvfp4"), CT)


@pytest.mark.parametrize("layout,tensors,pattern", [
    ("gpt-oss", {"blocks": np.zeros((4, 2, 16), np.uint8)}, r"missing tensor\(s\) \['scales'\]"),
    ("gpt-oss", {"blocks": np.zeros((4, 2, 8), np.uint8), "scales": np.zeros((4, 2), np.uint8)},
     r"'blocks' \(4, 2, 8\) and 'scales' \(4, 2\)"),
    ("gpt-oss", {"blocks": np.zeros((4, 2, 16), np.int8), "scales": np.zeros((4, 2), np.uint8)},
     "'blocks' must be uint8"),
    ("modelopt", {"weight": np.zeros((4, 16), np.uint8), "weight_scale_2": np.float32(1),
                  "weight_scale": np.zeros((4, 3), ml_dtypes.float8_e4m3fn)},
     r"'weight' \(4, 16\) and 'weight_scale' \(4, 3\)"),
    ("modelopt", {"weight": np.zeros((4, 16), np.uint8), "weight_scale_2": np.ones(2, np.float32),
                  "weight_scale": np.zeros((4, 2), ml_dtypes.float8_e4m3fn)}, "'weight_scale_2' must be"),
])
def test_malformed_tensors(layout, tensors, pattern):
    with pytest.raises(ValueError, match=pattern):
        jquant.from_checkpoint(tensors, layout)


@pytest.mark.parametrize("name,value,pattern", [
    ("weight_packed", np.zeros((4, 16), np.int32), "'weight_packed' must be uint8"),
    ("weight_scale", np.zeros((4, 2), np.float32), "'weight_scale' must be float8_e4m3fn"),
    ("weight_scale", np.zeros((4, 4), ml_dtypes.float8_e4m3fn),
     r"'weight_scale' \(4, 4\) holds one scale per 8 elements of K=32"),
    ("weight_scale", np.zeros((4, 3), ml_dtypes.float8_e4m3fn),
     r"'weight_packed' \(4, 16\) and 'weight_scale' \(4, 3\)"),
    ("weight_global_scale", np.ones((1, 2), np.float32), "'weight_global_scale' must be"),
])
def test_malformed_compressed_tensors(name, value, pattern):
    tensors = dict(ct_tensors(), **{name: value})
    with pytest.raises(ValueError, match=pattern):
        jquant.from_checkpoint(tensors, CT, variant=CT_VARIANT)


def test_wrong_qtensors():
    with pytest.raises(ValueError, match="blocked by 32 and packed along K"):
        jquant.to_checkpoint(jquant.quantize(random((64, 4)), "mxfp4", axis=0), "gpt-oss")
    with pytest.raises(ValueError, match="cannot store"):
        jquant.to_checkpoint(jquant.quantize(random((4, 64)), "mxfp4"), "modelopt/nvfp4")
    mx = jquant.quantize(random((4, 64)), "mxfp4")
    with pytest.raises(ValueError, match="gpt-oss stores scales as E8M0 bytes, got a QTensor with float32"):
        jquant.to_checkpoint(mx.replace(scale=mx.scale.astype(jnp.float32)), "gpt-oss")
    with pytest.raises(ValueError, match="input_global_scale must be a scalar"):
        jquant.to_checkpoint(jquant.quantize(random((4, 32)), "nvfp4"), CT, input_global_scale=np.ones(2))


# ---- compressed-tensors mxfp4-pack-quantized -------------------------------------------------------------

CT_MXFP4 = "compressed-tensors/mxfp4-pack-quantized"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", ["w_f32", "w_bf16"])
def test_compressed_tensors_mxfp4_golden(case, jit):
    """MXFP4A16 as compressed-tensors 0.20.1 quantizes, packs and dequantizes it (the golden holds group
    amaxes around the 1.75 · 2^k round-up, E2M1 midpoints, a zero and a tiny group, and -0.0)."""
    g = np.load(GOLDENS / "compressed_tensors_mxfp4.npz")
    x = g[case].view(ml_dtypes.bfloat16) if g[case].dtype == np.uint16 else g[case]
    assert np.signbit(x[3, [5, 40]]).all() and (x[3, [5, 40]] == 0).all()
    scheme = jquant.get_scheme("mxfp4_ct")
    qt = (jax.jit(scheme.quantize_weight) if jit else scheme.quantize_weight)(x)
    tensors = jquant.to_checkpoint(qt, CT)
    assert sorted(tensors) == ["weight_packed", "weight_scale"]
    np.testing.assert_array_equal(tensors["weight_packed"], g[f"{case}_weight_packed"])
    assert tensors["weight_scale"].dtype == np.uint8
    np.testing.assert_array_equal(tensors["weight_scale"], g[f"{case}_weight_scale"])
    restored = jquant.from_checkpoint({"weight_packed": g[f"{case}_weight_packed"],
                                       "weight_scale": g[f"{case}_weight_scale"]}, CT)   # variant detected
    assert restored.fmt == "mxfp4" and restored.shape == x.shape
    np.testing.assert_array_equal(np.asarray(restored.dequantize(jnp.bfloat16)).view(np.uint16),
                                  g[f"{case}_dequantized"])
    # The OCP "floor" scale (the mxfp4 scheme) differs from compressed-tensors' where amax ≥ 1.75 · 2^e.
    floor = jquant.to_checkpoint(jquant.quantize(x, "mxfp4"), CT_MXFP4)
    assert (floor["weight_scale"] != g[f"{case}_weight_scale"]).any()


def test_compressed_tensors_mxfp4_keeps_minus_zero_as_plus_zero():
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [-0.0, -0.05, 1.0]     # scale 1/4: -0.05 is -0.2, which rounds to -0
    ct = np.asarray(jquant.quantize(x, "mxfp4", like="compressed-tensors").data)
    torchao = np.asarray(jquant.quantize(x, "mxfp4", scale_mode="even").data)
    # compressed-tensors' sign(x) · |q| then a sign-bit pack: -0.0 stores +0, -0.2 stores -0 (checked
    # against cast_to_fp4 and pack_fp4_to_uint8: bytes 0x80 for [-0.0, -0.2]).
    assert ct[0, 0] & 0x0F == 0x00 and torchao[0, 0] & 0x0F == 0x08
    assert ct[0, 0] >> 4 == 0x08 and torchao[0, 0] >> 4 == 0x08


def test_compressed_tensors_mxfp4_round_trip_and_refusals():
    qt = jquant.quantize(random((8, 64), seed=3), "mxfp4", like="compressed-tensors")
    tensors = jquant.to_checkpoint(qt, CT_MXFP4)
    assert_round_trip(qt, tensors, CT)
    with pytest.raises(ValueError, match="group_size=16"):
        jquant.from_checkpoint(tensors, CT_MXFP4, group_size=16)
    with pytest.raises(ValueError, match=r"one scale per 16 elements of K=64"):
        jquant.from_checkpoint(dict(tensors, weight_scale=np.zeros((8, 4), np.uint8)), CT_MXFP4)
    with pytest.raises(ValueError, match="'weight_scale' must be uint8"):
        jquant.from_checkpoint(dict(tensors, weight_scale=tensors["weight_scale"].astype(np.float32)), CT_MXFP4)
    with pytest.raises(ValueError, match="element_rounding='compressed-tensors'"):
        jquant.quantize(random((2, 32)), "mxfp8_e5m2", element_rounding="compressed-tensors")
    # NVFP4 tensors (with their global scale) are still told apart from MXFP4 ones.
    nv = jquant.to_checkpoint(jquant.quantize(random((8, 64)), "nvfp4"), CT)
    assert jquant.from_checkpoint(nv, CT).fmt == "nvfp4"
