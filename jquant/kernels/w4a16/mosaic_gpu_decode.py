"""4-bit codes → wgmma's 16-bit A registers in the Mosaic GPU W4A16 kernel: E2M1 and any
16-entry table (NF4), which Mosaic GPU cannot convert, and (in word order) int4.

In wgmma's register layout each 32-bit register of the int4 tile holds two adjacent K positions
(one byte of shared memory), and its decoded twin one bf16x2 / f16x2 register. The decodes are
inline PTX on those registers (``plgpu.inline_mgpu``); interpret mode cannot run PTX and uses
an XLA twin of each. Weights in *word order* (the default, below) are read 8 codes per register
and decoded four output registers per call; the byte decodes serve weights in K order.

**E2M1** (FP4), three instructions per pair. Hopper has no FP4 conversion, so a pair of codes is
stored as the byte ``rot(code_k) << 4 | rot(code_k+1)``, where ``rot`` rotates the nibble
``s e1 e0 m`` left by one bit to ``e1 e0 m s``. One 32-bit multiply by ``2^1 + 2^11 + 2^21 +
2^31`` then places four shifted copies of the byte without overlap (no carries), and a mask keeps,
in each bf16 half, the sign at bit 15 and ``e1 e0 m`` at bits 8..6: the bf16 number
``E2M1 · 2^-126``, exact for every code (subnormal for 0 and ½, like E2M1's own). One
``mul.bf16x2`` by ``2^126`` gives the value, or, where a scale multiply follows, the stored
scales carry the ``2^126`` (``E2M1_SCALE_EXP``) and that multiply is the only one. fp16 puts
``e1 e0 m`` at bits 11..9 (``E2M1 · 2^-14``) with two multiplies and masks. The constants came
from a search over byte layouts.

**Tables** (NF4, or any 16 values), six instructions per pair. Codes are stored as they are. Two
registers (four codes, one per selector nibble) are looked up at once with ``prmt``, which picks
bytes out of a pair of registers by 3-bit indices: the low bytes of the 16 table entries sit in
four immediates, so two ``prmt`` look up entries 0–7 and 8–15 and a third picks per code by its
bit 3; the same for the high bytes; two more interleave low and high bytes into two bf16x2
registers (the scheme of CUTLASS's int4 → fp8 conversion, taken to 16-bit entries).

The code books themselves (``LUTS``, ``lut_values``) are defined here, next to their decodes.

``tests/test_w4a16_mgpu_decode.py`` runs both formulas on every input (256 bytes; 65536 pairs of
bytes, with ``prmt`` emulated in numpy) against ml_dtypes and the table.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from jquant.formats import bnb, mx

# The code books: integers, OCP E2M1, and bitsandbytes' two tables (NF4 and its own FP4, which is
# not E2M1).
LUTS = ("int4", "e2m1", "nf4", "fp4_bnb")
_LUT_ALIASES = {"int4": "int4", "uint4": "int4", "e2m1": "e2m1", "fp4": "e2m1", "mxfp4": "e2m1",
                "nvfp4": "e2m1", "nf4": "nf4", "fp4_bnb": "fp4_bnb"}


def lut_values(lut: str) -> np.ndarray:
    """The 16 float32 values code ``0..15`` stands for under ``lut`` (the format modules' own).

    Examples:
      >>> from jquant.kernels.w4a16 import LUTS, lut_values
      >>> LUTS
      ('int4', 'e2m1', 'nf4', 'fp4_bnb')
      >>> lut_values("e2m1").tolist()  # OCP E2M1 (FP4): sign bit 3
      [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
      >>> lut_values("mxfp4").tolist() == lut_values("e2m1").tolist()  # an alias
      True
      >>> v = lut_values("nf4")
      >>> str(v.dtype), v.shape, float(v[0]), float(v[7]), float(v[15])
      ('float32', (16,), -1.0, 0.0, 1.0)
    """
    lut = canonical_lut(lut)
    if lut == "int4":
        return np.arange(16, dtype=np.float32)
    if lut == "e2m1":
        return mx.E2M1_VALUES.copy()
    return bnb.code_table(lut)


# 8-bit code books the same pipeline reads (``jquant.kernels.w8a16``): signed int8, FP8 e4m3.
BYTE_LUTS = ("int8", "e4m3")


def code_bits(lut: str) -> int:
    """Bits per stored code: 8 for ``BYTE_LUTS``, else 4."""
    return 8 if lut in BYTE_LUTS else 4


def canonical_lut(lut) -> str:
    if not isinstance(lut, str) or lut.lower() not in _LUT_ALIASES:
        raise ValueError(f"lut must be one of {sorted(_LUT_ALIASES)}, got {lut!r}")
    return _LUT_ALIASES[lut.lower()]


# ---- E2M1 --------------------------------------------------------------------------------------
# bf16: one multiply places sign and magnitude of both codes; the mask keeps them.
BF16_PLACE, BF16_MASK = 0x80200802, 0x81C081C0
# fp16: magnitudes and signs need different shifts.
F16_PLACE_MAG, F16_MASK_MAG = 0x01000010, 0x0E000E00
F16_PLACE_SIGN, F16_MASK_SIGN = 0x80000800, 0x80008000
# The placed bits are the values times 2^-UNSCALE_EXP. Stored E2M1 scales carry 2^E2M1_SCALE_EXP
# (and the global scale the 2^-k that keeps them in bf16, ``prepack_nk``), so a decode whose
# scale multiply follows skips its own unscale and multiplies the placed bits by the scale.
UNSCALE_EXP = {jnp.dtype(jnp.bfloat16): 126, jnp.dtype(jnp.float16): 14}
E2M1_SCALE_EXP = 126


def _ptx(registers: str, ops: list[str]) -> str:
    """An inline-PTX block declaring ``registers`` and running ``ops``."""
    return "{\n    .reg .b32 " + registers + ";\n    " + "\n    ".join(ops) + "\n    }"


def _pair_bits(value: float, dtype) -> int:
    """``value`` in ``dtype`` in both halves of a 32-bit register."""
    half = int(np.asarray(value, np.float32).astype(jnp.dtype(dtype)).view(np.uint16))
    return half << 16 | half


def _rotate_nibble(c):
    return ((c << 1) | (c >> 3)) & 0xF


def pack_e2m1_pairs(codes):
    """Standard E2M1 codes ``[..., K]`` (0..15, K even) → the kernel's stored nibbles as signed
    int4 values: position 2j holds ``rot(code[2j+1])`` (low nibble of the pair's byte), 2j+1
    holds ``rot(code[2j])``."""
    c = jnp.asarray(codes).astype(jnp.int32) & 0xF
    if c.shape[-1] % 2:
        raise ValueError(f"codes must have an even last axis (pairs of K), got shape {c.shape}")
    pairs = c.reshape(*c.shape[:-1], -1, 2)
    return signed_int4(_rotate_nibble(pairs[..., ::-1]).reshape(c.shape))


def unpack_e2m1_pairs(data):
    """Inverse of ``pack_e2m1_pairs``: stored int4 ``[..., K]`` → standard E2M1 codes (int32)."""
    nib = jnp.asarray(data).astype(jnp.int32) & 0xF
    pairs = nib.reshape(*nib.shape[:-1], -1, 2)[..., ::-1]
    return (((pairs >> 1) | (pairs << 3)) & 0xF).reshape(nib.shape)


def signed_int4(nibbles):
    """Nibbles 0..15 → the int4 array with those bit patterns."""
    return jnp.where(nibbles >= 8, nibbles - 16, nibbles).astype(jnp.int4)


def decode_e2m1_pairs_jnp(w, dtype):
    """The E2M1 decode's integer formula in XLA ops: stored int4 ``[..., K]`` → values in
    ``dtype``. Interpret mode's path. XLA on CPU flushes subnormals, so the last step,
    ``bits × 2^126`` (``2^14``), reads the placed bits (sign, ``e1 e0 m``) instead."""
    nib = w.astype(jnp.int32) & 0xF
    pairs = nib.reshape(*nib.shape[:-1], -1, 2)
    byte = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint32)
    if jnp.dtype(dtype) == jnp.bfloat16:
        bits, mag_shift = (byte * np.uint32(BF16_PLACE)) & np.uint32(BF16_MASK), 6
    else:
        bits = (((byte * np.uint32(F16_PLACE_MAG)) & np.uint32(F16_MASK_MAG))
                | ((byte * np.uint32(F16_PLACE_SIGN)) & np.uint32(F16_MASK_SIGN)))
        mag_shift = 9
    halves = jnp.stack([bits & 0xFFFF, bits >> 16], axis=-1)
    e, m = (halves >> (mag_shift + 1)) & 3, (halves >> mag_shift) & 1
    # 2^(e-1)·(1 + m/2), or m/2 for e = 0 (no table: a kernel may not capture arrays).
    magnitude = jnp.where(e == 0, m, (1 << e) * (2 + m) // 2).astype(jnp.float32) * 0.5
    values = jnp.where(halves >> 15 == 1, -magnitude, magnitude).astype(dtype)
    return values.reshape(w.shape)


def _e2m1_ops(dtype, unscale: bool, src: str, dst: str) -> list[str]:
    """``src``: a pair's byte, zero-extended; ``dst``: two bf16 / fp16 values, or
    (``unscale=False``) their placed bits, the values times 2^-``UNSCALE_EXP``. Uses t, m, s, u."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        ops = [f"mul.lo.u32 t, {src}, {BF16_PLACE:#x};", f"and.b32 t, t, {BF16_MASK:#x};"]
    else:
        ops = [f"mul.lo.u32 m, {src}, {F16_PLACE_MAG:#x};",
               f"mul.lo.u32 s, {src}, {F16_PLACE_SIGN:#x};", f"and.b32 s, s, {F16_MASK_SIGN:#x};",
               f"lop3.b32 t, m, {F16_MASK_MAG:#x}, s, 0xEA;"]
    if not unscale:
        return ops + [f"mov.b32 {dst}, t;"]
    kind = "bf16x2" if jnp.dtype(dtype) == jnp.bfloat16 else "f16x2"
    factor = _pair_bits(2.0 ** UNSCALE_EXP[jnp.dtype(dtype)], dtype)
    return ops + [f"mov.b32 u, {factor:#x};", f"mul.rn.{kind} {dst}, t, u;"]


def _e2m1_ptx(dtype, unscale: bool = True) -> str:
    """One register's pair: ``$1`` its byte, ``$0`` the two values (``_e2m1_ops``)."""
    return _ptx("t, m, s, u", _e2m1_ops(dtype, unscale, "$1", "$0"))


# ---- 16-entry tables ---------------------------------------------------------------------------
def table_words(values, dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The 16 ``values`` in ``dtype`` as the decode's immediates: their low bytes and high bytes,
    four per 32-bit word (entry 4j + i in byte i of word j)."""
    bits = np.asarray(values, np.float32).astype(jnp.dtype(dtype)).view(np.uint16).astype(np.uint32)
    if bits.shape != (16,):
        raise ValueError(f"a code book has 16 values, got shape {bits.shape}")
    words = lambda b: tuple(int(sum(int(b[4 * j + i]) << (8 * i) for i in range(4)))
                            for j in range(4))
    return words(bits & 0xFF), words(bits >> 8)


_TABLE_REGISTERS = "idx, hsel, pl, nl, ph, nh, l, h"


def _table_lookup_ops(values, dtype, dst0: str, dst1: str) -> list[str]:
    """Four codes, whose low 3 bits are the low 16 bits of ``idx`` and whose byte choices (i
    from the 0-7 lookup, i + 4 from the 8-15 one, by bit 3) are those of ``hsel`` → ``dst0`` /
    ``dst1``: two 16-bit pairs."""
    lo, hi = table_words(values, dtype)
    return [f"prmt.b32 pl, {lo[0]:#x}, {lo[1]:#x}, idx;",
            f"prmt.b32 nl, {lo[2]:#x}, {lo[3]:#x}, idx;",
            "prmt.b32 l, pl, nl, hsel;",
            f"prmt.b32 ph, {hi[0]:#x}, {hi[1]:#x}, idx;",
            f"prmt.b32 nh, {hi[2]:#x}, {hi[3]:#x}, idx;",
            "prmt.b32 h, ph, nh, hsel;",
            f"prmt.b32 {dst0}, l, h, 0x5140;",
            f"prmt.b32 {dst1}, l, h, 0x7362;"]


def _table_ptx(values, dtype) -> str:
    # $2, $3: two registers' bytes (codes c0 c1, c2 c3), zero-extended; w holds c0..c3 in its
    # four nibbles. $0 / $1: (c0, c1) and (c2, c3) as 16-bit pairs.
    ops = ["mad.lo.u32 w, $3, 256, $2;", "and.b32 idx, w, 0x7777;", "shr.u32 hsel, w, 1;",
           "lop3.b32 hsel, hsel, 0x4444, 0x3210, 0xEA;",
           *_table_lookup_ops(values, dtype, "$0", "$1")]
    return _ptx("w, " + _TABLE_REGISTERS, ops)


def decode_table_jnp(w, values, dtype):
    """Interpret mode's table decode: stored int4 codes ``[..., K]`` → ``values[code]`` in
    ``dtype`` (a chain of selects: a kernel may not capture arrays)."""
    nib = w.astype(jnp.int32) & 0xF
    out = jnp.zeros(w.shape, jnp.float32)
    for code, value in enumerate(np.asarray(values, np.float32).astype(jnp.dtype(dtype))):
        out = jnp.where(nib == code, float(value), out)
    return out.astype(dtype)


# ---- word order: a thread's 8 codes of a row in one 32-bit word ---------------------------------
# In wgmma's register layout the 4 threads of a row hold, in each 32-code block, the pairs at
# columns 8q + 2c, 8q + 2c + 1 (thread c, q = 0..3): 4 bytes scattered over 16. Stored in word
# order, thread c's 4 pairs fill bytes 4c..4c+3 of the block, so one 32-bit shared-memory load
# (Mosaic GPU's UPCAST_4X layout) reads them, where wgmma's layout takes 4 byte loads; the
# decode's outputs are then wgmma's registers, with no shuffles. int4 also interleaves the pairs'
# nibbles (pair q's codes at nibbles q and q + 4), so that one shift and one ``lop3`` place both
# codes of a pair in their 16-bit halves.
WORD_CODES = 32


# A block in K order is [pair q, thread c, half] (column 8q + 2c + half); stored, it is
# [thread, half, pair] (int4: pair q's codes at nibbles q and q + 4) or [thread, pair, half].
_STORED_AXES = {"int4": (1, 2, 0), "pairs": (1, 0, 2)}


def _stored_axes(lut: str):
    return _STORED_AXES["int4" if canonical_lut(lut) == "int4" else "pairs"]


def word_order_sources(lut: str) -> np.ndarray:
    """``src[s]``: the position (in K order, within a 32-code block) that stored position ``s``
    holds, for ``lut`` ``"int4"`` (nibble-interleaved pairs) or any pair-coded code book."""
    return np.arange(WORD_CODES).reshape(4, 4, 2).transpose(_stored_axes(lut)).ravel()


def to_word_order(codes, lut: str):
    """Stored codes ``[..., K]`` in K order (K a multiple of 32) → word order."""
    return _permute_blocks(codes, (4, 4, 2), _stored_axes(lut))


def from_word_order(codes, lut: str):
    """Inverse of ``to_word_order``. Reshapes and a transpose, no gather: interpret mode runs it
    inside the kernel, which may not capture index arrays."""
    axes = _stored_axes(lut)
    return _permute_blocks(codes, tuple((4, 4, 2)[a] for a in axes), tuple(np.argsort(axes)))


def _permute_blocks(codes, block_shape, axes):
    codes = jnp.asarray(codes)
    if codes.shape[-1] % WORD_CODES:
        raise ValueError(f"word order permutes blocks of {WORD_CODES} codes; the last axis of "
                         f"shape {tuple(codes.shape)} is not a multiple of {WORD_CODES}")
    lead = codes.ndim   # where the block's own axes start
    blocks = codes.reshape(*codes.shape[:-1], -1, *block_shape)
    perm = (*range(lead), *(lead + a for a in axes))
    return blocks.transpose(perm).reshape(codes.shape)


def _int4_word_ptx(dtype) -> str:
    # 2^7 (bf16) or 2^10 (fp16) + 8 in both halves: a nibble n under that exponent, xor 8, is
    # 2^7 + (n ^ 8) = 2^7 + code; subtracting 2^7 + 8 leaves the stored value code − 8, exactly.
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    ops = [f"mov.b32 m, {_pair_bits(136.0 if bf16 else 1032.0, dtype):#x};"]
    for q in range(4):
        if q:
            ops.append(f"shr.u32 t, $4, {4 * q};")
        ops += [f"lop3.b32 t, {'t' if q else '$4'}, 0x000f000f, m, 0x6a;",   # (a & b) ^ c
                f"sub.rn.{'bf16x2' if bf16 else 'f16x2'} ${q}, t, m;"]
    return _ptx("t, m", ops)


def _e2m1_word_ptx(dtype, unscale: bool = True) -> str:
    # Each byte zero-extended by one prmt (byte q of $4, then zeros), then the pair decode.
    ops = []
    for q in range(4):
        ops += [f"prmt.b32 b, $4, 0, {0x4440 + q:#x};", *_e2m1_ops(dtype, unscale, "b", f"${q}")]
    return _ptx("t, m, s, u, b", ops)


def _table_word_ptx(values, dtype) -> str:
    # prmt reads the low 16 bits of a selector: pairs 0, 1 (bytes 0, 1) from idx and hsel as
    # they are, pairs 2, 3 after a shift by 16.
    ops = ["and.b32 idx, $4, 0x77777777;", "shr.u32 hsel, $4, 1;",
           "lop3.b32 hsel, hsel, 0x44444444, 0x32103210, 0xEA;",
           *_table_lookup_ops(values, dtype, "$0", "$1"),
           "shr.u32 idx, idx, 16;", "shr.u32 hsel, hsel, 16;",
           *_table_lookup_ops(values, dtype, "$2", "$3")]
    return _ptx(_TABLE_REGISTERS, ops)


def word_ptx(lut: str, dtype, unscale: bool = True) -> str:
    """The inline PTX that decodes one word (8 stored codes, ``$4``) into the four 16-bit pairs
    ``$0..$3`` of wgmma's registers: one per 8-column tile of the word's 32-code block
    (``unscale``: see ``_e2m1_ptx``)."""
    if lut == "int4":
        return _int4_word_ptx(dtype)
    if lut == "e2m1":
        return _e2m1_word_ptx(dtype, unscale)
    return _table_word_ptx(lut_values(lut), dtype)


# ---- both, in the kernel ------------------------------------------------------------------------
def _inline_decode(w, dtype, asm: str, regs_per_call: int):
    """Runs ``asm`` on ``w``'s registers (int4 ``[rows, K]`` in wgmma's register layout, two codes
    per register), ``regs_per_call`` zero-extended bytes in and as many 16-bit pairs out."""
    # Imported here: Mosaic GPU and its MLIR bindings are only needed where the kernel is traced
    # (the layout and the interpret-mode twins above are plain XLA).
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, dtype, plgpu.Layout.WGMMA))
    def decode(_, arr):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        out_ty = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype))
        result_ty = (i32 if regs_per_call == 1
                     else llvm.StructType.get_literal([i32] * regs_per_call))
        constraints = ",".join(["=r"] * regs_per_call + ["r"] * regs_per_call)
        indices = [idx for idx, _ in np.ndenumerate(arr.registers)]
        regs = np.empty_like(arr.registers)
        for start in range(0, len(indices), regs_per_call):
            group = indices[start:start + regs_per_call]
            inputs = []
            for idx in group:
                reg = arr.registers[idx]
                if ir.VectorType(reg.type).shape != [2]:
                    raise NotImplementedError(
                        f"the decode expects 2 codes per register, got {reg.type}")
                inputs.append(arith.extui(i32, mgpu_utils.bitcast(reg, i8)))
            inputs += inputs[-1:] * (regs_per_call - len(inputs))   # an odd last group
            out = llvm.inline_asm(result_ty, inputs, asm, constraints)
            for i, idx in enumerate(group):
                word = out if regs_per_call == 1 else llvm.extractvalue(i32, out, [i])
                regs[idx] = mgpu_utils.bitcast(word, out_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=arr.layout, _is_signed=None)

    return decode(w)


def decode_codes(w, dtype, *, lut: str, interpret: bool, unscale: bool = True):
    """The tile's stored 4-bit codes → values in ``dtype`` (bf16 / fp16), inside the kernel:
    ``lut`` ``"int4"`` (``code − 8`` stored as int4: Mosaic GPU's conversion), ``"e2m1"``
    (``pack_e2m1_pairs``) or a table (``lut_values(lut)``, codes as stored: NF4, bnb FP4).
    ``unscale=False`` (E2M1 on the GPU only: interpret mode's XLA flushes subnormals) leaves
    the values times 2^-``UNSCALE_EXP[dtype]``."""
    _check_dtype(w, dtype)
    if lut == "int4":
        return w.astype(dtype)
    if lut == "e2m1":
        if interpret:
            if not unscale:
                raise ValueError("interpret mode decodes E2M1 to its values (unscale=True)")
            return decode_e2m1_pairs_jnp(w, dtype)
        return _inline_decode(w, dtype, _e2m1_ptx(dtype, unscale), 1)
    values = lut_values(lut)
    if interpret:
        return decode_table_jnp(w, values, dtype)
    return _inline_decode(w, dtype, _table_ptx(values, dtype), 2)


def _inline_word_decode(w, dtype, asm: str):
    """Runs ``asm`` (``word_ptx``) on each 32-bit register of ``w`` (int4 ``[rows, K]`` in
    Mosaic GPU's UPCAST_4X layout: a thread's 8 codes of a row and 32-code block) and returns
    ``[rows, K]`` in ``dtype`` in wgmma's layout: the word of column block j gives the registers
    of 8-column tiles 4j..4j+3."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, dtype, plgpu.Layout.WGMMA))
    def decode(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        out_ty = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype))
        result_ty = llvm.StructType.get_literal([i32] * 4)
        regs = np.empty(fa.WGMMA_LAYOUT.registers_shape(tuple(w.shape)), dtype=object)
        for idx, reg in np.ndenumerate(arr.registers):
            if ir.VectorType(reg.type).shape != [8]:
                raise NotImplementedError(f"the word decode expects 8 codes per register, got "
                                          f"{reg.type}")
            out = llvm.inline_asm(result_ty, [mgpu_utils.bitcast(reg, i32)], asm,
                                  "=r,=r,=r,=r,r")
            for q in range(4):
                word = llvm.extractvalue(i32, out, [q])
                regs[(idx[0], 4 * idx[1] + q, *idx[2:])] = mgpu_utils.bitcast(word, out_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode(w)


def decode_words(w, dtype, *, lut: str, interpret: bool, unscale: bool = True):
    """Like ``decode_codes``, for codes stored in word order (``to_word_order``) and loaded in
    the UPCAST_4X layout: values in K order, in wgmma's layout."""
    _check_dtype(w, dtype)
    if interpret:
        return decode_codes(from_word_order(w, lut), dtype, lut=lut, interpret=True,
                            unscale=unscale)
    return _inline_word_decode(w, dtype, word_ptx(lut, dtype, unscale))


def decode_bytes(w, dtype, *, lut: str, interpret: bool):
    """A tile's 8-bit codes (``BYTE_LUTS``, wgmma's register layout) → values in ``dtype`` (bf16
    / fp16), with Mosaic GPU's conversions: int8 by its ``prmt`` decode; e4m3 pairwise by
    ``cvt.f16x2.e4m3x2`` (sm_89+), then to bf16 through fp32 (every e4m3 value is exact in all
    three), since Mosaic GPU converts e4m3 straight to bf16 only from PTX ISA 9.2."""
    _check_dtype(w, dtype)
    if lut == "int8" or interpret or jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        return w.astype(dtype)
    if lut != "e4m3":
        raise ValueError(f"decode_bytes decodes {BYTE_LUTS}, got lut={lut!r}")
    return w.astype(jnp.float16).astype(jnp.float32).astype(dtype)


def _check_dtype(w, dtype):
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"codes decode to bf16 or fp16 (wgmma's 16-bit operand), got dtype "
                        f"{jnp.dtype(dtype)} for codes of shape {tuple(w.shape)}")
