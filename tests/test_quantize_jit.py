"""``formats.quantize`` runs each format as one compiled program: the same bits as op-by-op eager
execution (adversarial inputs, presets, array options), one trace per shape and options, and it still
works inside a user's ``jit``."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.formats import base
from jquant.formats.integer import quantize_int


def _adversarial(shape=(64, 128), dtype=jnp.float32, nan=False):
    """Normal values plus rounding midpoints, powers of two ± ulps, -0.0, an all-zero group,
    subnormals and near-max magnitudes."""
    x = np.asarray(jax.random.normal(jax.random.key(0), shape, jnp.float32)) * 3
    x[0, :32] = 0.0
    x[1, :8] = [-0.0, 0.5, 1.5, 2.5, -0.5, 1e-40, -1e-42, 3.0e38]
    x[2, :6] = np.nextafter(np.float32(2.0), [0, 0, 4, 4, 4, 4])
    x[3, :] = 448.0 * np.linspace(-1, 1, shape[1], dtype=np.float32)
    x[4, :] = np.float32(0.75) * np.arange(shape[1])          # many halfway points after scaling
    if nan:
        x[5, 7] = np.nan
        x[6, 3] = np.inf
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


# (format, options, input dtype): every family, int/fp8 NaN-holding, bf16 where the arithmetic
# rounds to x's dtype.
CASES = [
    ("int4", {"axis": 1, "group_size": 32}, jnp.float32),
    ("int3", {"axis": 0, "group_size": 16}, jnp.float32),
    ("int8", {"axis": 1, "rounding": "half_away", "reciprocal": True}, jnp.float32),
    ("uint8", {"group_size": 64, "arithmetic": "compressed-tensors"}, jnp.bfloat16),
    ("gguf_q8_0", {}, jnp.float32),
    ("fp8_e4m3", {"granularity": "channel"}, jnp.bfloat16),
    ("fp8_e5m2", {"granularity": "block", "block_size": (32, 64), "ue8m0": True}, jnp.float32),
    ("mxfp4", {"scale_mode": "rceil"}, jnp.float32),
    ("nvfp4", {"convention": "modelopt"}, jnp.float32),
    ("nf4", {"blocksize": 128}, jnp.bfloat16),
]


def _assert_same_bits(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def _eager(x, fmt, **options):
    with jax.disable_jit():
        return jquant.quantize(x, fmt, **options)


@pytest.mark.parametrize("fmt,options,dtype", CASES,
                         ids=[f"{f}-{'-'.join(map(str, o.values()))}-{jnp.dtype(d).name}" for f, o, d in CASES])
def test_compiled_quantize_matches_eager_bit_for_bit(fmt, options, dtype):
    x = _adversarial(dtype=dtype, nan=fmt.startswith(("fp8", "int8")))
    _assert_same_bits(jquant.quantize(x, fmt, **options), _eager(x, fmt, **options))


@pytest.mark.parametrize("fmt,options", [
    ("fp8_e4m3", {"granularity": "static", "scale": jnp.float32(0.0625)}),
    ("nvfp4", {"global_scale": np.float32(1234.5)}),
    ("nvfp4", {"global_scale": jnp.asarray([0.01], jnp.float32), "convention": "modelopt"}),
], ids=["fp8-static-scale", "nvfp4-numpy-global", "nvfp4-array-global"])
def test_array_options_are_traced_and_match_eager(fmt, options):
    x = _adversarial()
    _assert_same_bits(jquant.quantize(x, fmt, **options), _eager(x, fmt, **options))


@pytest.mark.parametrize("like,fmt,options", [
    ("compressed-tensors", "int4", {"group_size": 32}),
    ("torchao", "fp8_e4m3", {"granularity": "channel"}),
    ("gguf", "int8", {}),
    ("modelopt", "nvfp4", {}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_library_presets_match_eager(like, fmt, options):
    x = _adversarial(dtype=jnp.bfloat16)
    _assert_same_bits(jquant.quantize(x, fmt, like=like, **options), _eager(x, fmt, like=like, **options))


def test_presets_match_eager(monkeypatch):
    monkeypatch.setitem(base._PRESETS, ("ref", "int4"), {"symmetric_range": "full", "scale_dtype": jnp.float16})
    monkeypatch.setitem(base._PRESETS, ("ref", "fp8_e4m3"), {"divide_dtype": jnp.float32})
    x = _adversarial(dtype=jnp.bfloat16)
    for fmt, options in (("int4", {"axis": 1, "group_size": 64}), ("fp8_e4m3", {"granularity": "channel"})):
        got = jquant.quantize(x, fmt, like="ref", **options)
        _assert_same_bits(got, _eager(x, fmt, like="ref", **options))
        _assert_same_bits(got, jquant.quantize(x, fmt, **options, **base._PRESETS[("ref", fmt)]))


def _counting(monkeypatch):
    calls = []

    def fn(x, **options):
        calls.append(options)
        return quantize_int(x, bits=4, symmetric=True, **options)

    monkeypatch.setitem(base._QUANTIZERS, "int4_counted", fn)
    return calls


def test_one_trace_per_shape_and_options(monkeypatch):
    calls = _counting(monkeypatch)
    x = _adversarial()
    first = jquant.quantize(x, "int4_counted", axis=1, group_size=32)
    _assert_same_bits(jquant.quantize(x + 0, "int4_counted", axis=1, group_size=32), first)
    assert len(calls) == 1
    jquant.quantize(x, "int4_counted", axis=1, group_size=64)
    jquant.quantize(x[:32], "int4_counted", axis=1, group_size=32)
    assert len(calls) == 3


def test_options_that_compare_equal_in_python_are_told_apart(monkeypatch):
    """``True == 1`` and ``0.0 == -0.0``: a shared trace would skip the format's own checks."""
    calls = _counting(monkeypatch)
    x = _adversarial()
    jquant.quantize(x, "int4_counted", axis=1, group_size=64)
    with pytest.raises(ValueError, match="group_size must be an int"):
        jquant.quantize(x, "int4_counted", axis=1, group_size=64.0)
    assert len(calls) == 2
    positive = jquant.quantize(x, "nvfp4", global_scale=0.0)
    negative = jquant.quantize(x, "nvfp4", global_scale=-0.0)
    _assert_same_bits(negative, _eager(x, "nvfp4", global_scale=-0.0))
    _assert_same_bits(positive, _eager(x, "nvfp4", global_scale=0.0))


