"""The Mosaic GPU kernel's inline-PTX decodes, run in numpy: E2M1 pairs against ml_dtypes on every
byte, 16-entry tables (NF4) through an emulation of the PTX on every pair of bytes, the word-order
decodes (8 codes per register) through the same emulation; their interpret-mode twins; the E2M1
pack / unpack and word-order round trips."""

import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from jquant.formats.bnb import _FP4 as FP4_BNB, _NF4 as NF4
from jquant.kernels.w4a16 import mosaic_gpu_decode as decode

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
    got = _halves(bits, ml_dtypes.bfloat16) * np.float32(2.0 ** decode.UNSCALE_EXP[jnp.dtype(jnp.bfloat16)])
    _assert_same_values(got, VALUES[PAIRS])


def test_fp16_constants_decode_every_byte_exactly():
    byte = _stored_bytes()
    bits = (((byte * decode.F16_PLACE_MAG) % 2**32 & decode.F16_MASK_MAG)
            | ((byte * decode.F16_PLACE_SIGN) % 2**32 & decode.F16_MASK_SIGN))
    got = _halves(bits, np.float16) * np.float32(2.0 ** decode.UNSCALE_EXP[jnp.dtype(jnp.float16)])
    _assert_same_values(got, VALUES[PAIRS])


def test_ptx_uses_the_tested_constants():
    for dtype, consts in ((jnp.bfloat16, (decode.BF16_PLACE, decode.BF16_MASK)),
                          (jnp.float16, (decode.F16_PLACE_MAG, decode.F16_MASK_MAG,
                                         decode.F16_PLACE_SIGN, decode.F16_MASK_SIGN))):
        asm = decode._e2m1_ptx(dtype)
        assert all(f"{c:#x}" in asm for c in consts)
    # The unscale immediates: 2^126 in bf16 and 2^14 in fp16, in both halves.
    assert np.array([0x7E80], np.uint16).view(ml_dtypes.bfloat16)[0] == 2.0 ** 126
    assert np.array([0x7400], np.uint16).view(np.float16)[0] == 2.0 ** 14
    assert "0x7e807e80" in decode._e2m1_ptx(jnp.bfloat16)
    assert "0x74007400" in decode._e2m1_ptx(jnp.float16)
    assert decode.UNSCALE_EXP == {jnp.dtype(jnp.bfloat16): 126, jnp.dtype(jnp.float16): 14}
    for dtype in (jnp.bfloat16, jnp.float16):   # without the unscale: no 16-bit multiply
        assert "mul.rn" not in decode._e2m1_ptx(dtype, unscale=False)


@pytest.mark.parametrize("dtype,exps", [(ml_dtypes.bfloat16, range(-60, 10)),
                                        (np.float16, range(-8, 2))])
def test_placed_bits_times_a_prescaled_scale_are_exact(dtype, exps):
    """The decode without its unscale: the placed bits (E2M1 · 2^-U, subnormal for 0 and ½)
    times a scale stored as s · 2^(126 − k) and brought to 2^(U − k) in the kernel give
    E2M1 · s · 2^-k, rounded once, for every byte, E8M0 and E4M3 scales and shifts k."""
    byte = _stored_bytes()
    if dtype == ml_dtypes.bfloat16:
        bits, u = (byte * decode.BF16_PLACE) % 2**32 & decode.BF16_MASK, 126
    else:
        bits = (((byte * decode.F16_PLACE_MAG) % 2**32 & decode.F16_MASK_MAG)
                | ((byte * decode.F16_PLACE_SIGN) % 2**32 & decode.F16_MASK_SIGN))
        u = 14
    placed = _halves(bits, dtype)
    e4m3 = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for s in np.concatenate([2.0 ** np.array(list(exps), np.float32), e4m3 / 64]):
        k_min = max(int(np.ceil(np.log2(s))) - 1, 0)   # prepack's k
        for k in (k_min, k_min + 1, k_min + 9):
            stored = np.float32(np.ldexp(s, 126 - k))   # prepack: exact, inside bf16
            row = np.asarray(np.ldexp(stored, u - 126), np.float32).astype(dtype)   # the kernel
            assert np.ldexp(row.astype(np.float32), k - u) == s   # the scale survives exactly
            got = (placed * row.astype(np.float32)).astype(dtype).astype(np.float32)
            want = (VALUES[PAIRS] * np.float32(np.ldexp(s, -k))).astype(dtype).astype(np.float32)
            _assert_same_values(got, want)


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


