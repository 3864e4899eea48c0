"""bitsandbytes NF4 / FP4 (+ double quantization) and the "bnb" layout: goldens, packing, bounds, errors."""

import functools
import json
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
from jquant.formats import bnb

GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "bitsandbytes_4bit.npz")
CASES = json.loads(str(GOLDEN["cases"]))
FORMATS = {"nf4": "nf4", "fp4": "fp4_bnb"}
# Half the widest gap between adjacent table entries (NF4: -1 → -0.696..., FP4: ±8/12 → ±12/12).
HALF_GAP = {fmt: np.diff(np.sort(bnb.code_table(fmt))).max() / 2 for fmt in FORMATS.values()}


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    return jax.jit if request.param else (lambda fn: fn)


def bits(a):
    """Raw bytes of an array, so NaN payloads and the sign of zero compare too."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def golden(name, dtype="float32"):
    a = GOLDEN[name]
    return a.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else a


def golden_checkpoint(case):
    """The case's saved tensors under the names Linear4bit writes."""
    quant_type = CASES[case]["quant_type"]
    names = {"weight": "weight", "absmax": "weight.absmax", "quant_map": "weight.quant_map",
             "nested_absmax": "weight.nested_absmax", "nested_quant_map": "weight.nested_quant_map",
             "quant_state": f"weight.quant_state.bitsandbytes__{quant_type}"}
    return {full: GOLDEN[f"{case}__{short}"] for short, full in names.items() if f"{case}__{short}" in GOLDEN}


