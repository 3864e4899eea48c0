"""Every registered scheme: quantize → process_weights_after_loading → apply, against a float reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant import get_scheme

# Relative error bound of y = x·Wᵀ per scheme family (random normal data; 4-bit formats lose the most).
TOLERANCE = {"int8": 0.02, "fp8": 0.08, "int4": 0.15, "uint4": 0.15, "mxfp4": 0.25, "mxfp8": 0.08, "nvfp4": 0.15,
             "nf4": 0.15, "fp4_bnb": 0.25}


def _tolerance(scheme):
    return next(v for k, v in TOLERANCE.items() if scheme.weight.format.startswith(k))


def _data(n=96, k=256, m=5):
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    return w, x, b


@pytest.mark.parametrize("name", jquant.schemes())
def test_apply_close_to_float(name):
    scheme = get_scheme(name)
    w, x, b = _data()
    qw = scheme.quantize_weight(w)
    assert qw.shape == w.shape and qw.fmt == scheme.weight.format
    prepared = scheme.process_weights_after_loading(qw)
    y = jax.jit(scheme.apply)(x, prepared, b.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (5, 96)
    ref = x.astype(jnp.float32) @ w.T + b
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < _tolerance(scheme), err
    # The plain-QTensor path computes the same thing (the XLA reference on CPU).
    chex.assert_trees_all_close(scheme.apply(x, qw, b.astype(jnp.bfloat16)).astype(jnp.float32),
                                y.astype(jnp.float32), rtol=2e-2, atol=2e-2)


def test_weight_only_apply_equals_dequantized_dot():
    scheme = get_scheme("int4_g128")
    w, x, _ = _data()
    qw = scheme.quantize_weight(w)
    y = scheme.apply(x.astype(jnp.float32), qw)
    chex.assert_trees_all_close(y, x.astype(jnp.float32) @ qw.dequantize(jnp.float32).T, rtol=1e-5, atol=1e-5)


def test_quantize_kernel_is_the_transposed_weight():
    scheme = get_scheme("int8_ch")
    w, _, _ = _data()
    np.testing.assert_array_equal(scheme.quantize_kernel(w.T).data, scheme.quantize_weight(w).data)


def test_apply_batched_leading_dims():
    scheme = get_scheme("fp8_e4m3_channel")
    w, x, _ = _data()
    qw = scheme.quantize_weight(w)
    y3 = scheme.apply(x.reshape(1, 5, 256), qw)
    chex.assert_trees_all_equal(y3[0], scheme.apply(x, qw))


@pytest.mark.parametrize("bad, err, match", [
    (lambda s, qw, x: s.apply(x[:, :128], qw), ValueError, "K=256"),
    (lambda s, qw, x: s.apply(x, qw, jnp.ones(3)), ValueError, "bias"),
    (lambda s, qw, x: s.apply(x, qw.dequantize()), TypeError, "Prepared or QTensor"),
    (lambda s, qw, x: get_scheme("nf4").apply(x, qw), ValueError, "expects a 2-D 'nf4'"),
    (lambda s, qw, x: s.quantize_weight(jnp.ones((4, 4, 4))), ValueError, "2-D"),
    (lambda s, qw, x: get_scheme("no_such_scheme"), ValueError, "unknown scheme"),
    (lambda s, qw, x: jquant.register_scheme(s), ValueError, "already registered"),
])
def test_bad_input(bad, err, match):
    scheme = get_scheme("int4_g128")
    w, x, _ = _data()
    with pytest.raises(err, match=match):
        bad(scheme, scheme.quantize_weight(w), x)


def test_block_fp8_refuses_k_that_activation_groups_cannot_tile():
    with pytest.raises(ValueError, match="K=576"):
        get_scheme("fp8_e4m3_block128x128").quantize_weight(jnp.ones((256, 576)))


@pytest.mark.parametrize("name", jquant.schemes())
def test_every_scheme_exports_to_its_checkpoint_layout_losslessly(name):
    from jquant.checkpoint.hf_checkpoint import layout_meta

    scheme = get_scheme(name)
    assert scheme.checkpoint_layout is not None, f"{name} names no vLLM checkpoint layout"
    qw = scheme.quantize_weight(_data()[0])
    tensors = jquant.to_checkpoint(qw, scheme.checkpoint_layout, **scheme.layout_kwargs())
    back = jquant.from_checkpoint(tensors, scheme.checkpoint_layout, **layout_meta(scheme))
    np.testing.assert_array_equal(back.dequantize(jnp.float32), qw.dequantize(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_, jnp.float8_e4m3fn])
@pytest.mark.parametrize("name", ["int4_g128", "fp8_e4m3_tensor", "nf4"])
def test_apply_refuses_non_float_activations(name, dtype):
    # Integer activations used to flow into the dot and come back as zeros.
    scheme = get_scheme(name)
    w, x, _ = _data()
    qw = scheme.quantize_weight(w)
    with pytest.raises(TypeError, match=r"activations x must be bfloat16, float16 or float32"):
        scheme.apply(jnp.ones_like(x, dtype=dtype), scheme.process_weights_after_loading(qw))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_apply_takes_every_16_and_32_bit_float(dtype):
    scheme = get_scheme("int8_ch")
    w, x, _ = _data()
    y = scheme.apply(x.astype(dtype), scheme.quantize_weight(w))
    assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y)))


def _static_reference(x, qw, input_scale, bias=None):
    """vLLM's static per-tensor FP8 linear in numpy: codes sat(x · (1/s)) in e4m3, then
    (codes · W_codesᵀ) · s · w_scale (+ bias), accumulated in float64 here."""
    import ml_dtypes

    inv = np.float32(1.0) / np.float32(input_scale)
    codes = np.clip(np.asarray(x, np.float32) * inv, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    w_codes = np.asarray(qw.data).astype(np.float64)
    y = codes.astype(np.float64) @ w_codes.T * float(input_scale) * float(np.asarray(qw.scale).reshape(()))
    return y if bias is None else y + np.asarray(bias, np.float64)


def test_static_fp8_apply_uses_the_given_input_scale():
    from jquant.schemes.builtin import fp8_tensor

    scheme = fp8_tensor(static_activations=True)
    w, x, b = _data()
    x = x.astype(jnp.float32).at[0, :4].set(jnp.array([1e4, -1e4, 0.0, -0.0]))  # saturates at ±448
    qw = scheme.quantize_weight(w)
    s = jnp.float32(0.0137)
    y = jax.jit(lambda x, s: scheme.apply(x, scheme.process_weights_after_loading(qw), b, input_scale=s))(x, s)
    np.testing.assert_allclose(np.asarray(y), _static_reference(x, qw, s, b), rtol=2e-5, atol=2e-4)
    with pytest.raises(ValueError, match="input_scale="):
        scheme.apply(x, qw)
    with pytest.raises(ValueError, match="one float"):
        scheme.apply(x, qw, input_scale=jnp.ones(3))


@pytest.mark.parametrize("name", jquant.schemes())
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_apply_to_no_tokens_is_empty(name, lead):
    # An empty batch used to fail in the activation quantizers ("x is empty") or in a reshape
    # (ZeroDivisionError) of the W8A8 schemes.
    scheme = get_scheme(name)
    w, _, b = _data()
    prepared = scheme.process_weights_after_loading(scheme.quantize_weight(w))
    x = jnp.ones((*lead, 256), jnp.bfloat16)
    kwargs = {"input_scale": 0.05} if scheme.activation.mode == "static" else {}
    for y in (scheme.apply(x, prepared, b, **kwargs), jax.jit(scheme.apply)(x, prepared, b, **kwargs)):
        assert y.shape == (*lead, 96) and y.dtype == jnp.bfloat16
