"""The 8-bit GEMV (``impl="triton"``) on W8A8 FP8 weights: interpret mode against float64 from the raw
codes, per token × channel and 128 × 128 blocks, at every M it takes; NaN and zero rows (against the
schemes' XLA path: ``test_fp8_gemm.test_kernel_keeps_the_scheme_numerics``). JQUANT_TEST_GPU=1 runs
the same tests on the GPU."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jquant.kernels.fp8_gemm import fp8_gemm, prepack_fp8
from jquant.kernels.gemv8.config import MAX_ROWS
from test_fp8_gemm import _float64


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


def test_gemv_overflows_to_inf(interpret):
    """448-codes times a per-tensor weight scale of 2^110 overflow to Inf, not NaN (NaN and zero rows:
    ``test_fp8_gemm.test_nan_and_zero_rows``)."""
    big = prepack_fp8(np.full((128, 128), 448, ml_dtypes.float8_e4m3fn), np.float32(2.0 ** 110))
    y = fp8_gemm(jnp.full((1, 128), 448, jnp.float8_e4m3fn), jnp.ones((1, 1)), big, impl="triton",
                 interpret=interpret)
    assert np.isposinf(np.asarray(y, np.float32)).all()