_HALF = {"bf16x2": ml_dtypes.bfloat16, "f16x2": np.float16}


def _half_op(op, a, b, kind):
    """A bf16x2 / f16x2 op on uint64 arrays of packed pairs: each half in fp32, rounded once
    (exact for the decodes' operands: products of 16-bit values, sums of integers < 2^8)."""
    dt = _HALF[kind]
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for shift in (0, 16):
        x, y = ((v >> np.uint64(shift)) & np.uint64(0xFFFF) for v in (a, b))
        x, y = (v.astype(np.uint16).view(dt).astype(np.float32) for v in (x, y))
        r = op(x, y).astype(dt).view(np.uint16).astype(np.uint64)
        out |= r << np.uint64(shift)
    return out


def _run_ptx(asm, **inputs):
    """Executes a decode's PTX (the ops ``w4a16_mgpu_decode`` emits) line by line on uint64
    arrays holding 32-bit values; ``inputs`` name its operands (``r2=...`` for ``$2``)."""
    regs = {f"${name[1:]}": np.asarray(v, np.uint64) for name, v in inputs.items()}
    val = lambda t: regs[t] if t in regs else np.uint64(int(t, 16) if t.startswith("0x") else int(t))
    m32 = lambda v: v % np.uint64(2**32)
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        kind = op.rsplit(".", 1)[-1]
        if op == "mov.b32":
            regs[d] = x[0]
        elif op == "mad.lo.u32":
            regs[d] = m32(x[0] * x[1] + x[2])
        elif op == "mul.lo.u32":
            regs[d] = m32(x[0] * x[1])
        elif op == "and.b32":
            regs[d] = x[0] & x[1]
        elif op == "shr.u32":
            regs[d] = x[0] >> x[1]
        elif op == "lop3.b32":
            regs[d] = {"0xEA": (x[0] & x[1]) | x[2], "0x6a": (x[0] & x[1]) ^ x[2]}[src[3]]
        elif op == "prmt.b32":
            regs[d] = _prmt(x[0], x[1], x[2])
        elif op.startswith(("sub.rn.", "mul.rn.")):
            fn = np.subtract if op.startswith("sub") else np.multiply
            regs[d] = _half_op(fn, x[0], x[1], kind)
        else:
            raise AssertionError(f"op {op} has no emulation")
    return regs


