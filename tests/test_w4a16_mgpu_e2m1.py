"""The E2M1 pair layout of the Mosaic GPU kernel: the decode's constants against ml_dtypes for every
byte, its interpret-mode twin, and the pack / unpack round trip."""

import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from jquant.pallas_kernels import w4a16_mgpu_e2m1 as e2m1

CODES = np.arange(16, dtype=np.uint8)
VALUES = CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float32)   # code → value, ml_dtypes' own
PAIRS = np.stack(np.meshgrid(CODES, CODES, indexing="ij"), -1).reshape(256, 2)   # (code_k, code_k+1)


def _stored_bytes():
    """Each pair's byte in shared memory: low nibble = stored position 2j, high = 2j+1."""
    nib = np.asarray(e2m1.pack_e2m1_pairs(PAIRS)).astype(np.int32) & 0xF
    return (nib[:, 0] | nib[:, 1] << 4).astype(np.uint64)


def _halves(bits, dtype):
    halves = np.stack([bits & 0xFFFF, bits >> 16], -1).astype(np.uint16)
    return halves.view(dtype).astype(np.float32)


def _assert_same_values(got, want):
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))   # -0.0 stays -0.0


def test_bf16_constants_decode_every_byte_exactly():
    """What the PTX does: multiply, mask, then × 2^126 on the bf16 halves (numpy keeps subnormals)."""
    byte = _stored_bytes()
    bits = (byte * e2m1.BF16_PLACE) % 2**32 & e2m1.BF16_MASK
    got = _halves(bits, ml_dtypes.bfloat16) * np.float32(e2m1.BF16_UNSCALE)
    _assert_same_values(got, VALUES[PAIRS])


def test_fp16_constants_decode_every_byte_exactly():
    byte = _stored_bytes()
    bits = (((byte * e2m1.F16_PLACE_MAG) % 2**32 & e2m1.F16_MASK_MAG)
            | ((byte * e2m1.F16_PLACE_SIGN) % 2**32 & e2m1.F16_MASK_SIGN))
    got = _halves(bits, np.float16) * np.float32(e2m1.F16_UNSCALE)
    _assert_same_values(got, VALUES[PAIRS])


def test_ptx_uses_the_tested_constants():
    for dtype, consts in ((jnp.bfloat16, (e2m1.BF16_PLACE, e2m1.BF16_MASK)),
                          (jnp.float16, (e2m1.F16_PLACE_MAG, e2m1.F16_MASK_MAG,
                                         e2m1.F16_PLACE_SIGN, e2m1.F16_MASK_SIGN))):
        asm = e2m1._PTX[jnp.dtype(dtype)]
        assert all(f"{c:#x}" in asm for c in consts)
    # The unscale immediates: 2^126 in bf16 and 2^14 in fp16, in both halves.
    assert np.array([0x7E80], np.uint16).view(ml_dtypes.bfloat16)[0] == e2m1.BF16_UNSCALE
    assert np.array([0x7400], np.uint16).view(np.float16)[0] == e2m1.F16_UNSCALE
    assert "0x7E807E80" in e2m1._PTX[jnp.dtype(jnp.bfloat16)]
    assert "0x74007400" in e2m1._PTX[jnp.dtype(jnp.float16)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpret_twin_matches_ml_dtypes(dtype):
    stored = e2m1.pack_e2m1_pairs(PAIRS.reshape(4, 128))
    got = np.asarray(e2m1.decode_e2m1_pairs_jnp(stored, dtype), np.float32)
    assert got.dtype == np.float32 and got.shape == (4, 128)
    _assert_same_values(got, VALUES[PAIRS.reshape(4, 128)])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), pairs=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(rows, pairs, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (rows, 2 * pairs))
    stored = e2m1.pack_e2m1_pairs(codes)
    assert stored.dtype == jnp.int4 and stored.shape == codes.shape
    np.testing.assert_array_equal(np.asarray(e2m1.unpack_e2m1_pairs(stored)), codes)


def test_pack_refuses_an_odd_k():
    with pytest.raises(ValueError, match=r"even last axis.*\(3, 5\)"):
        e2m1.pack_e2m1_pairs(np.zeros((3, 5), np.int32))
