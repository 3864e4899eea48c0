"""W4A16 kernel bodies that apply the scales once per group, in fp32, instead of once per code.

Same refs, layout and launch as the base kernels (``w4a16_triton``); selected by
``TuningConfig.variant``. What changes is the work per 4-bit code, which bounds the base kernels
(bench/NOTES.md): inside a group the scale is one number per column, so

    sum_k x_k (q_kn - z_gn) s_gn  =  s_gn · sum_k x_k (q_kn - z_gn)

and the inner sum needs no scale. Counted in sm_90 SASS (tools/sass_w4a16.py), per code:

* ``gemv/grouped`` (6.1 → 4.4 instructions): int4 codes decoded in place (the word OR-ed with the
  bits of 1.0 once, then one 3-input AND per code gives ``1 + q·2^(p-23)``; minus
  ``1 + z·2^(p-23)`` leaves exactly ``(q - z)·2^(p-23)``), the ``2^(23-p)`` folded into the
  activation (one multiply per activation, not per code), one fp32 ``[P, BN]`` partial per group.
  Scale rows are loaded as ``[P, BN]`` (stride-0 rows), in the words' register layout: the base
  kernel's 1-D scale vectors cost a shared-memory conversion and ~10 barriers per K tile.
* ``gemv/grouped_prefetch``: the same, with the next tile's words and scale rows loaded one loop
  step ahead into registers. Triton pipelines (``cp.async``) only loads that feed a dot, so each
  step of the base gemv waits for its own load; this hides that latency behind the previous tile.
* ``mma/grouped`` (6.9 → 3.8 at BM = 16; 16.5 → 8.3 and no spills at BM = 128): one ``jnp.dot``
  per run of up to 4 nibble planes (a 3-D decode reshaped to ``[n·P, BN]``) instead of one per
  plane, on the exact integers ``q - z`` in ``x``'s dtype (one FMA per code: ``f·2^(23-p)`` is
  ``2^(23-p) + q`` exactly). Pallas gives every dot a zero accumulator and Triton does not fold the
  following add, so each dot costs an fp32 pass over ``[BM, BN]``: fewer, longer dots cut those.

Zero points given as a tensor (possibly fractional) are subtracted per group,
``s·(sum x q - z·sum x)``; a constant integer zero point is folded into the decode instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jquant.pallas_kernels.w4a16_triton import (_decode_plane, epilogue, kernel_refs,
                                                register_kernel_body)

ONE_BITS = 0x3F800000          # fp32 1.0


def _zero_fold(lut: str, has_zero: bool, zero_point: float) -> tuple[float, bool]:
    """(zero folded into the int4 decode, whether a per-group zero correction is needed)."""
    if lut != "int4":
        return 0.0, False
    if not has_zero and float(zero_point).is_integer() and 0 <= zero_point < 16:
        return float(zero_point), False       # 1 + z·2^(p-23) is exact: fold it
    return 0.0, has_zero or zero_point != 0


def _group_blocks(plane: int, group: int, max_planes: int = 8) -> list[tuple[int, int]]:
    """(first plane, planes) of each run of nibble planes that share one group, at most
    ``max_planes`` long and never crossing plane 4 when ``max_planes`` ≤ 4 (planes 0-3 come from
    the low half-word, 4-7 from the high one)."""
    n = min(max_planes, max(1, group // plane), 8)
    return [(first, n) for first in range(0, 8, n)]


def _runtime_one_bits():
    """The bits of fp32 1.0 as a runtime value: ``n / n`` for the program's N index ``n`` ≥ 1.

    With a literal, ptxas folds the OR of ``_int4_source`` into each code's AND and then
    re-materializes the constant with a ``MOV`` per code (0.4-0.5 extra instructions per code in
    the SASS); a value it cannot fold stays in one register. Call it outside loops (interpret mode
    has no ``program_id`` inside them)."""
    n = (pl.program_id(1) + 1).astype(jnp.float32)
    return jax.lax.bitcast_convert_type(n / n, jnp.uint32)


def _int4_source(u, one):
    """Words with the bits of 1.0 (``one``) OR-ed in, for nibbles 0-3 and (after a shift) 4-7:
    then one 3-input ``LOP3`` per code yields ``1 + q·2^(p-23)``."""
    return u | one, (u >> np.uint32(16)) | one


def _int4_in_place(src, nibble: int, zero: float):
    """Nibble ``nibble % 4`` of ``src`` as exact fp32 ``(q - zero)·2^(p-23)``, and ``2^(23-p)``."""
    p = 4 * (nibble % 4)
    f = jax.lax.bitcast_convert_type(src & np.uint32((0xF << p) | ONE_BITS), jnp.float32)
    return f - np.float32(1.0 + zero * 2.0 ** (p - 23)), float(2 ** (23 - p))


# ---- gemv ----------------------------------------------------------------------------------------
def _gemv_grouped_kernel(*refs, lut, zero_point, has_zero, has_gs, has_bias, rows, group, tiles,
                         plane, prefetch, interpret):
    r = kernel_refs(refs, has_zero, has_gs, has_bias)
    bk = 8 * plane
    bn = r.w.shape[-1]
    pk = pl.program_id(2)
    blocks = _group_blocks(plane, group)
    zero, correct = _zero_fold(lut, has_zero, zero_point)
    one = _runtime_one_bits()

    def tile_operands(kt):
        """Everything one K tile reads from memory besides x: words and one scale row per group."""
        g0 = (kt * bk) // group

        def rows_of(ref):
            # Stride 0 repeats one group row P times: a [P, BN] load gets the words' register
            # layout, where a [1, BN] row gets its own and costs a shared-memory conversion (and
            # barriers) per group. Interpret mode cannot slice with stride 0: it broadcasts.
            if interpret:
                return tuple(jnp.broadcast_to(ref[pl.ds(g0 + b, 1), :], (plane, bn))
                             for b in range(len(blocks)))
            return tuple(ref[pl.ds(g0 + b, plane, stride=0), :] for b in range(len(blocks)))

        return (jax.lax.bitcast_convert_type(r.w[kt], jnp.uint32), rows_of(r.s),
                rows_of(r.z) if has_zero else ())

    def accumulate(kt, operands, acc):
        u, s_rows, z_rows = operands
        src = _int4_source(u, one) if lut == "int4" else None
        acc = list(acc)
        for b, (first, n) in enumerate(blocks):
            part, xsum = [None] * rows, [None] * rows
            for i in range(first, first + n):
                if lut == "int4":
                    v, unit = _int4_in_place(src[i // 4], i, zero)
                else:
                    v, unit = _decode_plane(u, None, i, lut)
                for m in range(rows):
                    xm = r.x[m, pl.ds(kt * bk + i * plane, plane)].astype(jnp.float32)
                    if correct:
                        xsum[m] = xm if xsum[m] is None else xsum[m] + xm
                    term = (xm * np.float32(unit) if unit != 1.0 else xm)[:, None] * v
                    part[m] = term if part[m] is None else part[m] + term
            s = s_rows[b].astype(jnp.float32)                                   # [P, BN]
            zs = None
            if correct:
                zs = (z_rows[b].astype(jnp.float32) if has_zero else np.float32(zero_point)) * s
            for m in range(rows):
                acc[m] = acc[m] + part[m] * s
                if zs is not None:
                    acc[m] = acc[m] - xsum[m][:, None] * zs
        return tuple(acc)

    init = tuple(jnp.zeros((plane, bn), jnp.float32) for _ in range(rows))
    if prefetch:
        def step(t, carry):
            acc, current = carry
            # Clamped: the last step re-reads its own tile (an L1 hit) instead of a neighbour's.
            upcoming = tile_operands(pk * tiles + jnp.minimum(t + 1, tiles - 1))
            return accumulate(pk * tiles + t, current, acc), upcoming
        acc, _ = jax.lax.fori_loop(0, tiles, step, (init, tile_operands(pk * tiles)))
    else:
        def step(t, acc):
            kt = pk * tiles + t
            return accumulate(kt, tile_operands(kt), acc)
        acc = jax.lax.fori_loop(0, tiles, step, init)
    for m in range(rows):
        r.o[m, :] = epilogue(jnp.sum(acc[m], axis=0), r, r.o.dtype)


# ---- mma -----------------------------------------------------------------------------------------
def _plane_iota(first: int, n: int):
    return jax.lax.broadcasted_iota(jnp.uint32, (n, 1, 1), 0) + np.uint32(first)


def _decode_block(u, src, first: int, n: int, lut: str, zero: float, dtype):
    """Planes ``first .. first+n`` (all below or all from 4) as ``[n·P, BN]`` in ``dtype``: int4 as
    the exact integer ``q - zero``, other code books as their value."""
    planes = _plane_iota(first, n)
    if lut == "int4":
        p = np.uint32(4) * (planes % np.uint32(4))
        words = src[first // 4][None] & ((np.uint32(0xF) << p) | np.uint32(ONE_BITS))
        # f·2^(23-p) = 2^(23-p) + q exactly, so one FMA leaves q - zero exactly.
        unit = jax.lax.bitcast_convert_type((np.uint32(150) - p) << np.uint32(23), jnp.float32)
        w = jax.lax.bitcast_convert_type(words, jnp.float32) * unit - (unit + np.float32(zero))
    else:
        w, _ = _decode_plane(u[None] >> (np.uint32(4) * planes), None, 0, lut)
    return w.reshape(n * u.shape[0], u.shape[1]).astype(dtype)


def _mma_grouped_kernel(*refs, lut, zero_point, has_zero, has_gs, has_bias, rows, group, tiles,
                        plane):
    r = kernel_refs(refs, has_zero, has_gs, has_bias)
    bk = 8 * plane
    bn = r.w.shape[-1]
    pk = pl.program_id(2)
    zero, correct = _zero_fold(lut, has_zero, zero_point)
    blocks = [b for b in _group_blocks(plane, group, max_planes=4) if b[0] < 4]
    one = _runtime_one_bits()

    def body(t, acc):
        kt = pk * tiles + t
        u = jax.lax.bitcast_convert_type(r.w[kt], jnp.uint32)                    # [P, BN]
        src = _int4_source(u, one) if lut == "int4" else None
        per_group: dict[int, list] = {}
        for first, n in [(f, n) for f0, n in blocks for f in (f0, f0 + 4)]:
            w = _decode_block(u, src, first, n, lut, zero, r.x.dtype)
            xt = r.x[:, pl.ds(kt * bk + first * plane, n * plane)]
            d = jnp.dot(xt, w, preferred_element_type=jnp.float32)
            xsum = jnp.sum(xt.astype(jnp.float32), axis=1, keepdims=True) if correct else None
            per_group.setdefault((first * plane) // group, []).append((d, xsum))
        for g, parts in per_group.items():
            d, xsum = parts[0]
            for d_more, xsum_more in parts[1:]:
                d = d + d_more
                xsum = xsum + xsum_more if correct else None
            row = pl.ds((kt * bk) // group + g, 1)
            s = r.s[row, :].astype(jnp.float32)                                  # [1, BN]
            acc = acc + d * s
            if correct:
                z = r.z[row, :].astype(jnp.float32) if has_zero else np.float32(zero_point)
                acc = acc - xsum * (z * s)
        return acc

    acc = jax.lax.fori_loop(0, tiles, body, jnp.zeros((rows, bn), jnp.float32))
    r.o[...] = epilogue(acc, r, r.o.dtype)


register_kernel_body("gemv", "grouped", functools.partial(_gemv_grouped_kernel, prefetch=False),
                     wants_interpret=True)
register_kernel_body("gemv", "grouped_prefetch",
                     functools.partial(_gemv_grouped_kernel, prefetch=True), wants_interpret=True)
register_kernel_body("mma", "grouped", _mma_grouped_kernel)
