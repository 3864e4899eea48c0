"""Bit-exact parity with compressed-tensors on float16 inputs (tools/goldens/float16_inputs.py): group
ranges, block amaxes / 6 and 1 / amax that are float16 subnormals, quotients below 2^-14, amax past
16384, -0.0, zeros, ±Inf, NaN; int4 / int8 (symmetric and asymmetric), FP8, NVFP4 weights and NVFP4
activations under a static input global scale."""

import functools
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.formats import nvfp4
from jquant.formats.integer import int_codes

GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "float16_inputs.npz")
X = GOLDEN["x"]
ROWS = list(GOLDEN["row_names"])
CASES = sorted(k[len("config_"):] for k in GOLDEN.files if k.startswith("config_"))
OPTIONS = {"tensor": {"granularity": "tensor"}, "channel": {"granularity": "channel"},
           "group": {"group_size": 32}, "block": {"granularity": "block", "block_size": (32, 32)}}
FP8_GROUP = {"granularity": "block", "block_size": (1, 32)}  # compressed-tensors' FP8 group strategy


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@functools.lru_cache(maxsize=None)
def _quantizer(fmt, strategy):
    options = FP8_GROUP if fmt.startswith("fp8") and strategy == "group" else OPTIONS[strategy]
    return jax.jit(lambda v: jquant.quantize(v, fmt, like="compressed-tensors", **options))


def _int_fp8(fmt, strategy):
    f = _quantizer(fmt, strategy)
    parts = [f(X[i:i + 1]) for i in range(len(X))] if strategy == "tensor" else [f(X)]
    offset = 2 ** (int(fmt[4:]) - 1) if fmt.startswith("uint") else 0
    if fmt.startswith("fp8"):
        codes = np.concatenate([_bits(q.data) for q in parts])
    else:
        codes = np.concatenate([np.asarray(int_codes(q)) for q in parts]) - offset
    out = {"codes": codes, "scale": np.concatenate([_bits(q.scale).reshape(-1) for q in parts])}
    if parts[0].zero is not None:
        out["zero_point"] = np.concatenate([np.asarray(q.zero).reshape(-1).astype(np.int32) for q in parts]) - offset
    return out


def _nvfp4_rows(with_global):
    qts = [jquant.quantize(X[r:r + 1], "nvfp4", like="compressed-tensors",
                           **({} if with_global else {"global_scale": None})) for r in range(len(X))]
    out = {"packed": np.stack([np.asarray(q.data) for q in qts]), "scale": np.stack([_bits(q.scale) for q in qts])}
    if with_global:
        out["global"] = np.stack([np.asarray(q.global_scale, np.float32).reshape(1) for q in qts])
    return out


def _nvfp4_activations():
    global_scale = nvfp4.global_scale_from_amax(np.float16(10.0))  # the golden's calibrated amax
    q = nvfp4.quantize_nvfp4(X, global_scale=global_scale)
    return {"packed": np.asarray(q.data), "scale": _bits(q.scale),
            "global": np.asarray(global_scale, np.float32).reshape(1)}


def _run(case):
    _, fmt, strategy = (str(v) for v in GOLDEN[f"config_{case}"])
    if fmt != "nvfp4":
        return _int_fp8(fmt, strategy)
    return _nvfp4_activations() if strategy == "activation" else _nvfp4_rows(case.endswith("global"))


def _rows_differing(got, expected):
    got, expected = got.reshape(len(ROWS), -1), expected.reshape(len(ROWS), -1)
    return sorted(ROWS[i] for i in range(len(ROWS)) if not np.array_equal(got[i], expected[i]))


@pytest.mark.parametrize("case", CASES)
def test_float16_inputs_match_compressed_tensors_bit_for_bit(case):
    got = _run(case)
    keys = sorted(k[len(case) + 1:] for k in GOLDEN.files if k.startswith(case + "_"))
    assert sorted(got) == keys
    for key in keys:
        expected = GOLDEN[f"{case}_{key}"]
        value = got[key]
        if key == "global":  # float32 either side (float16 bits in the golden)
            expected = expected.view(np.float16).astype(np.float32) if expected.dtype == np.uint16 else expected
            np.testing.assert_array_equal(value.reshape(expected.shape), expected)
            continue
        if expected.dtype != value.dtype and expected.dtype.itemsize == value.dtype.itemsize:
            value = value.view(expected.dtype)
        if case.endswith("_block") or value.size != expected.size or expected.size % len(ROWS):
            assert np.array_equal(value.reshape(-1), expected.reshape(-1)), key  # blocks mix rows
        else:
            assert not _rows_differing(value, expected), (key, _rows_differing(value, expected))


def test_golden_holds_the_float16_edge_cases():
    x = X.astype(np.float32)
    group = x[ROWS.index("tiny_range_group"), :32]
    assert 0 < group.max() - group.min() < 2.0 ** -14        # a group range that is a float16 subnormal
    assert np.abs(x[ROWS.index("amax_20000")]).max() > 16384   # 1 / amax a float16 subnormal
    sub = np.abs(x[ROWS.index("f16_subnormals")])
    assert sub.max() < 2.0 ** -14 and sub.max() > 0
    assert X.dtype == np.float16 and ml_dtypes.finfo(np.float16).smallest_normal == 2.0 ** -14


def test_a_tiny_float16_group_keeps_its_values():
    """The silent failure the golden catches: a group whose range is below 2^-14 became all zeros."""
    x = np.zeros((1, 32), np.float16)
    x[0] = np.linspace(-1e-6, 2e-6, 32).astype(np.float16)
    q = jquant.quantize(x, "uint4", like="compressed-tensors", group_size=32)
    deq, x32 = np.asarray(q.dequantize(np.float32)), x.astype(np.float32)
    # Within a quarter of the range (compressed-tensors' own float16 scale clips the top codes a little);
    # the flushed range gave scale eps = 2^-10 and dequantized everything to 0.
    assert np.abs(deq - x32).max() < 0.25 * float(x32.max() - x32.min())
    assert np.count_nonzero(deq) > 16
