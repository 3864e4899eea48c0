"""Fused dequant-GEMM kernels for 4-bit weights (Triton backend of Pallas) and their pure-JAX twin.

One kernel body, two compute modes, over the tile-major layout of ``w4a16_layout``:

* ``"gemv"`` (decode, M ≤ a few rows): no tensor cores. Each program streams its contiguous run of
  weight tiles, decodes nibbles with shifts/masks into fp32, multiplies by ``x`` and accumulates a
  2-D ``[P, BN]`` fp32 tile per row of ``x``; one reduction over rows at the very end.
* ``"mma"`` (prefill): the decoded plane is cast to ``x``'s dtype and fed to ``jnp.dot`` (tensor
  cores), ``[BM, P] @ [P, BN]`` per nibble plane, fp32 accumulation.

Both use a grid ``(M tiles, N tiles, split-K)``; with split-K > 1 each program writes an fp32 partial
sum and the partials are added afterwards in fp32 (one small fused XLA reduction).

Decoding (no tables on the GPU):
* int4: a nibble left where it is, OR-ed with the bits of 1.0 (``0x3F800000``), is the float
  ``1 + q·2^(p-23)`` (p = its bit position); minus 1 (exact) and times ``s·2^(23-p)`` it is ``q·s``,
  then ``- z·s``. One AND/OR per code (nibbles 4-7 after one shift per word): integer ops run at
  half the fp32 rate on Hopper and were this kernel's bottleneck (an H200 probe: the former
  shift + mask decode doubled the time of the multiply-accumulate alone).
* e2m1: the 3 magnitude bits go to bits 22..24 of an fp32 with exponent bias 124, giving
  ``f = 2^(e-3)·(1 + m/2)``; then ``|value| = min(4f, 8f - 1)`` (the second branch is E2M1's
  subnormal e = 0: 0 and 0.5), and the code's sign bit is OR-ed into bit 31. No subnormal floats
  are formed: XLA (CPU at least) flushes them to zero.
* nf4: a 4-level select tree over the code's bits (15 selects).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jquant.pallas_kernels.w4a16_layout import PackedW4, dequantize_packed, lut_values

MODES = ("gemv", "mma")
GEMV_MAX_ROWS = 8          # the gemv kernel keeps one [P, BN] accumulator per row of x
# Kernel bodies per mode (w4a16_grouped.py describes the non-base ones). Every body takes the same
# refs and keyword arguments, so one pallas_call wrapper serves them all.
VARIANTS = {"gemv": ("base", "grouped", "grouped_prefetch"),
            "mma": ("base", "grouped")}
ALL_VARIANTS = tuple(dict.fromkeys(v for vs in VARIANTS.values() for v in vs))
_KERNEL_BODIES: dict = {}


def register_kernel_body(mode: str, variant: str, body, wants_interpret: bool = False) -> None:
    """Makes ``body`` the kernel ``w4a16_pallas`` runs for ``(mode, variant)``. A body that
    ``wants_interpret`` gets ``interpret=`` too (for what interpret mode cannot run, e.g. stride-0
    loads)."""
    if variant not in VARIANTS.get(mode, ()):
        raise ValueError(f"unknown kernel variant {mode!r}/{variant!r}")
    _KERNEL_BODIES[(mode, variant)] = (body, wants_interpret)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile and launch settings. ``block_n``/``block_k`` are baked into the packed layout at
    ``prepack``; the rest are chosen per call. ``split_k`` is lowered to the largest divisor of the
    number of K tiles (so every program gets the same static trip count, which Triton pipelines).
    ``variant`` names the kernel body (``VARIANTS[mode]``); ``"base"`` is the one measured first."""

    block_n: int = 64
    block_k: int = 512
    split_k: int = 16
    num_warps: int = 4
    num_stages: int = 2
    block_m: int = 16
    variant: str = "base"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "variant":
                if v not in ALL_VARIANTS:
                    raise ValueError(f"TuningConfig.variant must be one of {ALL_VARIANTS}, got {v!r}")
            elif not isinstance(v, int) or v < 1:
                raise ValueError(f"TuningConfig.{f.name} must be a positive int, got {v!r}")


def effective_split(k_tiles: int, split_k: int) -> int:
    return max(d for d in range(1, min(split_k, k_tiles) + 1) if k_tiles % d == 0)


# ---- decoding one nibble plane of a [P, BN] uint32 word tile -------------------------------------
def _shift(u, s: int):
    return u << np.uint32(s) if s >= 0 else u >> np.uint32(-s)