def random(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ---- bitsandbytes 0.50.2 goldens ---------------------------------------------------------------------

def quantize_case(case):
    params = CASES[case]
    return functools.partial(jquant.quantize, fmt=FORMATS[params["quant_type"]], blocksize=params["blocksize"],
                             compress_statistics=params["compress_statistics"])


def assert_matches_golden(case, qt, dequantized):
    params = CASES[case]
    assert qt.data.dtype == jnp.uint8 and qt.pack_axis == 0
    np.testing.assert_array_equal(np.asarray(qt.data), GOLDEN[f"{case}__weight"].reshape(-1))
    if params["compress_statistics"]:
        offset = json.loads(GOLDEN[f"{case}__quant_state"].tobytes())["nested_offset"]
        np.testing.assert_array_equal(np.asarray(qt.scale.data), GOLDEN[f"{case}__absmax"])
        np.testing.assert_array_equal(bits(qt.scale.scale), bits(GOLDEN[f"{case}__nested_absmax"]))
        np.testing.assert_array_equal(bits(qt.scale.zero), bits(np.float32(offset)))
    else:
        np.testing.assert_array_equal(bits(qt.scale), bits(GOLDEN[f"{case}__absmax"]))
    np.testing.assert_array_equal(bits(dequantized), bits(golden(f"{case}__dequant", params["dtype"])))


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_quantize_and_dequantize(case):
    params = CASES[case]
    qt = quantize_case(case)(golden("input__" + params["input"], params["dtype"]))
    assert_matches_golden(case, qt, qt.dequantize(qt.dtype))


@pytest.mark.parametrize("case", ["fp4_small_dq", "nf4_big_dq"])
def test_golden_inside_an_outer_jit(case):
    """XLA fuses across an outer jit (FMA contraction, reciprocal division): the bytes must not move."""
    params = CASES[case]
    qt, dequantized = jax.jit(lambda x: (q := quantize_case(case)(x), q.dequantize(q.dtype)))(
        golden("input__" + params["input"], params["dtype"]))
    assert_matches_golden(case, qt, dequantized)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_checkpoint_export_and_import(case):
    params = CASES[case]
    expected = golden_checkpoint(case)
    qt = jquant.quantize(golden("input__" + params["input"], params["dtype"]), FORMATS[params["quant_type"]],
                         blocksize=params["blocksize"], compress_statistics=params["compress_statistics"])
    exported = jquant.to_checkpoint(qt, "bnb")
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        assert exported[name].dtype == value.dtype and exported[name].shape == value.shape, name
        np.testing.assert_array_equal(bits(exported[name]), bits(value), err_msg=name)
    loaded = jquant.from_checkpoint(expected, "bnb")
    assert jax.tree.structure(loaded) == jax.tree.structure(qt)
    np.testing.assert_array_equal(bits(loaded.dequantize(loaded.dtype)), bits(golden(f"{case}__dequant", params["dtype"])))


def test_golden_dynamic8(maybe_jit):
    quantize = maybe_jit(functools.partial(jquant.quantize, fmt="bnb_dynamic8", blocksize=256))
    np.testing.assert_array_equal(bnb.dynamic_map(), GOLDEN["dynamic8__code"])
    qt = quantize(GOLDEN["dynamic8__input"])
    np.testing.assert_array_equal(np.asarray(qt.data), GOLDEN["dynamic8__codes"])
    np.testing.assert_array_equal(np.asarray(qt.scale), GOLDEN["dynamic8__absmax"])
    np.testing.assert_array_equal(bits(qt.dequantize()), bits(GOLDEN["dynamic8__dequant"]))
    # Every midpoint of the map and its float32 neighbours: bnb's 65536-bin rule at each boundary.
    probes = quantize(GOLDEN["dynamic8_probes__input"])
    np.testing.assert_array_equal(np.asarray(probes.data), GOLDEN["dynamic8_probes__codes"])


@pytest.mark.parametrize("size", [int(n) for n in GOLDEN["mean_sizes"]])
def test_offset_is_torch_float32_mean(size):
    x = golden(f"mean_{size}__input", "bfloat16").astype(np.float32)
    np.testing.assert_array_equal(bits(jax.jit(bnb._torch_mean)(x)), bits(GOLDEN[f"mean_{size}__mean"]))


# ---- formulas and packing ------------------------------------------------------------------------

def test_tail_block_divides_full_blocks_multiply_by_reciprocal():
    x = np.asarray(random((700,), seed=1))  # 10 blocks of 64 and a tail of 60
    scaled, absmax = jax.jit(bnb._scaled, static_argnums=1)(x, 64)
    full = x[:640].reshape(10, 64)
    block_max = np.abs(full).max(axis=1)
    expected = np.concatenate([(full * (np.float32(1) / block_max)[:, None]).reshape(-1),
                               x[640:] / np.abs(x[640:]).max()])
    np.testing.assert_array_equal(bits(scaled), bits(np.clip(expected, -1, 1)))
    np.testing.assert_array_equal(absmax, np.concatenate([block_max, [np.abs(x[640:]).max()]]))


@pytest.mark.parametrize("fmt", ["nf4", "fp4_bnb"])
def test_packing_is_real_even_element_in_high_nibble(fmt):
    table = bnb.code_table(fmt)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (6, 64))
    codes[:, 0] = np.argmax(table)  # absmax 1 in every block: each value is its own scaled value
    codes[codes == 8] = 0  # FP4's codes 0 and 8 are both +0; keep the code bnb writes for 0
    qt = jquant.quantize(table[codes], fmt)
    assert qt.data.shape == (6 * 64 // 2,) and qt.data.dtype == jnp.uint8
    flat = codes.reshape(-1)
    np.testing.assert_array_equal(np.asarray(qt.data), (flat[0::2] << 4) | flat[1::2])


def test_midpoint_takes_lower_entry_and_fp4_small_values_keep_sign_code():
    nf4 = bnb.code_table("nf4")
    midpoint = (nf4[8] + nf4[9]) / np.float32(2)
    x = np.array([1.0, midpoint, np.nextafter(midpoint, np.float32(1)), 0.0], np.float32)
    codes = np.asarray(jquant.quantize(x, "nf4").data)
    np.testing.assert_array_equal(codes, [15 << 4 | 8, 9 << 4 | 7])
    fp4 = np.asarray(jquant.quantize(np.array([1.0, 1e-5, -1e-5, 0.0], np.float32), "fp4_bnb").data)
    np.testing.assert_array_equal(fp4, [3 << 4 | 8, 0 << 4 | 0])


def test_odd_size_pads_with_code_of_zero_and_short_last_block():
    x = random((3, 5), seed=2)
    for fmt, zero_code in (("nf4", 7), ("fp4_bnb", 0)):
        qt = jquant.quantize(x, fmt)
        assert qt.data.shape == (8,) and qt.scale.shape == (1,)
        assert int(qt.data[-1]) & 0xF == zero_code
        assert qt.dequantize().shape == (3, 5)


def test_double_quant_is_a_nested_qtensor_and_saves_bytes():
    x = random((64, 512), seed=3)  # 512 blocks of 64: two nested blocks of 256
    plain = jquant.quantize(x, "nf4")
    double = jquant.quantize(x, "nf4", compress_statistics=True)
    assert isinstance(double.scale, jquant.QTensor) and double.scale.fmt == "bnb_dynamic8"
    assert double.scale.scale.shape == (2,) and double.scale.zero.shape == ()
    assert len(jax.tree.leaves(double)) == 4  # packed codes, absmax codes, nested absmax, offset
    assert plain.bits_per_weight == 4.5
    assert double.nbytes < plain.nbytes and double.bits_per_weight < 4.13
    np.testing.assert_allclose(double.scale.dequantize(), plain.scale, rtol=0.02)
    chex.assert_trees_all_equal(jax.jit(lambda q: q.dequantize())(double), double.dequantize())
    rebuilt = jax.tree.map(lambda a: a, double)  # tree_map rebuilds the nested QTensor too
    assert isinstance(rebuilt.scale, jquant.QTensor)


@pytest.mark.parametrize("fmt, compress", [("nf4", True), ("fp4_bnb", False)])
def test_jit_matches_eager(fmt, compress):
    x = random((20, 100), seed=4, dtype=jnp.bfloat16)
    quantize = functools.partial(jquant.quantize, fmt=fmt, blocksize=128, compress_statistics=compress)
    chex.assert_trees_all_equal(jax.tree.map(bits, jax.jit(quantize)(x)), jax.tree.map(bits, quantize(x)))


# ---- NaN / Inf / zeros (bnb's behaviour; the goldens pin the bytes) ---------------------------------

def test_nan_and_inf_poison_their_block_only():
    x = np.array(random((4, 64), seed=5))
    x[0, 3], x[1, 7], x[3, :] = np.nan, np.inf, 0.0
    qt = jquant.quantize(x, "nf4")
    out = np.asarray(qt.dequantize())
    absmax = np.asarray(qt.scale)
    assert np.isnan(absmax[0]) and np.isinf(absmax[1])
    assert np.isnan(out[0]).all()  # a NaN block codes all 15 and dequantizes to NaN
    assert out[1, 7] == np.inf and np.isnan(np.delete(out[1], 7)).all()  # 0 * inf
    assert np.isfinite(out[2]).all() and (out[3] == 0).all() and absmax[3] == 0


def test_all_zero_short_last_block_stores_bnb_floor():
    x = np.zeros(70, np.float32)
    x[:64] = np.asarray(random((64,), seed=6))
    absmax = np.asarray(jquant.quantize(x, "nf4").scale)
    assert absmax[1] == np.float32(1e-38) and absmax[0] > 0


# ---- round-trip bound --------------------------------------------------------------------------------

@functools.cache
def jitted_round_trip(fmt, blocksize, compress):
    def round_trip(x):
        qt = bnb._quantize_4bit(x, fmt, blocksize, compress)
        absmax = qt.scale.dequantize(jnp.float32) if compress else qt.scale
        return qt.dequantize(), absmax
    return jax.jit(round_trip)


# One shape and blocksize (300 elements: 9 blocks of 32 and a short one) keep compilations few.
@given(x=hnp.arrays(np.float32, (3, 100), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)).filter(
           lambda a: np.abs(a).max() > 1e-30),
       fmt=st.sampled_from(["nf4", "fp4_bnb"]), compress=st.booleans())
