"""Block-scaled FP8 W8A8 on XLA's FP8 dot, one batched dot per K group (the GPU path), equals the
dequantize-then-dot path; past its memory bound it falls back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jquant
from jquant.schemes import dispatch
from jquant.schemes import xla as xla_impl


def _run(scheme, x, qw, native: bool, monkeypatch):
    monkeypatch.setattr(dispatch, "native_fp8_dot", lambda device=None: native)
    return xla_impl.xla_apply(scheme, x, qw, None).astype(jnp.float32)


@pytest.mark.parametrize("name", ["fp8_e4m3_block128x128", "fp8_e4m3_block128x128_ue8m0"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (7, 200, 384), (33, 384, 384), (5, 256, 128)])
def test_blockwise_dot_equals_dequantize_then_dot(name, m, n, k, monkeypatch):
    """K = 128 (one K block, N > 128) once crashed the GPU path: its scales were taken as per-row."""
    rng = np.random.default_rng()
    scheme = jquant.get_scheme(name)
    qw = scheme.quantize_weight(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32))
    x = rng.standard_normal((m, k)) * 3
    x[0] = 0.0                                          # a zero row: scale 0 must give 0, not NaN
    x = jnp.asarray(x, jnp.bfloat16)
    fast = _run(scheme, x, qw, True, monkeypatch)
    assert "f8" in str(jax.make_jaxpr(lambda x: xla_impl.xla_apply(scheme, x, qw, None))(x))
    monkeypatch.setattr(dispatch, "native_fp8_dot", lambda device=None: False)
    slow = xla_impl.xla_apply(scheme, x, qw, None).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=1e-2, atol=1e-2)
    assert np.all(np.asarray(fast)[0] == 0.0) and np.isfinite(np.asarray(fast)).all()


def test_large_partials_fall_back_to_dequantize(monkeypatch):
    scheme = jquant.get_scheme("fp8_e4m3_block128x128")
    qw = scheme.quantize_weight(jnp.ones((256, 256), jnp.float32))
    xq = xla_impl.quantize_activation(scheme, jnp.ones((4, 256), jnp.bfloat16))
    monkeypatch.setattr(dispatch, "native_fp8_dot", lambda device=None: True)
    assert xla_impl._fp8_blocks(xq, qw) == (128, 128)
    monkeypatch.setattr(xla_impl, "BLOCKWISE_FP8_MAX_BYTES", 2 * 4 * 256 * 4 - 1)
    assert xla_impl._fp8_blocks(xq, qw) is None