def _decode_plane(u, u_hi, i: int, lut: str):
    """Nibble ``i`` of every word as fp32 ``(values, unit)``: the code-book value is ``values·unit``.

    int4 returns ``q·2^(p-23)`` (and unit ``2^(23-p)``) with ``p`` the nibble's bit position in ``u``
    (nibbles 0-3) or ``u_hi = u >> 16`` (nibbles 4-7): one AND/OR per code and no shift, because the
    integer pipe (half the fp32 rate) is what bounds this kernel.
    """
    if lut == "int4":
        src, p = (u, 4 * i) if i < 4 else (u_hi, 4 * (i - 4))
        f = jax.lax.bitcast_convert_type((src & np.uint32(0xF << p)) | np.uint32(0x3F800000),
                                         jnp.float32)
        return f - np.float32(1.0), float(2 ** (23 - p))   # f - 1 is exact (Sterbenz)
    if lut == "e2m1":
        # f = 2^(e-3)·(1 + m/2) from exponent field 124 + e; |value| = min(4f, 8f - 1) covers e = 0.
        f = jax.lax.bitcast_convert_type(
            (_shift(u, 22 - 4 * i) & np.uint32(0x01C00000)) | np.uint32(0x3E000000), jnp.float32)
        magnitude = jnp.minimum(f * np.float32(4.0), f * np.float32(8.0) - np.float32(1.0))
        sign = _shift(u, 28 - 4 * i) & np.uint32(0x80000000)
        return jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(magnitude, jnp.uint32) | sign, jnp.float32), 1.0
    code = _shift(u, -4 * i)
    level = [float(v) for v in lut_values(lut)]
    for bit in range(4):   # pairs (2j, 2j+1) differ in bit 0, then pairs of pairs in bit 1, ...
        on = (code & np.uint32(1 << bit)) != 0
        level = [jnp.where(on, np.float32(hi), np.float32(lo)) if bit == 0 else jnp.where(on, hi, lo)
                 for lo, hi in zip(level[0::2], level[1::2])]
    return level[0], 1.0


def _group_affine(s_ref, z_ref, g, lut: str, zero_point: float):
    """Row vectors (s, c) with w = value·s + c for group row ``g`` (c is None without zeros)."""
    s = s_ref[g, :].astype(jnp.float32)
    if lut != "int4":
        return s, None
    z = z_ref[g, :].astype(jnp.float32) if z_ref is not None else np.float32(zero_point)
    return s, -(z * s)


# ---- the kernel ------------------------------------------------------------------------------------
class KernelRefs(NamedTuple):
    """The refs every kernel body gets, by name (absent optional inputs are None)."""

    x: Any
    w: Any
    s: Any
    z: Any
    gs: Any
    bias: Any
    o: Any


def kernel_refs(refs, has_zero: bool, has_gs: bool, has_bias: bool) -> KernelRefs:
    x_ref, w_ref, s_ref, *rest = refs
    z_ref = rest.pop(0) if has_zero else None
    gs_ref = rest.pop(0) if has_gs else None
    b_ref = rest.pop(0) if has_bias else None
    # rest[-1] is the output; a poisoned buffer aliased to it may sit just before it.
    return KernelRefs(x_ref, w_ref, s_ref, z_ref, gs_ref, b_ref, rest[-1])


def epilogue(v, r: KernelRefs, dtype):
    """fp32 row(s) ``v`` ([BN] or [BM, BN]) times the global scale, plus the bias, as ``dtype``."""
    if r.gs is not None:
        v = v * r.gs[0]
    if r.bias is not None:
        bias = r.bias[0, :]
        v = v + (bias if v.ndim == 1 else bias[None, :])
    return v.astype(dtype)