def test_round_trip_within_half_the_widest_gap(x, fmt, compress):
    blocksize = 32
    dequantized, stored_absmax = (np.asarray(a, np.float64) for a in jitted_round_trip(fmt, blocksize, compress)(x))
    flat = x.reshape(-1).astype(np.float64)
    pad = -flat.size % blocksize
    absmax = np.abs(np.pad(flat, (0, pad))).reshape(-1, blocksize).max(axis=1)
    absmax = np.repeat(absmax, blocksize)[:flat.size]
    stored = np.repeat(stored_absmax, blocksize)[:flat.size]
    # With double quantization the absmax itself is approximate: add its error.
    bound = HALF_GAP[fmt] * absmax + np.abs(stored - absmax) + absmax * 2.0**-20
    assert (np.abs(dequantized.reshape(-1) - flat) <= bound).all()


# ---- bad inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda: jquant.quantize(np.arange(64), "nf4"), TypeError, "floating"),
    (lambda: jquant.quantize(np.ones(64, np.float64), "nf4"), TypeError, "float32, bfloat16 or float16"),
    (lambda: jquant.quantize(np.float32(1.0), "nf4"), ValueError, "at least 1 dimension"),
    (lambda: jquant.quantize(np.zeros((0, 64), np.float32), "fp4_bnb"), ValueError, "empty"),
    (lambda: jquant.quantize(np.ones(64, np.float32), "nf4", blocksize=48), ValueError, "blocksize"),
    (lambda: jquant.quantize(np.ones(64, np.float32), "nf4", blocksize=8192), ValueError, "blocksize"),
    (lambda: jquant.quantize(np.ones((2, 64), np.float32), "nf4", axis=0), ValueError, "axis"),
    (lambda: jquant.quantize(np.ones(64, np.float32), "nf4", compress_statistics=1), TypeError,
     "compress_statistics"),
    (lambda: jquant.quantize(np.ones(64, np.float32), "nf4", group_size=64), TypeError, "group_size"),
    (lambda: jquant.quantize(np.ones(64, np.float32), "bnb_dynamic8", blocksize=0), ValueError, "blocksize"),
])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- layout errors -------------------------------------------------------------------------------------

