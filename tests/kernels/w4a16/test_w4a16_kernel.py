"""``w4a16_matmul``'s entry: the code books, the CPU paths (auto, xla, reference), forcing the
kernel where it cannot run, and bad input. The kernel itself: test_w4a16_mgpu.py."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from w4_inputs import random_w4_weight
from jquant.formats.bnb import _FP4 as FP4_BNB_VALUES, _NF4 as NF4_VALUES   # goldens-checked
from jquant.kernels.w4a16 import (IMPLS, LUTS, MgpuConfig, lut_values, prepack_nk, reference_nk,
                                   resolve_impl, w4a16_matmul)
from jquant.kernels.w4a16 import api as dispatch

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.fixture(scope="module")
def packed():
    q, s, z = random_w4_weight(np.random.default_rng(4), 256, 128, 128, zeros="int",
                               scale_dtype="bf16")
    return prepack_nk(q, s, z, group_size=128)


def test_lut_values_are_the_format_modules_code_books():
    assert LUTS == ("int4", "e2m1", "nf4", "fp4_bnb")
    np.testing.assert_array_equal(lut_values("int4"), np.arange(16, dtype=np.float32))
    np.testing.assert_array_equal(lut_values("uint4"), lut_values("int4"))
    for alias in ("e2m1", "fp4", "mxfp4", "nvfp4"):
        # -0.0 is code 8: compare bits, not values
        np.testing.assert_array_equal(lut_values(alias).view(np.uint32), E2M1.view(np.uint32))
    np.testing.assert_array_equal(lut_values("NF4"), np.asarray(NF4_VALUES, np.float32))
    np.testing.assert_array_equal(lut_values("fp4_bnb"), np.asarray(FP4_BNB_VALUES, np.float32))
    with pytest.raises(ValueError, match="lut must be one of"):
        lut_values("fp8")


def test_auto_and_xla_paths_on_cpu(packed):
    x = jax.random.normal(jax.random.PRNGKey(1), (5, packed.k), jnp.bfloat16)
    ref = reference_nk(x, packed)
    assert resolve_impl("auto", 5) == "reference"
    np.testing.assert_array_equal(np.asarray(w4a16_matmul(x, packed), np.float32),
                                  np.asarray(ref, np.float32))
    assert _rel_err(w4a16_matmul(x, packed, impl="xla"), ref) <= 1e-2
    assert resolve_impl("auto", 1, interpret=True) == resolve_impl("pallas", 64, interpret=True)
    assert resolve_impl("auto", 1, interpret=True) == "mgpu"


def test_matmul_rejects_bad_inputs(packed):
    x = jnp.ones((1, packed.k), jnp.bfloat16)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        w4a16_matmul(x.astype(jnp.int32), packed)
    with pytest.raises(ValueError, match=r"expected \[..., K=256\]"):
        w4a16_matmul(jnp.ones((1, 100), jnp.bfloat16), packed)
    with pytest.raises(ValueError, match="bias has shape"):
        w4a16_matmul(x, packed, bias=jnp.ones(3))
    assert IMPLS == ("auto", "pallas", "mgpu", "xla", "reference")
    for impl in ("cuda", "gemv", "mma"):
        with pytest.raises(ValueError, match="impl must be one of"):
            w4a16_matmul(x, packed, impl=impl)
    with pytest.raises(TypeError, match="PackedW4NK"):
        w4a16_matmul(x, "weights")
    with pytest.raises(TypeError, match="must be an MgpuConfig, got dict"):
        w4a16_matmul(x, packed, config={"block_n": 64})
    w4a16_matmul(x, packed, config=MgpuConfig())   # ignored where no kernel runs


def test_forced_kernel_on_cpu_warns_once_or_raises(packed):
    x = jnp.ones((1, packed.k), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs a Hopper GPU.*interpret=True"):
        w4a16_matmul(x, packed, impl="pallas")
    dispatch._warned.discard("w4a16:0")
    with pytest.warns(RuntimeWarning, match="cannot run on cpu"):
        out = w4a16_matmul(x, packed, impl="mgpu")
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(reference_nk(x, packed), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the second time is silent
        w4a16_matmul(x, packed, impl="mgpu")
