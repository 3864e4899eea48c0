"""``dequantize`` returns the dtype asked for (float32 by default) for every format, whatever the
dtype of the array that was quantized or the checkpoint it came from; non-float dtypes are refused."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant

# One case per dequantizer (nested bitsandbytes statistics included), quantized from bfloat16.
CASES = [
    ("int4", {"axis": 1, "group_size": 32}),
    ("uint4", {"axis": 1, "group_size": 32}),
    ("int8", {"axis": 1}),
    ("gguf_q8_0", {}),
    ("fp8_e4m3", {"granularity": "channel"}),
    ("fp8_e5m2", {"granularity": "block", "block_size": (32, 32)}),
    ("mxfp4", {}),
    ("mxfp8_e4m3", {}),
    ("nvfp4", {}),
    ("nf4", {"compress_statistics": True}),
    ("fp4_bnb", {}),
    ("bnb_dynamic8", {"blocksize": 256}),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _weight():
    w = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)
    return w.at[0, :32].set(0.0).at[1, 0].set(-0.0).astype(jnp.bfloat16)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def qt(request):
    fmt, opts = request.param
    return jquant.quantize(_weight(), fmt, **opts)


def test_default_is_float32_whatever_was_quantized(qt):
    assert qt.dtype == jnp.bfloat16
    assert qt.dequantize().dtype == jnp.float32
    assert jquant.dequantize(qt).dtype == jnp.float32
    assert jax.jit(lambda q: q.dequantize())(qt).dtype == jnp.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_the_dtype_asked_for_is_the_float32_result_rounded_once(qt, dtype):
    out = qt.dequantize(dtype)
    assert out.dtype == dtype and out.shape == qt.shape
    want = np.asarray(qt.dequantize()).astype(jnp.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), want.view(np.uint8))
    assert jax.jit(lambda q: q.dequantize(dtype))(qt).dtype == dtype


def test_ml_dtypes_and_dtype_names_are_accepted(qt):
    assert qt.dequantize(ml_dtypes.bfloat16).dtype == jnp.bfloat16    # kind 'V', still a float
    assert qt.dequantize("float16").dtype == jnp.float16
    assert qt.dequantize(np.dtype(np.float32)).dtype == jnp.float32


@pytest.mark.parametrize("bad", [jnp.int32, jnp.uint8, jnp.int4, bool, np.complex64, "int8"])
def test_non_float_dtypes_are_refused(qt, bad):
    with pytest.raises(TypeError, match=rf"floating dtype.*got {jnp.dtype(bad)}"):
        qt.dequantize(bad)
    with pytest.raises(TypeError, match="floating dtype"):
        jquant.dequantize(qt, bad)


def test_a_dtype_that_is_not_a_dtype_is_refused(qt):
    with pytest.raises(TypeError, match=rf"fmt={qt.fmt!r}.*floating dtype"):
        qt.dequantize("not-a-dtype")


def test_checkpoints_dequantize_to_float32_by_default():
    qw = jquant.get_scheme("int4_g32").quantize_weight(_weight())
    loaded = jquant.from_checkpoint(jquant.to_checkpoint(qw, "gptq"), "gptq", bits=4, group_size=32, sym=True,
                                    dtype=jnp.float16)
    assert loaded.dtype == jnp.float16
    assert loaded.dequantize().dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded.dequantize()), np.asarray(qw.dequantize()))