@pytest.mark.parametrize("table", [NF4, FP4_BNB], ids=["nf4", "fp4_bnb"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_table_ptx_decodes_every_pair_of_bytes(dtype, table):
    """All 65536 (byte, byte) inputs of one PTX call: 4 codes → 4 table entries, bit-exact."""
    b0, b1 = (a.ravel().astype(np.uint64) for a in np.meshgrid(np.arange(256), np.arange(256)))
    regs = _run_ptx(decode._table_ptx(table, dtype), r2=b0, r3=b1)
    out0, out1 = regs["$0"], regs["$1"]
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


# ---- word order: 8 codes per 32-bit register ----------------------------------------------------
LUTS = ["int4", "e2m1", "nf4", "fp4_bnb"]


def _values(lut, codes, dtype):
    """What each code means: int4 codes are stored values (code − 8) already."""
    if lut == "int4":
        return codes.astype(np.float32)
    table = {"e2m1": VALUES, "nf4": NF4, "fp4_bnb": FP4_BNB}[lut]
    return np.asarray(table, np.float32).astype(jnp.dtype(dtype)).astype(np.float32)[codes]


def _stored_words(lut, codes):
    """``codes`` ``[rows, 32]`` (int4 values, or codes 0..15) → the stored block's four 32-bit
    words (thread c's word is c), as the kernel's shared memory holds them."""
    stored = (decode.pack_e2m1_pairs(codes) if lut == "e2m1"
              else decode.signed_int4(jnp.asarray(codes) & 0xF))
    nib = np.asarray(decode.to_word_order(stored, lut)).astype(np.int64) & 0xF
    nib = nib.reshape(-1, 4, 8).astype(np.uint64)
    return np.sum(nib << (np.uint64(4) * np.arange(8, dtype=np.uint64)), axis=-1, dtype=np.uint64)


@pytest.mark.parametrize("lut,unscale", [("int4", True), ("e2m1", True), ("e2m1", False),
                                         ("nf4", True), ("fp4_bnb", True)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_word_ptx_gives_wgmma_registers(lut, unscale, dtype):
    """Thread c's word, decoded by the PTX, is wgmma's registers of that thread: output q holds
    the block's K columns 8q + 2c and 8q + 2c + 1, for every code at every position (E2M1
    without its unscale: the values times 2^-U, exactly)."""
    rng = np.random.default_rng(7)
    lo = -8 if lut == "int4" else 0
    # Every code at every position (a code per row, rolled), then random rows.
    ramp = (np.arange(16)[:, None] + np.arange(32)[None, :]) % 16 + lo
    codes = np.concatenate([ramp, rng.integers(lo, lo + 16, (4000, 32))])
    words = _stored_words(lut, codes)
    want = _values(lut, codes, dtype)
    if not unscale:
        want = np.ldexp(want, -decode.UNSCALE_EXP[jnp.dtype(dtype)])
    for c in range(4):
        regs = _run_ptx(decode.word_ptx(lut, dtype, unscale), r4=words[:, c])
        for q in range(4):
            got = np.stack([regs[f"${q}"] & 0xFFFF, regs[f"${q}"] >> 16], -1).astype(np.uint16)
            got = got.view(jnp.dtype(dtype)).astype(np.float32)
            _assert_same_values(got, want[:, [8 * q + 2 * c, 8 * q + 2 * c + 1]])


@pytest.mark.parametrize("lut", LUTS)
def test_word_order_round_trip_and_bad_k(lut):
    codes = jnp.asarray(np.random.default_rng(8).integers(-8, 8, (3, 96)), jnp.int4)
    stored = decode.to_word_order(codes, lut)
    assert stored.dtype == jnp.int4 and not np.array_equal(np.asarray(stored), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(decode.from_word_order(stored, lut)),
                                  np.asarray(codes))
    assert sorted(decode.word_order_sources(lut)) == list(range(32))
    with pytest.raises(ValueError, match=r"blocks of 32 codes.*\(3, 48\)"):
        decode.to_word_order(codes[:, :48], lut)


def test_word_order_takes_aliases_and_refuses_unknown_code_books():
    np.testing.assert_array_equal(decode.word_order_sources("uint4"),
                                  decode.word_order_sources("int4"))
    with pytest.raises(ValueError, match="bogus"):
        decode.to_word_order(jnp.zeros((2, 32), jnp.int4), "bogus")


@pytest.mark.parametrize("lut", LUTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_word_twin_matches_the_byte_decode(lut, dtype):
    """Interpret mode's word decode is the K-order decode of the same codes."""
    codes = np.random.default_rng(9).integers(0, 16, (8, 64))
    stored = (decode.pack_e2m1_pairs(codes) if lut == "e2m1"
              else decode.signed_int4(jnp.asarray(codes)))
    want = decode.decode_codes(stored, dtype, lut=lut, interpret=True)
    got = decode.decode_words(decode.to_word_order(stored, lut), dtype, lut=lut, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
