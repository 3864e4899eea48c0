"""The 8-bit GEMV (``impl="triton"``) on W8A8 FP8 weights: interpret mode against float64 from the raw
codes and against the W8A8 schemes' XLA path, per tensor, per token × channel and 128 × 128 blocks,
at every M it takes; NaN and zero rows. JQUANT_TEST_GPU=1 runs the same tests on the GPU."""

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jquant
from jquant.kernels.fp8_gemm import fp8_gemm, prepack_fp8
from jquant.kernels.fp8_gemm.from_qtensor import fp8_scheme_gemm, pack_fp8_qtensor
from jquant.kernels.gemv8 import MAX_ROWS
from jquant.schemes.xla import xla_apply
from test_fp8_gemm import SCHEMES, _float64, _scheme_atol


@pytest.mark.parametrize("blocks", [False, True], ids=["token-channel", "block128"])
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", [(256, 256), (200, 300)])
def test_gemv_matches_float64(blocks, m, n, k, interpret):
    rng = np.random.default_rng()
    w = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn)
    ws = rng.uniform(0.5, 2, (-(-n // 128), -(-k // 128)) if blocks else n).astype(np.float32)
    xq = rng.standard_normal((m, k)).astype(ml_dtypes.float8_e4m3fn)
    xs = rng.uniform(0.5, 2, (m, -(-k // 128)) if blocks else (m, 1)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    y = fp8_gemm(jnp.asarray(xq), xs, prepack_fp8(w, ws), bias=bias, out_dtype=jnp.float32, impl="triton",
                 interpret=interpret)
    ref = _float64(xq, xs, w, ws, blocks) + bias
    # e4m3 codes and their products are exact in fp32: only the fp32 sums' rounding is left.
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_gemv_keeps_the_scheme_numerics(name, m, interpret):
    """The scheme with its activations quantized as it says, run by the GEMV: its XLA result."""
    scheme = jquant.get_scheme(name)
    rng = np.random.default_rng()
    w = rng.standard_normal((256, 512)).astype(np.float32)
    qw = scheme.quantize_weight(w)
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
    y = fp8_scheme_gemm(scheme, x, pack_fp8_qtensor(qw), impl="triton", interpret=interpret)
    ref = xla_apply(scheme, x, qw, None)
    chex.assert_trees_all_close(y, ref, rtol=1e-4, atol=_scheme_atol(ref))


@pytest.mark.parametrize("blocks", [False, True], ids=["token-channel", "block128"])
def test_gemv_nan_and_zero_rows(blocks, interpret):
    """A NaN code poisons its row only; an all-zero row (scale 0) gives exact zeros; a per-tensor
    weight scale of 2^110 with 448-codes overflows to Inf, not NaN."""
    rng = np.random.default_rng()
    k = 256
    w = rng.standard_normal((256, k)).astype(ml_dtypes.float8_e4m3fn)
    xq = np.asarray(rng.standard_normal((MAX_ROWS, k)), ml_dtypes.float8_e4m3fn)
    xq[2, 5] = np.nan
    xq[1] = 0
    xs = np.ones((MAX_ROWS, k // 128 if blocks else 1), np.float32)
    xs[1] = 0
    ws = np.ones((2, k // 128) if blocks else 256, np.float32)
    y = np.asarray(fp8_gemm(jnp.asarray(xq), xs, prepack_fp8(w, ws), impl="triton", interpret=interpret), np.float32)
    assert np.isnan(y[2]).all() and not y[1].any() and np.isfinite(np.delete(y, 2, axis=0)).all()
    big = prepack_fp8(np.full((128, 128), 448, ml_dtypes.float8_e4m3fn), np.float32(2.0 ** 110))
    y = fp8_gemm(jnp.full((1, 128), 448, jnp.float8_e4m3fn), jnp.ones((1, 1)), big, impl="triton",
                 interpret=interpret)
    assert np.isposinf(np.asarray(y, np.float32)).all()
