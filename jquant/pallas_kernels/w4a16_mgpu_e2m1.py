"""E2M1 (FP4) codes in the Mosaic GPU W4A16 kernel: a byte layout that decodes in three
instructions per pair of codes.

Hopper has no FP4 conversion, so the kernel builds each pair's two 16-bit floats with integer
ops. A pair of codes (wgmma's two adjacent K positions, one byte in shared memory) is stored as
``rot(code_k) << 4 | rot(code_k+1)``, where ``rot`` rotates the E2M1 nibble ``s e1 e0 m`` left
by one bit to ``e1 e0 m s``. One 32-bit multiply by ``2^1 + 2^11 + 2^21 + 2^31`` then places
four shifted copies of the byte without overlap (no carries), and a mask keeps, in each bf16
half, the sign at bit 15 and ``e1 e0 m`` at bits 8..6: the bf16 number ``E2M1 · 2^-126``, exact
for every code (subnormal for 0 and ½, like E2M1's own). One ``mul.bf16x2`` by ``2^126`` gives
the value. fp16 puts ``e1 e0 m`` at bits 11..9 (``E2M1 · 2^-14``) with two multiplies and masks.
The constants were found by search over byte layouts; ``tests/test_w4a16_mgpu_e2m1.py`` checks
all 256 bytes against ml_dtypes' float4_e2m1fn.

On the GPU the decode is inline PTX (``plgpu.inline_mgpu``); interpret mode cannot run that and
uses ``decode_e2m1_pairs_jnp``, the same integer formula in XLA ops.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

# bf16: one multiply places sign and magnitude of both codes; the mask keeps them.
BF16_PLACE, BF16_MASK, BF16_UNSCALE = 0x80200802, 0x81C081C0, 2.0 ** 126
# fp16: magnitudes and signs need different shifts.
F16_PLACE_MAG, F16_MASK_MAG = 0x01000010, 0x0E000E00
F16_PLACE_SIGN, F16_MASK_SIGN = 0x80000800, 0x80008000
F16_UNSCALE = 2.0 ** 14


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
    stored = _rotate_nibble(pairs[..., ::-1]).reshape(c.shape)
    return jnp.where(stored >= 8, stored - 16, stored).astype(jnp.int4)


def unpack_e2m1_pairs(data):
    """Inverse of ``pack_e2m1_pairs``: stored int4 ``[..., K]`` → standard E2M1 codes (int32)."""
    nib = jnp.asarray(data).astype(jnp.int32) & 0xF
    pairs = nib.reshape(*nib.shape[:-1], -1, 2)[..., ::-1]
    return (((pairs >> 1) | (pairs << 3)) & 0xF).reshape(nib.shape)


def decode_e2m1_pairs_jnp(w, dtype):
    """The GPU decode's integer formula in XLA ops: stored int4 ``[..., K]`` → E2M1 values in
    ``dtype`` (bf16 or fp16). Interpret mode's path. XLA on CPU flushes subnormals, so the last
    step, ``bits × 2^126`` (``2^14``), reads the placed bits (sign, ``e1 e0 m``) instead."""
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


_PTX = {
    # $1: the pair's byte, zero-extended; $0: two bf16 / fp16 values.
    jnp.dtype(jnp.bfloat16): f"""{{
    .reg .b32 t, u;
    mul.lo.u32 t, $1, {BF16_PLACE:#x};
    and.b32 t, t, {BF16_MASK:#x};
    mov.b32 u, 0x7E807E80;
    mul.rn.bf16x2 $0, t, u;
    }}""",
    jnp.dtype(jnp.float16): f"""{{
    .reg .b32 m, s, u;
    mul.lo.u32 m, $1, {F16_PLACE_MAG:#x};
    mul.lo.u32 s, $1, {F16_PLACE_SIGN:#x};
    and.b32 s, s, {F16_MASK_SIGN:#x};
    lop3.b32 m, m, {F16_MASK_MAG:#x}, s, 0xEA;
    mov.b32 u, 0x74007400;
    mul.rn.f16x2 $0, m, u;
    }}""",
}


def decode_e2m1_pairs_mgpu(w, dtype):
    """The GPU decode: ``w`` int4 ``[rows, K]`` in wgmma's register layout (each register two
    adjacent K positions, one byte) → ``dtype`` values in the same layout, three instructions
    per register (``_PTX``)."""
    # Imported here: the MLIR bindings are only needed where the kernel is lowered.
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    asm = _PTX[jnp.dtype(dtype)]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, dtype, plgpu.Layout.WGMMA))
    def decode(_, arr):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        out_ty = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype))
        regs = np.empty_like(arr.registers)
        for idx, reg in np.ndenumerate(arr.registers):
            if ir.VectorType(reg.type).shape != [2]:
                raise NotImplementedError(f"E2M1 decode expects 2 codes per register, got {reg.type}")
            byte = arith.extui(i32, mgpu_utils.bitcast(reg, i8))
            pair = llvm.inline_asm(i32, [byte], asm, "=r,r")
            regs[idx] = mgpu_utils.bitcast(pair, out_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=arr.layout, _is_signed=None)

    return decode(w)


def decode_e2m1_pairs(w, dtype, *, interpret: bool):
    """Stored E2M1 pairs (``pack_e2m1_pairs``) → values in ``dtype``, inside the kernel."""
    return decode_e2m1_pairs_jnp(w, dtype) if interpret else decode_e2m1_pairs_mgpu(w, dtype)