def test_inside_a_user_jit():
    x = _adversarial()
    for fmt, options in (("int4", {"axis": 1, "group_size": 32}), ("fp8_e4m3", {"granularity": "channel"}),
                         ("nf4", {})):
        jitted = jax.jit(lambda w: jquant.quantize(w, fmt, **options))(x)
        _assert_same_bits(jitted, jquant.quantize(x, fmt, **options))
    # A traced array option.
    gs = jnp.float32(300.0)
    got = jax.jit(lambda w, g: jquant.quantize(w, "nvfp4", global_scale=g))(x, gs)
    _assert_same_bits(got, _eager(x, "nvfp4", global_scale=gs))


def test_inputs_jit_would_change_run_as_given():
    """Lists, float64 arrays and unhashable options skip compilation, so the formats' own checks
    see them as they are."""
    rows = [[0.5, -1.25, 3.0, 0.0] * 8] * 4
    _assert_same_bits(jquant.quantize(rows, "int8"), jquant.quantize(np.asarray(rows, np.float32), "int8"))
    with pytest.raises(TypeError, match="float64"):
        jquant.quantize(np.ones((4, 64)), "nf4")                    # bitsandbytes refuses float64
    x = _adversarial()
    chex.assert_trees_all_equal(jquant.quantize(x, "fp8_e4m3", granularity="block", block_size=[32, 64]),
                                jquant.quantize(x, "fp8_e4m3", granularity="block", block_size=(32, 64)))
