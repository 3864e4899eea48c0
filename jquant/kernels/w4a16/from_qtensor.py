"""The W4A16 Pallas kernels as a registry implementation for 4-bit weight-only schemes on Hopper.

``process_weights_after_loading`` turns the scheme's QTensor (``[N, K]``, groups along K) into the
kernels' unified form (codes ``[K, N]`` 0..15, per-group multipliers, optional zero points, a code
book: int4, E2M1 or a bitsandbytes table) and prepacks it once for the Mosaic GPU kernel
(``prepack_nk``; groups of 16, 32, 64·j or per-channel, else the scheme keeps XLA); ``apply`` then
runs ``w4a16_matmul``, which picks the kernel or XLA by M. Registering and preparing need no GPU
module: Mosaic GPU is imported when the kernel first runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.schemes.dispatch import has_wgmma
from jquant.formats import nvfp4
from jquant.formats.packing import unpack_bits
from jquant.kernels.w4a16.api import w4a16_matmul
from jquant.kernels.w4a16.layout import PackedW4NK, nk_compatible, prepack_nk
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Impl, Scheme, register_impl

_LUT = {"int4": "int4", "uint4": "int4", "mxfp4": "e2m1", "nvfp4": "e2m1", "nf4": "nf4",
        "fp4_bnb": "fp4_bnb"}
W4_FORMATS = tuple(_LUT)   # the QTensor formats the W4A16 kernel decodes


def unified_w4(qt: QTensor) -> dict | None:
    """``prepack_nk`` arguments for a 4-bit ``[N, K]`` QTensor, or None when its blocking does not
    map onto groups along K (e.g. bitsandbytes blocks that straddle rows)."""
    if qt.fmt not in _LUT or qt.ndim != 2:
        return None
    n, k = qt.shape
    if qt.fmt in ("nf4", "fp4_bnb"):
        blocksize = qt.block[0]
        if k % blocksize or isinstance(qt.scale, QTensor) and qt.scale.fmt != "bnb_dynamic8":
            return None
        codes = unpack_bits(qt.data, 4, axis=0, order="high_first")[: n * k].reshape(n, k)
        absmax = qt.scale.dequantize(jnp.float32) if isinstance(qt.scale, QTensor) else qt.scale
        scale, group = absmax.astype(jnp.float32).reshape(n, k // blocksize), blocksize
    else:
        if qt.pack_axis != 1 or qt.block[0] != 1:
            return None
        codes = unpack_bits(qt.data, 4, axis=1)
        group = qt.block[1]
        scale = qt.scale
    args = dict(q=codes.T, scale=scale.T, lut=_LUT[qt.fmt], group_size=None if group == k else group)
    if qt.fmt == "nvfp4" and qt.global_scale is not None:
        # e4m3 block scales stay exact; the per-tensor factor is applied once, in fp32.
        args["global_scale"] = nvfp4.global_multiplier(qt)
    if qt.zero is not None:
        args["zero"] = qt.zero.T.astype(jnp.float32)
    if qt.group_index is not None:
        args["g_idx"] = qt.group_index
    return args


def _supports(scheme: Scheme, capability: int, platform: str) -> bool:
    return platform == "gpu" and has_wgmma(capability) and scheme.weight_only and scheme.weight.format in _LUT


def prepack_for_kernels(args: dict) -> PackedW4NK | None:
    """The Mosaic GPU kernel's layout for a unified 4-bit weight (``unified_w4``'s dict), or None
    when its groups do not fit the kernel's steps."""
    k = args["q"].shape[0]
    if nk_compatible(args["group_size"], k, args["lut"]):
        return prepack_nk(**args)
    return None


def _prepare(scheme: Scheme, qweight: QTensor) -> PackedW4NK | None:
    args = unified_w4(qweight)
    return None if args is None else prepack_for_kernels(args)


def _run(scheme: Scheme, x: jax.Array, packed: PackedW4NK, bias: jax.Array | None) -> jax.Array:
    return w4a16_matmul(x, packed, bias=bias)


register_impl(Impl(name="pallas_w4a16", supports=_supports, prepare=_prepare, run=_run, priority=10))