def _w4a16_kernel(*refs, mode, lut, zero_point, has_zero, has_gs, has_bias, rows, group, tiles,
                  plane):
    r = kernel_refs(refs, has_zero, has_gs, has_bias)
    x_ref, w_ref, s_ref, z_ref = r.x, r.w, r.s, r.z
    bk = 8 * plane
    n_rows_per_tile = max(1, bk // group)
    bn = w_ref.shape[-1]
    pk = pl.program_id(2)

    def body(t, acc):
        kt = pk * tiles + t
        u = jax.lax.bitcast_convert_type(w_ref[kt], jnp.uint32)            # [P, BN]
        u_hi = u >> np.uint32(16)
        g0 = (kt * bk) // group
        affine = [_group_affine(s_ref, z_ref, g0 + j, lut, zero_point) for j in range(n_rows_per_tile)]
        for i in range(8):
            s, c = affine[(i * plane) // group]
            v, unit = _decode_plane(u, u_hi, i, lut)
            w = v * (s * np.float32(unit))[None, :] if unit != 1.0 else v * s[None, :]
            if c is not None:
                w = w + c[None, :]
            k0 = kt * bk + i * plane
            if mode == "gemv":
                acc = tuple(acc[m] + x_ref[m, pl.ds(k0, plane)].astype(jnp.float32)[:, None] * w
                            for m in range(rows))
            else:
                xt = x_ref[:, pl.ds(k0, plane)]
                acc = acc + jnp.dot(xt, w.astype(xt.dtype), preferred_element_type=jnp.float32)
        return acc

    if mode == "gemv":
        init = tuple(jnp.zeros((plane, bn), jnp.float32) for _ in range(rows))
    else:
        init = jnp.zeros((rows, bn), jnp.float32)
    acc = jax.lax.fori_loop(0, tiles, body, init)

    if mode == "gemv":
        for m in range(rows):
            r.o[m, :] = epilogue(jnp.sum(acc[m], axis=0), r, r.o.dtype)
    else:
        r.o[...] = epilogue(acc, r, r.o.dtype)


register_kernel_body("gemv", "base", functools.partial(_w4a16_kernel, mode="gemv"))
register_kernel_body("mma", "base", functools.partial(_w4a16_kernel, mode="mma"))


def w4a16_pallas(x, packed: PackedW4, bias=None, *, mode: str, config: TuningConfig,
                 interpret: bool = False, poison: bool = False):
    """Runs one kernel on a padded ``x`` ``[M_pad, K_pad]`` (stored row order); ``bias`` is None or
    fp32 ``[N_pad]``. Returns ``[M_pad, N_pad]`` in ``x``'s dtype.

    ``M_pad`` must be the row block: ``rows`` for gemv (≤ ``GEMV_MAX_ROWS``, a power of two), a
    multiple of ``config.block_m`` for mma. ``poison`` fills the output with NaN before the kernel
    (through an aliased input), so a tile the kernel failed to write shows up.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if config.variant not in VARIANTS[mode]:
        raise ValueError(f"variant {config.variant!r} is not a {mode} kernel; choose from "
                         f"{VARIANTS[mode]}")
    m_pad, k_pad = x.shape
    if k_pad != packed.k_pad:
        raise ValueError(f"x has {k_pad} columns; the packed weight expects K_pad={packed.k_pad}")
    nt, kt, plane, bn = packed.data.shape
    n_pad = nt * bn
    bm = m_pad if mode == "gemv" else config.block_m
    if mode == "gemv" and (bm > GEMV_MAX_ROWS or bm & (bm - 1)):
        raise ValueError(f"gemv takes a power-of-two number of rows ≤ {GEMV_MAX_ROWS}, got {bm}")
    if mode == "mma" and (bm < 16 or m_pad % bm or plane < 16):
        raise ValueError(f"mma needs block_m ≥ 16 dividing M_pad={m_pad} and block_k ≥ 128; got "
                         f"block_m={bm}, block_k={packed.block_k}")
    split = effective_split(kt, config.split_k)
    partial = split > 1
    out_dtype = jnp.float32 if partial else x.dtype
    grid = (m_pad // bm, nt, split)

    operands = [x, packed.data, packed.scale]
    in_specs = [pl.BlockSpec((bm, k_pad), lambda i, j, s: (i, 0)),
                pl.BlockSpec((None, kt, plane, bn), lambda i, j, s: (j, 0, 0, 0)),
                pl.BlockSpec((None, packed.scale.shape[1], bn), lambda i, j, s: (j, 0, 0))]
    if packed.zero is not None:
        operands.append(packed.zero)
        in_specs.append(pl.BlockSpec((None, packed.zero.shape[1], bn), lambda i, j, s: (j, 0, 0)))
    if packed.global_scale is not None:
        operands.append(packed.global_scale)
        in_specs.append(pl.BlockSpec((1,), lambda i, j, s: (0,)))
    has_bias = bias is not None and not partial
    if has_bias:
        operands.append(bias.reshape(1, n_pad))
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))
    if partial:
        out_shape = jax.ShapeDtypeStruct((split, m_pad, n_pad), out_dtype)
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    aliases = {}
    if poison:
        aliases = {len(operands): 0}
        operands.append(jnp.full(out_shape.shape, jnp.nan, out_dtype))
        in_specs.append(out_spec)

    body, wants_interpret = _KERNEL_BODIES[(mode, config.variant)]
    kernel = functools.partial(
        body, lut=packed.lut, zero_point=packed.zero_point,
        has_zero=packed.zero is not None, has_gs=packed.global_scale is not None, has_bias=has_bias,
        rows=bm, group=packed.group_size, tiles=kt // split, plane=plane,
        **({"interpret": interpret} if wants_interpret else {}))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
        input_output_aliases=aliases, interpret=interpret,
        name=f"w4a16_{mode}_{config.variant}_{packed.lut}",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
    )(*operands)
    if not partial:
        return out
    out = jnp.sum(out, axis=0)
    if bias is not None:
        out = out + bias[None, :]
    return out.astype(x.dtype)


def reference(x, packed: PackedW4, bias=None):
    """The pure-JAX twin of the kernels: dequantize in fp32, gather ``x`` by ``perm``, fp32 dot.

    ``x`` is ``[..., K]``; returns ``[..., N]`` in ``x``'s dtype.
    """
    if x.shape[-1] != packed.k:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last axis must be K={packed.k}")
    w = dequantize_packed(packed)[:, :packed.n]
    xs = x.astype(jnp.float32)
    if packed.perm is not None:
        xs = jnp.take(xs, packed.perm, axis=-1)
    xs = jnp.pad(xs, [(0, 0)] * (x.ndim - 1) + [(0, packed.k_pad - packed.k)])
    out = jnp.matmul(xs, w, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        out = out + jnp.asarray(bias, jnp.float32)
    return out.astype(x.dtype)
