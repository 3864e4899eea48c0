"""Bit-exact parity of the int / FP8 presets with torchao, compressed-tensors and gguf-py on adversarial
inputs (tools/goldens/adversarial_int_fp8.py: rounding midpoints, amax a few ulps around powers of two,
-0.0, all-zero rows and groups, subnormals, near float32's max, ±Inf, NaN)."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.formats import quantize
from jquant.formats.integer import int_codes

GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "adversarial_int_fp8.npz")
ROWS = list(GOLDEN["row_names"])
CASES = sorted(k[len("config_"):] for k in GOLDEN.files if k.startswith("config_"))
# gguf-py's 1/d overflows to inf for d < 2**-128 and casts ±inf to int8 (platform-defined): the one
# documented deviation (jquant.formats.integer).
GGUF_OVERFLOW_ROWS = {"subnormal_only", "subnormal_smallest", "scale_subnormal", "mixed_subnormal"}


def _input(name):
    a = GOLDEN[name]
    return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a


def _options(like, fmt, strategy):
    if like == "gguf":
        return {}
    if fmt.startswith("fp8"):
        return {"tensor": {"granularity": "tensor"}, "row": {"granularity": "channel"},
                "channel": {"granularity": "channel"}, "token": {"granularity": "channel"},
                "group": {"granularity": "block", "block_size": (1, 32)},  # compressed-tensors' fp8 group
                "block": {"granularity": "block", "block_size": (32, 32)}}[strategy]
    return {"channel": {"granularity": "channel"}, "group": {"group_size": 32}}[strategy]


@functools.lru_cache(maxsize=None)
def _quantizer(like, fmt, strategy):
    return jax.jit(lambda v: quantize(v, fmt, like=like, **_options(like, fmt, strategy)))


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _run(case):
    like, fmt, strategy, input_name = (str(v) for v in GOLDEN[f"config_{case}"])
    x = _input(input_name)
    f = _quantizer(like, fmt, strategy)
    parts = [f(x[i:i + 1]) for i in range(len(x))] if strategy == "tensor" else [f(x)]
    offset = 2 ** (int(fmt[4:]) - 1) if fmt.startswith("uint") else 0
    if fmt.startswith("fp8"):
        codes = np.concatenate([_bits(q.data) for q in parts])
    else:
        codes = np.concatenate([np.asarray(int_codes(q)) for q in parts]) - offset
    out = {"codes": codes, "scale": np.concatenate([_bits(q.scale).reshape(-1) for q in parts]),
           "dequant": np.concatenate([np.asarray(q.dequantize(jnp.float32)) for q in parts])}
    if parts[0].zero is not None:
        out["zero_point"] = np.concatenate([np.asarray(q.zero).reshape(-1).astype(np.int32) for q in parts]) - offset
    return like, strategy, input_name, out


def _bad_rows(got, expected, per_row):
    return {ROWS[i // per_row] for i in np.flatnonzero(got.reshape(-1) != expected.reshape(-1))}


@pytest.mark.parametrize("case", CASES)
def test_preset_matches_reference_bit_for_bit(case):
    like, strategy, _, got = _run(case)
    allowed = GGUF_OVERFLOW_ROWS if like == "gguf" else set()
    for key in ("codes", "scale", "zero_point"):
        if f"{case}_{key}" not in GOLDEN.files:
            assert key not in got
            continue
        expected = GOLDEN[f"{case}_{key}"]
        if key == "scale":
            expected = _bits(expected).reshape(-1)
        assert got[key].size == expected.size, key
        if strategy == "block":  # 32-row blocks mix rows: exact everywhere or not at all
            bad = set() if np.array_equal(got[key].reshape(-1), expected.reshape(-1)) else {"block"}
        else:
            bad = _bad_rows(got[key], expected, expected.size // len(ROWS))
        assert bad <= allowed, f"{key} differs from {like} in rows {sorted(bad)}"
    # The documented deviations stay finite on jquant's side, never NaN.
    for name in allowed:
        assert np.isfinite(got["dequant"][ROWS.index(name)]).all(), name


def test_gguf_overflow_rows_store_zero_scales_as_gguf_does():
    """Where gguf-py's 1/d overflows, both sides store d = 0 (float16), so both dequantize to 0."""
    _, _, _, got = _run("gguf_q8_0")
    for name in GGUF_OVERFLOW_ROWS:
        i = ROWS.index(name)
        assert (GOLDEN["gguf_q8_0_scale"][i] == 0).all()
        np.testing.assert_array_equal(got["dequant"][i], 0.0)


def test_golden_covers_the_adversarial_classes():
    x = GOLDEN["x"]
    assert {"all_zero", "all_neg_zero", "zero_group", "neg_zero", "inf", "nan", "near_max",
            "mid_fp8_e4m3", "mid_int_asym"} <= set(ROWS)
    assert np.signbit(x[ROWS.index("all_neg_zero")]).all()
    sub = np.abs(x[ROWS.index("subnormal_only")])
    assert (sub < np.finfo(np.float32).tiny).all() and sub.max() > 0
    assert np.isnan(x[ROWS.index("nan")]).sum() == 1 and np.isinf(x[ROWS.index("inf")]).sum() == 2
