"""The Mosaic GPU kernel's inline-PTX decodes, run on every input in numpy: E2M1 pairs against
ml_dtypes, 16-entry tables (NF4) through an emulation of ``prmt``; their interpret-mode twins; the
E2M1 pack / unpack round trip."""

import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from jquant.formats.bnb import _FP4 as FP4_BNB, _NF4 as NF4
from jquant.pallas_kernels import w4a16_mgpu_decode as decode

CODES = np.arange(16, dtype=np.uint8)
VALUES = CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float32)   # code → value, ml_dtypes' own
PAIRS = np.stack(np.meshgrid(CODES, CODES, indexing="ij"), -1).reshape(256, 2)   # (code_k, code_k+1)


def _stored_bytes():
    """Each pair's byte in shared memory: low nibble = stored position 2j, high = 2j+1."""
    nib = np.asarray(decode.pack_e2m1_pairs(PAIRS)).astype(np.int32) & 0xF
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
    bits = (byte * decode.BF16_PLACE) % 2**32 & decode.BF16_MASK
    got = _halves(bits, ml_dtypes.bfloat16) * np.float32(decode.BF16_UNSCALE)
    _assert_same_values(got, VALUES[PAIRS])


def test_fp16_constants_decode_every_byte_exactly():
    byte = _stored_bytes()
    bits = (((byte * decode.F16_PLACE_MAG) % 2**32 & decode.F16_MASK_MAG)
            | ((byte * decode.F16_PLACE_SIGN) % 2**32 & decode.F16_MASK_SIGN))
    got = _halves(bits, np.float16) * np.float32(decode.F16_UNSCALE)
    _assert_same_values(got, VALUES[PAIRS])


def test_ptx_uses_the_tested_constants():
    for dtype, consts in ((jnp.bfloat16, (decode.BF16_PLACE, decode.BF16_MASK)),
                          (jnp.float16, (decode.F16_PLACE_MAG, decode.F16_MASK_MAG,
                                         decode.F16_PLACE_SIGN, decode.F16_MASK_SIGN))):
        asm = decode._E2M1_PTX[jnp.dtype(dtype)]
        assert all(f"{c:#x}" in asm for c in consts)
    # The unscale immediates: 2^126 in bf16 and 2^14 in fp16, in both halves.
    assert np.array([0x7E80], np.uint16).view(ml_dtypes.bfloat16)[0] == decode.BF16_UNSCALE
    assert np.array([0x7400], np.uint16).view(np.float16)[0] == decode.F16_UNSCALE
    assert "0x7E807E80" in decode._E2M1_PTX[jnp.dtype(jnp.bfloat16)]
    assert "0x74007400" in decode._E2M1_PTX[jnp.dtype(jnp.float16)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpret_twin_matches_ml_dtypes(dtype):
    stored = decode.pack_e2m1_pairs(PAIRS.reshape(4, 128))
    got = np.asarray(decode.decode_e2m1_pairs_jnp(stored, dtype), np.float32)
    assert got.dtype == np.float32 and got.shape == (4, 128)
    _assert_same_values(got, VALUES[PAIRS.reshape(4, 128)])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), pairs=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(rows, pairs, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (rows, 2 * pairs))
    stored = decode.pack_e2m1_pairs(codes)
    assert stored.dtype == jnp.int4 and stored.shape == codes.shape
    np.testing.assert_array_equal(np.asarray(decode.unpack_e2m1_pairs(stored)), codes)


def test_pack_refuses_an_odd_k():
    with pytest.raises(ValueError, match=r"even last axis.*\(3, 5\)"):
        decode.pack_e2m1_pairs(np.zeros((3, 5), np.int32))


# ---- 16-entry tables ---------------------------------------------------------------------------
def _prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) on uint64 arrays: byte i of the result is byte ``sel``
    nibble i (low 3 bits) of ``b:a``, or that byte's sign bit repeated when the nibble's bit 3 is set."""
    pool = [(w >> np.uint64(8 * i)) & np.uint64(0xFF) for w in (a, b) for i in range(4)]
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = np.choose((nib & np.uint64(7)).astype(np.int64), pool)
        byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out


def _run_table_ptx(asm, r0, r1):
    """Executes the table decode's PTX (``_table_ptx``: mad, and, shr, lop3, prmt) line by line."""
    regs = {"$2": r0, "$3": r1}
    val = lambda t: regs[t] if t in regs else np.uint64(int(t, 16) if t.startswith("0x") else int(t))
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." :
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        if op == "mad.lo.u32":
            regs[d] = (x[0] * x[1] + x[2]) % 2**32
        elif op == "and.b32":
            regs[d] = x[0] & x[1]
        elif op == "shr.u32":
            regs[d] = x[0] >> x[1]
        elif op == "lop3.b32":
            assert src[3] == "0xEA"   # (a & b) | c
            regs[d] = (x[0] & x[1]) | x[2]
        elif op == "prmt.b32":
            regs[d] = _prmt(x[0], x[1], x[2])
        else:
            raise AssertionError(f"op {op} has no emulation")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("table", [NF4, FP4_BNB], ids=["nf4", "fp4_bnb"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_table_ptx_decodes_every_pair_of_bytes(dtype, table):
    """All 65536 (byte, byte) inputs of one PTX call: 4 codes → 4 table entries, bit-exact."""
    b0, b1 = (a.ravel().astype(np.uint64) for a in np.meshgrid(np.arange(256), np.arange(256)))
    out0, out1 = _run_table_ptx(decode._table_ptx(table, dtype), b0, b1)
    codes = np.stack([b0 & 15, b0 >> 4, b1 & 15, b1 >> 4], -1).astype(np.int64)
    got = np.stack([out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16], -1).astype(np.uint16)
    want = table.astype(jnp.dtype(dtype))[codes]
    np.testing.assert_array_equal(got.view(jnp.dtype(dtype)), want)


def test_table_words_hold_low_and_high_bytes():
    lo, hi = decode.table_words(NF4, jnp.bfloat16)
    bits = NF4.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert all((lo[c // 4] >> (8 * (c % 4))) & 0xFF == bits[c] & 0xFF for c in range(16))
    assert all((hi[c // 4] >> (8 * (c % 4))) & 0xFF == bits[c] >> 8 for c in range(16))
    with pytest.raises(ValueError, match="16 values, got shape \\(8,\\)"):
        decode.table_words(NF4[:8], jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_table_twin_matches_the_table(dtype):
    codes = np.random.default_rng(3).integers(0, 16, (8, 64))
    got = decode.decode_table_jnp(decode.signed_int4(jnp.asarray(codes)), NF4, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got), NF4.astype(jnp.dtype(dtype))[codes])


def test_decode_refuses_a_non_16_bit_dtype():
    with pytest.raises(TypeError, match=r"bf16 or fp16 .* float32 for codes of shape \(2, 64\)"):
        decode.decode_codes(jnp.zeros((2, 64), jnp.int4), jnp.float32, lut="nf4", interpret=True)
