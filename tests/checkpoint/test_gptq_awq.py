"""GPTQ (v1/v2, act-order), AWQ and compressed-tensors pack-quantized checkpoint layouts."""

import functools
import warnings
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.checkpoint.gptq_awq import ct_detect
from jquant.formats import quantize
from jquant.formats.integer import quantize_int_with_params

GOLDENS = pathlib.Path(__file__).parents[1] / "goldens"


def _normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _quantizer(fmt, group, scale_dtype):
    return jax.jit(lambda x: quantize(x, fmt, axis=1, group_size=group, scale_dtype=scale_dtype))


def _qt(fmt, shape=(32, 64), group=32, seed=0, scale_dtype=jnp.float16):
    return _quantizer(fmt, group, scale_dtype)(_normal(seed, shape))


def _load(name):
    golden = np.load(GOLDENS / name)
    cases = sorted({k[: -len("_weight")] for k in golden.files if k.endswith("_weight")})
    return golden, cases


GPTQ, GPTQ_CASES = _load("gptqmodel_gptq.npz")
AWQ, AWQ_CASES = _load("gptqmodel_awq.npz")
CT, CT_CASES = _load("compressed_tensors_int.npz")


# ---- goldens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptqmodel_pack_and_dequantize(case):
    g = {k: GPTQ[f"{case}_{k}"] for k in ("weight", "scales", "zeros", "g_idx", "config")}
    bits, _, sym, _ = (int(v) for v in g["config"])
    qt = quantize_int_with_params(g["weight"], bits, g["scales"], None if sym else g["zeros"], g["g_idx"],
                                  axis=1, scale_dtype=jnp.float16)
    v2 = to_checkpoint(qt, "gptq", checkpoint_format="gptq_v2")
    np.testing.assert_array_equal(v2["qweight"], GPTQ[f"{case}_qweight"])
    np.testing.assert_array_equal(v2["qzeros"], GPTQ[f"{case}_qzeros_v2"])
    np.testing.assert_array_equal(v2["scales"], GPTQ[f"{case}_scales_fp16"])
    np.testing.assert_array_equal(v2["g_idx"], g["g_idx"])
    zero0 = g["zeros"].min() == 0
    if zero0:
        # v1 stores zero - 1: a zero point of 0 would read back as 2**bits in vLLM (gptqmodel's word-wide
        # save borrows from the neighbour instead), so writing it is refused; the field-wise v1 a writer
        # would store still reads back, with a warning.
        with pytest.raises(ValueError, match=r"zero point 0 .* write checkpoint_format='gptq_v2'"):
            to_checkpoint(qt, "gptq", checkpoint_format="gptq")
        v1 = {**v2, "qzeros": GPTQ[f"{case}_qzeros_v1_fields"]}
    else:
        v1 = to_checkpoint(qt, "gptq", checkpoint_format="gptq")
        np.testing.assert_array_equal(v1["qweight"], v2["qweight"])
        # v1 subtracts one per field; gptqmodel's word-wide save agrees when no zero point is 0.
        np.testing.assert_array_equal(v1["qzeros"], GPTQ[f"{case}_qzeros_v1_fields"])
        np.testing.assert_array_equal(v1["qzeros"], GPTQ[f"{case}_qzeros_v1"])
    for tensors, fmt in ((v1, "gptq"), (v2, "gptq_v2")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            back = from_checkpoint(tensors, "gptq", checkpoint_format=fmt, dtype=jnp.float32)
        assert any("read as 0 here" in str(w.message) for w in caught) == (zero0 and fmt == "gptq")
        chex.assert_trees_all_equal(back, qt)
        np.testing.assert_array_equal(np.asarray(back.dequantize(jnp.float16)), GPTQ[f"{case}_dequant"])


@pytest.mark.parametrize("case", AWQ_CASES)
def test_gptqmodel_awq_pack_and_dequantize(case):
    qt = quantize_int_with_params(AWQ[f"{case}_weight"], 4, AWQ[f"{case}_scales"], AWQ[f"{case}_zeros"],
                                  axis=1, scale_dtype=jnp.float16)
    assert qt.block == (1, int(AWQ[f"{case}_group_size"]))
    tensors = to_checkpoint(qt, "awq")
    for name, key in (("qweight", "qweight"), ("qzeros", "qzeros"), ("scales", "scales_fp16")):
        np.testing.assert_array_equal(tensors[name], AWQ[f"{case}_{key}"])
    back = from_checkpoint(tensors, "awq", sym=False, dtype=jnp.float32)
    chex.assert_trees_all_equal(back, qt)
    np.testing.assert_array_equal(np.asarray(back.dequantize(jnp.float16)), AWQ[f"{case}_dequant"])


def _ct_array(case, name, bf16):
    value = CT[f"{case}_{name}"]
    return value.view(jnp.bfloat16) if bf16 and value.dtype == np.uint16 else value


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_pack_quantized(case):
    bits, group, symmetric, bf16 = (int(v) for v in CT[f"{case}_config"])
    fmt = f"{'int' if symmetric else 'uint'}{bits}"
    weight = _ct_array(case, "weight", bf16)
    names = {"weight_packed", "weight_scale", "weight_shape"} | (set() if symmetric else {"weight_zero_point"})
    arithmetics = ["compressed-tensors"] if bf16 else ["compressed-tensors", "float32"]
    for arithmetic in arithmetics:
        # float32 arithmetic equals compressed-tensors' for float32 weights (the symmetric scale is
        # amax / (bit_range / 2): the "full" range); bfloat16 weights need its bf16 op-by-op rounding.
        opts = {"symmetric_range": "full"} if symmetric else {}
        qt = jax.jit(lambda x: quantize(x, fmt, axis=1, group_size=group, scale_dtype=weight.dtype,
                                        arithmetic=arithmetic, **opts))(weight)
        tensors = to_checkpoint(qt, "compressed-tensors")
        assert set(tensors) == names
        for name in names:
            expected = _ct_array(case, name, bf16)
            assert tensors[name].dtype == expected.dtype, name
            np.testing.assert_array_equal(tensors[name], expected, err_msg=f"{name} ({arithmetic})")
        back = from_checkpoint(tensors, "compressed-tensors", dtype=weight.dtype)  # variant by detection
        chex.assert_trees_all_equal(back, qt)


# ---- round trips -----------------------------------------------------------------------------------
@settings(max_examples=12)
@given(layout=st.sampled_from(["gptq", "gptq_v2", "awq", "compressed-tensors"]), sym=st.booleans(),
       bits=st.sampled_from([2, 3, 4, 8]), group=st.sampled_from([32, 64, -1]), seed=st.integers(0, 99))
def test_export_import_is_bit_identical(layout, sym, bits, group, seed):
    if layout == "awq":
        bits = 4
    if layout == "compressed-tensors":
        bits = 8 if bits == 8 else 4
    fmt = f"{'int' if sym else 'uint'}{bits}"
    qt = _qt(fmt, group=group, seed=seed)
    name, opts = ("gptq", {"checkpoint_format": layout}) if layout.startswith("gptq") else (layout, {})
    back = from_checkpoint(to_checkpoint(qt, name, **opts), name, sym=sym, dtype=jnp.float32, **opts)
    chex.assert_trees_all_equal(back, qt)


def test_act_order_round_trip_and_checkpoint_shapes():
    n, k, group = 32, 128, 32
    g_idx = (np.argsort(np.random.default_rng(1).permutation(k)) // group).astype(np.int32)
    scale = np.full((n, k // group), 0.05, np.float32)
    zero = np.random.default_rng(2).integers(1, 8, (n, k // group))  # v1 (the default) stores no zero point 0
    qt = quantize_int_with_params(_normal(2, (n, k)) * 0.2, 3, scale, zero, g_idx,
                                  axis=1, scale_dtype=jnp.float16)
    tensors = to_checkpoint(qt, "gptq", desc_act=True)
    assert {k_: (v.dtype, v.shape) for k_, v in tensors.items()} == {
        "qweight": (np.int32, (k * 3 // 32, n)), "qzeros": (np.int32, (k // group, n * 3 // 32)),
        "scales": (np.float16, (k // group, n)), "g_idx": (np.int32, (k,))}
    back = from_checkpoint(tensors, "gptq", dtype=jnp.float32)
    chex.assert_trees_all_equal(back, qt)
    np.testing.assert_array_equal(np.asarray(back.group_index), g_idx)
    with pytest.raises(ValueError, match="desc_act=False"):
        to_checkpoint(qt, "gptq", desc_act=False)
    with pytest.raises(ValueError, match="desc_act=False"):
        from_checkpoint(tensors, "gptq", desc_act=False)


def test_symmetric_zero_points_and_inference():
    qt = _qt("int4")
    v1 = to_checkpoint(qt, "gptq")
    assert np.all(v1["qzeros"] == 0x77777777)  # v1 symmetric 4-bit: zero 8 stored as 7
    v2 = to_checkpoint(qt, "gptq", checkpoint_format="gptq_v2")
    assert np.all(v2["qzeros"].view(np.uint32) == 0x88888888)
    assert from_checkpoint(v1, "gptq").fmt == "int4"  # inferred: every zero point is 8
    asym = from_checkpoint(v1, "gptq", sym=False, dtype=jnp.float32)
    assert asym.fmt == "uint4" and np.all(np.asarray(asym.zero) == 8)
    np.testing.assert_array_equal(np.asarray(asym.dequantize()), np.asarray(qt.dequantize(jnp.float32)))
    assert from_checkpoint(to_checkpoint(qt, "awq"), "awq").fmt == "int4"
    with pytest.raises(ValueError, match="sym=True but the zero points are not all 8"):
        from_checkpoint(to_checkpoint(_qt("uint4"), "gptq"), "gptq", sym=True)


def test_v1_zero_point_zero_is_refused_on_write_and_warned_on_read():
    """v1 stores zero - 1 and vLLM's v1 decoder adds 1 back: a zero point of 0 (any all-positive
    group of an asymmetric weight) would come back as 16, silently."""
    qt = _qt("uint4")   # [32, 64] in groups of 32: zero points [32, 2], none of them 0
    assert int(qt.zero.min()) > 0
    zero0 = qt.replace(zero=qt.zero.at[5, 1].set(0))
    with pytest.raises(ValueError, match=r"zero point 0 \(output channels \[5\], groups \[1\].*gptq_v2"):
        to_checkpoint(zero0, "gptq")
    v2 = to_checkpoint(zero0, "gptq", checkpoint_format="gptq_v2")
    chex.assert_trees_all_equal(from_checkpoint(v2, "gptq", checkpoint_format="gptq_v2", sym=False,
                                                dtype=jnp.float32), zero0)
    v1 = to_checkpoint(qt, "gptq")
    qzeros = v1["qzeros"].view(np.uint32).copy()   # [groups, N / 8]: channel 5 is nibble 5 of word 0
    qzeros[1, 0] |= np.uint32(0xF << 20)          # the field a writer of zero - 1 stores for 0
    with pytest.warns(UserWarning, match=r"v1 zero-point field holds 15.*read as 0 here, as 16 by vLLM"):
        back = from_checkpoint({**v1, "qzeros": qzeros.view(np.int32)}, "gptq", sym=False, dtype=jnp.float32)
    chex.assert_trees_all_equal(back, zero0)


def test_gptq_float32_scales_are_refused_unless_lossy():
    qt = _qt("uint4", scale_dtype=jnp.float32)
    for layout in ("gptq", "awq"):
        with pytest.raises(ValueError, match=rf"{layout}: tensor 'scales' \(float32 QTensor scales stored as "
                                             r"float16\) changes \d+ of 64 values, by up to .*scale_dtype=jnp.float16"):
            to_checkpoint(qt, layout)
        with pytest.warns(UserWarning, match=rf"{layout}: tensor 'scales'.*lossy=True"):
            tensors = to_checkpoint(qt, layout, lossy=True)
        assert tensors["scales"].dtype == np.float16
        np.testing.assert_array_equal(tensors["scales"], np.asarray(qt.scale).T.astype(np.float16))
    # float32 scales that float16 holds exactly (powers of two, -0.0, zero, NaN) store silently.
    exact = qt.replace(scale=jnp.asarray(np.array([2.0 ** -14, -0.0, 0.0, np.nan] * 16, np.float32).reshape(32, 2)))
    np.testing.assert_array_equal(to_checkpoint(exact, "gptq")["scales"], np.asarray(exact.scale).T.astype(np.float16))
    tiny = exact.replace(scale=exact.scale.at[0, 0].set(2.0 ** -25))  # below float16's smallest subnormal
    with pytest.raises(ValueError, match="changes 1 of 64 values"):
        to_checkpoint(tiny, "gptq")
    huge = exact.replace(scale=exact.scale.at[0, 0].set(65520.0))  # rounds to inf
    with pytest.raises(ValueError, match="by up to inf"):
        to_checkpoint(huge, "gptq")


def test_per_channel_and_bfloat16_scales():
    qt = _qt("uint8", group=-1, scale_dtype=jnp.bfloat16)
    tensors = to_checkpoint(qt, "gptq", checkpoint_format="gptq_v2")
    assert tensors["scales"].shape == (1, 32) and tensors["scales"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(tensors["g_idx"], np.zeros(64, np.int32))
    back = from_checkpoint(tensors, "gptq", checkpoint_format="gptq_v2", group_size=-1, dtype=jnp.float32)
    chex.assert_trees_all_equal(back, qt)
    ct = to_checkpoint(qt, "compressed-tensors")
    assert ct["weight_scale"].shape == (32, 1) and ct["weight_zero_point"].shape == (8, 1)


def test_detect():
    assert ct_detect(to_checkpoint(_qt("int4"), "compressed-tensors"))
    assert not ct_detect({"weight_packed": np.zeros((4, 8), np.uint8)})  # NVFP4's packed bytes
    assert not ct_detect({"qweight": np.zeros((4, 8), np.int32)})


# ---- bad input --------------------------------------------------------------------------------------
def _gptq_tensors():
    return to_checkpoint(_qt("uint4"), "gptq")


@pytest.mark.parametrize("name,value,match", [
    ("qweight", np.zeros((8, 32), np.float32), "tensor 'qweight' must have dtype int32, got float32 with shape"),
    ("qweight", np.zeros((7, 32), np.int32), r"tensor 'qweight' has shape \(7, 32\), expected \(8, 32\)"),
    ("qzeros", np.zeros((2, 5), np.int32), r"tensor 'qzeros' has shape \(2, 5\), expected \(2, 4\)"),
    ("scales", np.zeros((2, 32), np.int32), "tensor 'scales' must have dtype float"),
    ("scales", np.zeros((3, 32), np.float16), "3 groups, which do not divide K=64"),
    ("g_idx", np.full(64, 5, np.int32), r"g_idx values must lie in \[0, 2\)"),
    ("g_idx", np.zeros((64, 1), np.int32), "'g_idx' must be 1-D"),
])
def test_bad_gptq_tensors(name, value, match):
    tensors = _gptq_tensors()
    tensors[name] = value
    with pytest.raises(ValueError, match=match):
        from_checkpoint(tensors, "gptq", bits=4)


def test_bad_checkpoints_and_options():
    tensors = _gptq_tensors()
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['qzeros'\]"):
        from_checkpoint({k: v for k, v in tensors.items() if k != "qzeros"}, "gptq")
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        from_checkpoint(tensors, "gptq", checkpoint_format="v3")
    with pytest.raises(ValueError, match="group_size=128 given"):
        from_checkpoint(tensors, "gptq", group_size=128)
    with pytest.raises(ValueError, match="bits must be one of"):
        from_checkpoint(tensors, "gptq", bits=5)
    awq = to_checkpoint(_qt("uint4"), "awq")
    awq["qzeros"] = awq["qzeros"][:, :2]
    with pytest.raises(ValueError, match=r"tensor 'qzeros' has shape \(2, 2\), expected \(2, 4\)"):
        from_checkpoint(awq, "awq")
    ct = to_checkpoint(_qt("uint4"), "compressed-tensors")
    with pytest.raises(ValueError, match=r"tensor 'weight_shape' has shape \(3,\), expected \(2,\)"):
        from_checkpoint({**ct, "weight_shape": np.array([32, 64, 1])}, "compressed-tensors")
    with pytest.raises(ValueError, match=r"tensor 'weight_zero_point' has shape \(8, 2\), expected \(4, 2\)"):
        from_checkpoint({**ct, "weight_zero_point": np.zeros((8, 2), np.int32)}, "compressed-tensors")
    with pytest.raises(ValueError, match="no 'weight_zero_point'"):
        from_checkpoint({k: v for k, v in ct.items() if k != "weight_zero_point"}, "compressed-tensors",
                        sym=False)


def test_layouts_refuse_what_they_cannot_store():
    with pytest.raises(ValueError, match="cannot store QTensor.fmt='int3'"):
        to_checkpoint(_qt("int3"), "awq")
    with pytest.raises(ValueError, match="cannot store QTensor.fmt='uint2'"):
        to_checkpoint(_qt("uint2"), "compressed-tensors")
    with pytest.raises(ValueError, match="N=12 .* must be a multiple of 8"):
        to_checkpoint(_qt("uint4", shape=(12, 64)), "awq")
    per_tensor = quantize(_normal(3, (32, 64)), "int4", granularity="tensor")
    with pytest.raises(ValueError, match=r"block \(1, G\).*block \(32, 64\)"):
        to_checkpoint(per_tensor, "gptq")
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        to_checkpoint(_qt("int4"), "gptq", checkpoint_format="v2")
    with pytest.raises(ValueError, match=r"K=8 must make whole int32 words"):
        to_checkpoint(quantize(_normal(4, (32, 8)), "int3"), "gptq")


def test_compressed_tensors_bits_it_cannot_read_are_named():
    base = {"weight_scale": np.ones((8, 2), np.float16), "weight_shape": np.array([8, 64], np.int64)}
    two_bit = {**base, "weight_packed": np.zeros((8, 64 * 2 // 32), np.int32)}
    with pytest.raises(ValueError, match=r"no 4- or 8-bit codes of K=64 \(it fits 2-bit codes.*4 and 8 only\)"):
        from_checkpoint(two_bit, "compressed-tensors/pack-quantized")
    one_column = {"weight_scale": np.ones((8, 1), np.float16), "weight_shape": np.array([8, 1], np.int64),
                  "weight_packed": np.zeros((8, 1), np.int32)}
    with pytest.raises(ValueError, match=r"fits both 4- and 8-bit codes of K=1; pass bits="):
        from_checkpoint(one_column, "compressed-tensors/pack-quantized")