def nested_checkpoint():
    return dict(golden_checkpoint("nf4_small_dq"))


def with_json(tensors, **changes):
    key = "weight.quant_state.bitsandbytes__nf4"
    fields = json.loads(tensors[key].tobytes())
    fields.update(changes)
    return {**tensors, key: np.frombuffer(json.dumps(fields).encode(), np.uint8)}


@pytest.mark.parametrize("mutate, match", [
    (lambda t: {k: v for k, v in t.items() if k != "weight.absmax"}, r"missing tensor\(s\) \['weight.absmax'\]"),
    (lambda t: {k: v for k, v in t.items() if "quant_state" not in k}, "exactly one tensor"),
    (lambda t: {**t, "weight": t["weight"][:-1]}, r"tensor weight must hold 1073 bytes.*\(1072, 1\)"),
    (lambda t: {**t, "weight.absmax": t["weight.absmax"][:-1]}, r"weight.absmax must be uint8 with shape \(34,\)"),
    (lambda t: {**t, "weight.absmax": t["weight.absmax"].astype(np.float32)}, "weight.absmax must be uint8"),
    (lambda t: {**t, "weight.nested_absmax": np.ones(2, np.float32)}, r"nested_absmax .* shape \(1,\)"),
    (lambda t: {**t, "weight.quant_map": bnb.code_table("fp4_bnb")}, "weight.quant_map is not"),
    (lambda t: {**t, "weight.nested_quant_map": np.zeros(256, np.float32)}, "nested_quant_map is not"),
    (lambda t: {**t, "weight.quant_state.bitsandbytes__nf4": np.frombuffer(b"{oops", np.uint8)}, "JSON"),
    (lambda t: with_json(t, quant_type="fp4"), "quant_type 'nf4'"),
    (lambda t: with_json(t, blocksize=48), "blocksize 48"),
    (lambda t: with_json(t, shape=[33, 0]), "shape"),
    (lambda t: with_json(t, dtype="int8"), "dtype 'int8'"),
    (lambda t: with_json(t, nested_offset=None), "nested_offset"),
])
def test_layout_rejects_malformed_tensors(mutate, match):
    with pytest.raises(ValueError, match=match):
        jquant.from_checkpoint(mutate(nested_checkpoint()), "bnb")


def test_layout_round_trip_and_other_storage_dtype():
    x = random((24, 40), seed=7, dtype=jnp.bfloat16)
    for fmt in ("nf4", "fp4_bnb"):
        for compress in (False, True):
            qt = jquant.quantize(x, fmt, compress_statistics=compress)
            tensors = jquant.to_checkpoint(qt, "bnb")
            back = jquant.from_checkpoint(tensors, "bnb")
            chex.assert_trees_all_equal(jax.tree.map(bits, back), jax.tree.map(bits, qt))
            assert back.dtype == jnp.bfloat16 and back.shape == (24, 40)
    # bnb's quant_storage=bfloat16 (FSDP) saves the same bytes viewed as bfloat16.
    stored = {**tensors, "weight": tensors["weight"].reshape(-1).view(ml_dtypes.bfloat16).reshape(-1, 1)}
    np.testing.assert_array_equal(np.asarray(jquant.from_checkpoint(stored, "bnb").data), np.asarray(qt.data))
    with pytest.raises(ValueError, match="cannot store"):
        jquant.to_checkpoint(jquant.quantize(x, "bnb_dynamic8"), "bnb")
