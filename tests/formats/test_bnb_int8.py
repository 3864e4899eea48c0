"""bitsandbytes LLM.int8(): "int8_bnb" weights, the mixed int8 / float matmul, the "bnb" layout's 8-bit
tensors and the llm_int8 scheme, against bitsandbytes 0.50.2 goldens and restated rules."""

import json
import pathlib
import warnings

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jquant
from jquant.formats.bnb_int8 import llm_int8_matmul
from jquant.schemes.builtin import llm_int8

GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "bitsandbytes_int8.npz")
CASES = json.loads(str(GOLDEN["cases"]))
WEIGHT_DTYPES = {"special": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "matmul": np.float32}
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def stored(a, dtype):
    """A golden array holding bfloat16 / float16 bits as uint16, read as ``dtype``."""
    return a if dtype == np.float32 else a.view(dtype)


def same_bits(actual, expected):
    """Equal bits, any NaN matching any NaN."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, expected.dtype)
    wide = np.dtype(f"u{actual.dtype.itemsize}")
    nan = np.isnan(actual.astype(np.float32)) & np.isnan(expected.astype(np.float32))
    bad = (actual.view(wide) != expected.view(wide)) & ~nan
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ, e.g. {actual[bad][:4]} against {expected[bad][:4]}"


def golden_weight(name):
    return stored(GOLDEN[f"weight__{name}"], WEIGHT_DTYPES[name])


def golden_qtensor(name):
    return jquant.from_checkpoint({"weight": GOLDEN[f"{name}__codes"], "SCB": GOLDEN[f"{name}__SCB"],
                                   "weight_format": GOLDEN[f"{name}__weight_format"]}, "bnb")


# ---- weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(WEIGHT_DTYPES))
def test_weight_codes_scales_and_dequantization_are_bitsandbytes(name, jit):
    quantize = jax.jit(lambda w: jquant.quantize(w, "int8_bnb")) if jit else (lambda w: jquant.quantize(w, "int8_bnb"))
    qt = quantize(golden_weight(name))
    np.testing.assert_array_equal(np.asarray(qt.data), GOLDEN[f"{name}__codes"])
    same_bits(np.asarray(qt.scale).reshape(-1), GOLDEN[f"{name}__SCB"])
    same_bits(np.asarray(qt.dequantize(jnp.float32)), GOLDEN[f"{name}__dequant"])


def test_golden_weight_covers_the_edge_rows():
    """Row 3 zeros, 5 NaN, 7 +Inf, 9 past float16, 13 ties at k + 0.5 with scale 1: all as bitsandbytes."""
    codes, scb = GOLDEN["special__codes"], GOLDEN["special__SCB"]
    assert (codes[[3, 5, 7, 9]] == 0).all() and scb[3] == 0 and np.isnan(scb[5]) and np.isinf(scb[[7, 9]]).all()
    assert scb[13] == 127 and codes[13, 1:5].tolist() == [-34, -34, -32, -32]   # half to even: -34.5, -33.5, ...
    qt = jquant.quantize(golden_weight("special"), "int8_bnb")
    assert np.isnan(np.asarray(qt.dequantize())[[5, 7, 9]]).all()   # 0 · NaN / Inf, as bitsandbytes
    assert (np.asarray(qt.dequantize())[3] == 0).all()


def test_codes_use_the_reciprocal_times_127_as_torch():
    """torch's ``127.0 / absmax`` is ``absmax.reciprocal() * 127``: with the correctly rounded quotient 3
    codes of the bfloat16 golden come out one higher (x · (127 / a) lands on 63.500004 instead of 63.5)."""
    w = golden_weight("bf16").astype(np.float16).astype(np.float32)
    absmax = np.abs(w).max(axis=1, keepdims=True)
    rounded_quotient = np.rint(w * (np.float32(127) / absmax)).astype(np.int8)
    assert (rounded_quotient != GOLDEN["bf16__codes"]).sum() == 3
    np.testing.assert_array_equal(np.asarray(jquant.quantize(golden_weight("bf16"), "int8_bnb").data),
                                  GOLDEN["bf16__codes"])


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 40)),
                  elements=st.floats(-1e4, 1e4, width=32)))
def test_dequantized_weight_is_within_half_a_step_of_the_float16_weight(w):
    qt = jquant.quantize(w, "int8_bnb")
    w16 = w.astype(np.float16).astype(np.float32)
    step = np.abs(w16).max(axis=1, keepdims=True) / 127
    error = np.abs(np.asarray(qt.dequantize()) - w16)
    assert (error <= step * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_weight_quantized_along_axis_0_is_the_transpose():
    w = np.array(jax.random.normal(jax.random.key(0), (24, 24)))   # square: orientation must come from axis
    w[:, 3] *= 50.0
    qa, qb = jquant.quantize(w, "int8_bnb", axis=0), jquant.quantize(w.T, "int8_bnb")
    np.testing.assert_array_equal(np.asarray(qa.data), np.asarray(qb.data).T)
    np.testing.assert_array_equal(np.asarray(qa.dequantize()), np.asarray(qb.dequantize()).T)


@pytest.mark.parametrize("call, match", [
    (lambda: jquant.quantize(np.ones((2, 3, 4), np.float32), "int8_bnb"), "2-D"),
    (lambda: jquant.quantize(np.ones((2, 0), np.float32), "int8_bnb"), "empty"),
    (lambda: jquant.quantize(np.ones((2, 3), np.int32), "int8_bnb"), "floating"),
])
def test_bad_weights(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---- the matmul -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_matmul_is_bitsandbytes(case):
    """bfloat16 and float16 x: the same bits as ``bitsandbytes.matmul``. float32 x: torch adds the outlier
    columns' float32 product (its BLAS's summation order) to the int8 part, so within a few float32 ulp."""
    dtype = DTYPES[CASES[case]["dtype"]]
    x, expected = stored(GOLDEN[f"x__{case}"], dtype), stored(GOLDEN[f"out__{case}"], dtype)
    actual = np.asarray(llm_int8_matmul(jnp.asarray(x), golden_qtensor("matmul"), CASES[case]["threshold"]))
    if dtype == np.float32:
        np.testing.assert_allclose(actual, expected, rtol=4e-7, atol=1e-7)
    else:
        same_bits(actual, expected)


def test_golden_matmuls_cover_the_decomposition():
    x = stored(GOLDEN["x__bf16_t6"], ml_dtypes.bfloat16).astype(np.float32)
    # Outlier columns 10 (8.0 and 6.0, at the threshold), 40 and 90 (5.99 is 6.0 in bfloat16); a zero token.
    assert np.flatnonzero((np.abs(x) >= 6).any(axis=0)).tolist() == [10, 40, 90] and (x[6] == 0).all()
    assert not (np.abs(stored(GOLDEN["x__bf16_calm_t6"], ml_dtypes.bfloat16).astype(np.float32)) >= 6).any()
    special = stored(GOLDEN["out__bf16_special_t6"], ml_dtypes.bfloat16).astype(np.float32)
    assert np.isnan(special[1]).all() and np.isfinite(special[0]).all()        # a NaN reaches its token only...
    assert not np.isfinite(special[2]).all()                                   # ... an Inf runs in float


def test_a_tokens_product_depends_on_the_batchs_outlier_columns():
    """bitsandbytes takes outlier columns over the whole call: a token alone differs from the same token
    beside one with an outlier (as the golden's token 1 does beside token 2's 8.0 at column 10)."""
    x = jnp.asarray(stored(GOLDEN["x__bf16_t6"], ml_dtypes.bfloat16))
    w = golden_qtensor("matmul")
    together = np.asarray(llm_int8_matmul(x, w)[1], np.float32)
    alone = np.asarray(llm_int8_matmul(x[1:2], w)[0], np.float32)
    assert not np.array_equal(together, alone)
    same_bits(np.asarray(llm_int8_matmul(x, w)), stored(GOLDEN["out__bf16_t6"], ml_dtypes.bfloat16))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(1, 48), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_threshold_zero_is_the_int8_product_and_a_tiny_one_the_float16_product(m, k, n, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (m, k)) * 3).astype(jnp.float16)
    w = jquant.quantize(jax.random.normal(kw, (n, k)), "int8_bnb")
    xf = np.asarray(x, np.float32)
    codes, scb = np.asarray(w.data, np.int64), np.asarray(w.scale, np.float32).reshape(1, -1)
    row = np.abs(xf).max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        xq = np.nan_to_num(np.rint(xf * ((np.float32(1) / row) * np.float32(127)))).astype(np.int64)
    acc = (xq @ codes.T).astype(np.float32)
    int8 = ((acc * (row * scb)) * np.float32(6.200124e-05)).astype(np.float16)
    same_bits(np.asarray(llm_int8_matmul(x, w, threshold=0.0)), int8)
    same_bits(np.asarray(llm_int8_matmul(x, w, threshold=1e4)), int8)      # no outliers: nothing added
    # Every column an outlier: the int8 part is 0 and the float16 weight meets x in one float32 sum,
    # rounded to float16 once (within one float16 step of the exact product; XLA picks the sum's order).
    w16 = np.asarray(w.dequantize(jnp.float32)).astype(np.float16).astype(np.float64)
    exact = xf.astype(np.float64) @ w16.T
    np.testing.assert_allclose(np.asarray(llm_int8_matmul(x, w, threshold=1e-6)).astype(np.float64), exact,
                               rtol=2.0**-10, atol=2.0**-24)


def test_threshold_compares_in_float16():
    """bitsandbytes compares |x| with the threshold rounded to float16: 6.102 → 6.1015625."""
    w = jquant.quantize(np.eye(4, dtype=np.float32), "int8_bnb")
    x = jnp.asarray([[6.1015625, 0.3, 0.2, 0.1]], jnp.float16)
    # 6.1015625 < 6.102 as floats, yet an outlier: column 0 leaves the int8 part, whose row scale then
    # comes from 0.3 (code 127) instead of 6.1 (0.3 → code 6, 0.288).
    outlier, inside = llm_int8_matmul(x, w, threshold=6.102)[0], llm_int8_matmul(x, w, threshold=6.11)[0]
    assert float(outlier[0]) == 6.1015625 and abs(float(outlier[1]) - 0.3) < 1e-3
    assert abs(float(inside[1]) - 6 * 6.1015625 / 127) < 1e-3


@pytest.mark.parametrize("call, match", [
    (lambda w: llm_int8_matmul(jnp.ones((2, 8)), w, threshold=-1.0), "threshold"),
    (lambda w: llm_int8_matmul(jnp.ones((2, 8)), w, threshold=float("nan")), "threshold"),
    (lambda w: llm_int8_matmul(jnp.ones((2, 8)), jquant.quantize(np.ones((4, 8), np.float32), "int8")), "int8_bnb"),
    (lambda w: llm_int8_matmul(jnp.ones((2, 6)), w), r"K = 8 .*\(2, 6\)"),
    (lambda w: llm_int8_matmul(jnp.ones((2, 8), jnp.int32), w), "float array"),
])
def test_bad_matmul_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(jquant.quantize(np.ones((4, 8), np.float32), "int8_bnb"))


# ---- the layout -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WEIGHT_DTYPES))
def test_layout_writes_what_linear8bitlt_saves(name):
    tensors = jquant.to_checkpoint(jquant.quantize(golden_weight(name), "int8_bnb"), "bnb")
    assert sorted(tensors) == ["SCB", "weight", "weight_format"]
    np.testing.assert_array_equal(tensors["weight"], GOLDEN[f"{name}__codes"])
    same_bits(tensors["SCB"], GOLDEN[f"{name}__SCB"])
    assert tensors["weight_format"].dtype == GOLDEN[f"{name}__weight_format"].dtype
    assert tensors["weight_format"].shape == () and int(tensors["weight_format"]) == 0
    back = jquant.from_checkpoint(tensors, "bnb")
    same_bits(np.asarray(back.dequantize()), GOLDEN[f"{name}__dequant"])


def _tensors():
    return {"weight": GOLDEN["f16__codes"], "SCB": GOLDEN["f16__SCB"], "weight_format": np.array(0, np.uint8)}


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.update(weight_format=np.array(2, np.uint8)), "Turing / Ampere"),
    (lambda t: t.update(SCB=t["SCB"][:-1]), "SCB"),
    (lambda t: t.update(SCB=t["SCB"].astype(np.float16)), "SCB"),
    (lambda t: t.update(weight=t["weight"].view(np.uint8)), "int8"),
    (lambda t: t.update(weight=t["weight"].reshape(-1)), "int8"),
    (lambda t: t.pop("weight"), "missing"),
])
def test_layout_rejects_malformed_8bit_tensors(mutate, match):
    tensors = _tensors()
    mutate(tensors)
    with pytest.raises(ValueError, match=match):
        jquant.from_checkpoint(tensors, "bnb")


def test_layout_reads_a_checkpoint_without_weight_format():
    tensors = _tensors()
    del tensors["weight_format"]
    np.testing.assert_array_equal(np.asarray(jquant.from_checkpoint(tensors, "bnb").data), GOLDEN["f16__codes"])


# ---- the scheme -----------------------------------------------------------------------------------------

def test_scheme_runs_vllms_8bit_path():
    """bfloat16 into bitsandbytes, the product through vLLM's float16 buffer, then x's dtype and the bias."""
    scheme = jquant.get_scheme("llm_int8")
    w = golden_qtensor("matmul")
    x = jnp.asarray(stored(GOLDEN["x__f32_t6"], np.float32))
    bias = jax.random.normal(jax.random.key(3), (48,))
    expected = llm_int8_matmul(x.astype(jnp.bfloat16), w).astype(jnp.float16).astype(jnp.float32) + bias
    for run in (scheme.apply, jax.jit(scheme.apply)):
        same_bits(np.asarray(run(x, scheme.process_weights_after_loading(w), bias)), np.asarray(expected))
    x16 = x.astype(jnp.bfloat16)
    same_bits(np.asarray(scheme.apply(x16, w)), np.asarray(stored(GOLDEN["out__bf16_t6"], ml_dtypes.bfloat16)))


def test_scheme_threshold_and_validation():
    assert llm_int8(0.0).name == "llm_int8_t0" and llm_int8(0.0).activation.outlier_threshold == 0.0
    with pytest.raises(ValueError, match="int8_bnb"):
        jquant.Scheme(name="bad", weight=jquant.WeightSpec("int8", 8, symmetric=True),
                      activation=jquant.ActivationSpec("llm_int8"))
    with pytest.raises(ValueError, match="outlier_threshold"):
        jquant.ActivationSpec("dynamic_per_token", "int8", outlier_threshold=6.0)
    with pytest.raises(ValueError, match=">= 0"):
        jquant.ActivationSpec("llm_int8", outlier_threshold=-2.0)
    with pytest.raises(ValueError, match="int8"):
        jquant.ActivationSpec("llm_int8", "fp8_e4m3")
    assert jquant.Scheme.from_dict(llm_int8(2.5).to_dict()) == llm_int8(2.5)


# ---- what XLA must not rewrite --------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_outlier_weights_are_rounded_to_x_dtype_under_jit(jit):
    """bitsandbytes rounds the dequantized outlier columns to x's dtype before the dot. Under jit XLA's
    excess-precision rewrite dropped a bfloat16 round trip there (M = N = 1, K ≥ 4096: 0.0634765625
    against bitsandbytes' 0.0625)."""
    w = np.zeros((1, 4096), np.float32)
    w[0, :2] = [1.0068359375, 1.0]
    x = np.zeros((1, 4096), np.float32)
    x[0, :2] = [8.0, -8.0]                      # both outliers; the int8 part is all zero
    qw = jquant.quantize(w, "int8_bnb")
    deq = np.asarray(qw.dequantize(jnp.float32))[0, :2]
    rounded = deq.astype(ml_dtypes.bfloat16).astype(np.float64)
    expected = np.float64(8 * rounded[0] - 8 * rounded[1]).astype(ml_dtypes.bfloat16)
    assert expected != np.float64(8 * deq[0] - 8 * deq[1]).astype(ml_dtypes.bfloat16)  # the rounding shows
    matmul = jax.jit(llm_int8_matmul) if jit else llm_int8_matmul
    assert np.asarray(matmul(jnp.asarray(x, jnp.bfloat16), qw))[0, 0] == expected == np.float32(0.0625)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float32_product_and_outlier_sum_are_two_roundings(jit):
    """float32 x: torch rounds the int8 part, then adds the outlier sum; one fused multiply-add under jit
    moved this nearly cancelling output by ~2900 ulp."""
    w = np.array([[-1, 1, -1, 1, -1, 1, -1, 1]], np.float32)
    x = np.array([[1] * 8, [1, 1, 1, 1, 1, 7, 1, 1]], np.float32)
    qw = jquant.quantize(w, "int8_bnb")
    codes, scb = np.asarray(qw.data, np.int64), np.asarray(qw.scale, np.float32).reshape(1, -1)
    a = np.where((np.abs(x) >= 6).any(axis=0), 0, x)                  # column 5 is an outlier column
    row = np.abs(np.where(np.abs(x) >= 6, 0, x)).max(axis=1, keepdims=True)
    xq = np.rint(a * ((np.float32(1) / row) * np.float32(127))).astype(np.int64)
    out = ((xq @ codes.T).astype(np.float32) * (row * scb)) * np.float32(6.200124e-05)
    w32 = np.asarray(qw.dequantize(jnp.float32))
    expected = out + (np.where((np.abs(x) >= 6).any(axis=0), x, 0) @ w32.T).astype(np.float32)
    matmul = jax.jit(llm_int8_matmul) if jit else llm_int8_matmul
    same_bits(np.asarray(matmul(jnp.asarray(x), qw)), expected.astype(np.float32))
    assert abs(float(expected[0, 0])) < 1e-4 < abs(float(out[0, 0]))   # the cancellation


def test_threshold_is_a_static_number_and_huge_ones_are_infinite():
    w = jquant.quantize(np.ones((2, 8), np.float32), "int8_bnb")
    with pytest.raises(TypeError, match="Python number"):
        jax.jit(lambda t: llm_int8_matmul(jnp.ones((1, 8)), w, t))(6.0)
    with warnings.catch_warnings():            # float16(7e4) is +Inf: no overflow warning on the way
        warnings.simplefilter("error", RuntimeWarning)
        y = llm_int8_matmul(jnp.full((1, 8), 1e5, jnp.float32), w, threshold=7e4)
    # 1e5 is Inf in float16, so an outlier even of an infinite threshold, and runs in float32: finite.
    assert np.isfinite(np.asarray(y)).all()
    assert llm_int8(6.0000001).name != llm_int8(6.0000002).name != llm_int8(6.0).name
    with pytest.raises(ValueError, match="axis"):
        jquant.quantize(np.ones((2, 8), np.float32), "int8_bnb", axis=5)
    with pytest.raises(ValueError, match="needs its SCB"):
        jquant.from_checkpoint({"weight": np.zeros((2, 8), np.int8)}, "bnb")


def test_nan_in_a_long_row_is_kept():
    """torch's row max keeps a NaN; XLA's CPU max dropped it from rows of 8192 (a finite SCB, and a token
    holding NaN answered with finite numbers)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 8192)).astype(np.float32)
    w[1, 5000] = np.nan
    scb = np.asarray(jquant.quantize(w, "int8_bnb").scale).ravel()
    assert np.isnan(scb[1]) and np.isfinite(scb[[0, 2, 3]]).all()
    x = rng.standard_normal((3, 8192)).astype(np.float32)
    x[2, 7000] = np.nan
    y = np.asarray(llm_int8_matmul(jnp.asarray(x, jnp.bfloat16), jquant.quantize(np.nan_to_num(w), "int8_bnb")))
    np.testing.assert_array_equal(np.isnan(y.astype(np.float32)).all(axis=1), [False, False, True])
