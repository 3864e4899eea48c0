"""The W8A16 kernel as a registry implementation for 8-bit weight-only schemes on Hopper: an 8-bit
``[N, K]`` QTensor (int8, uint8 with zero points, FP8 e4m3 per tensor, channel or block, MXFP8 e4m3)
laid out once by ``prepack_w8``; ``apply`` runs ``w8a16_matmul``, which picks the kernel or XLA by M. W8A8
schemes never run here: their activations are quantized as the scheme says, by their own path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.kernels.w8a16.api import w8a16_matmul
from jquant.kernels.w8a16.layout import PackedW8NK, prepack_w8
from jquant.qtensor import QTensor
from jquant.schemes.dispatch import has_wgmma
from jquant.schemes.scheme import Impl, Scheme, register_impl

W8_FORMATS = ("int8", "uint8", "fp8_e4m3", "mxfp8_e4m3")


def unified_w8(qt: QTensor) -> dict | None:
    """``prepack_w8`` arguments for an 8-bit ``[N, K]`` QTensor quantized along K, or None when it
    has no 8-bit kernel layout (other formats, nested or global scales, blocks across rows other
    than FP8's square blocks)."""
    # Per-tensor scales and square blocks read the same either way: a QTensor without k_axis is
    # taken as [N, K], as w8a16_matmul computes x @ W.T.
    symmetric_blocks = qt.ndim == 2 and (tuple(qt.block) == tuple(qt.shape) or qt.block[0] == qt.block[1] > 1)
    if (qt.fmt not in W8_FORMATS or qt.ndim != 2 or not (qt.k_axis == 1 or symmetric_blocks and qt.k_axis is None)
            or isinstance(qt.scale, QTensor) or qt.global_scale is not None or qt.pack_axis is not None):
        return None
    n, k = qt.shape
    rows, cols = qt.block
    if qt.fmt == "mxfp8_e4m3":   # E8M0 scales per 32 codes along K: groups of 32 (exact in bf16)
        return dict(q=qt.data.T, scale=qt.scale.T, group_size=cols)
    scale = qt.scale.astype(jnp.float32) if qt.scale.dtype == jnp.float64 else qt.scale
    if qt.fmt == "fp8_e4m3":
        codes = qt.data.T
        if (rows, cols) == (n, k):
            return dict(q=codes, global_scale=scale.reshape(()).astype(jnp.float32))
        if rows == 1 and cols == k:
            return dict(q=codes, channel_scale=scale.reshape(n).astype(jnp.float32))
        if rows > 1 and cols == rows:   # square blocks: one scale row per K block, spread over N
            return dict(q=codes, scale=jnp.repeat(scale, rows, axis=0)[:n].T, group_size=cols)
        return None
    if rows != 1:
        return None
    if qt.fmt == "int8":   # stored code − 128 is the signed value
        codes = (qt.data.astype(jnp.int32) - 128).astype(jnp.int8).T
        if cols == k:
            return dict(q=codes, channel_scale=scale.reshape(n).astype(jnp.float32))
        return dict(q=codes, scale=scale.T, group_size=cols)
    args = dict(q=qt.data.T, scale=scale.T, zero=qt.zero.T, group_size=None if cols == k else cols)
    if qt.group_index is not None:
        args["g_idx"] = qt.group_index
    return args


def pack_w8_qtensor(qt: QTensor) -> PackedW8NK:
    """``prepack_w8`` of an 8-bit ``[N, K]`` QTensor (``x @ W.T``), or a ValueError saying why not.

    Examples:
      >>> import numpy as np, jquant
      >>> from jquant.kernels.w8a16 import pack_w8_qtensor
      >>> w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
      >>> packed = pack_w8_qtensor(jquant.quantize(w, "fp8_e4m3", granularity="block", block_size=(128, 128)))
      >>> packed.lut, packed.group_size, packed.scale.shape  # a scale row per 128 rows of K
      ('e4m3', 128, (2, 256))
    """
    args = unified_w8(qt)
    if args is None:
        raise ValueError(f"w8a16_matmul: a {qt.fmt} QTensor with shape {qt.shape}, block {qt.block} and "
                         f"k_axis={qt.k_axis} has no 8-bit kernel layout (int8 / uint8 per channel or in groups "
                         "along K, FP8 e4m3 per tensor, channel or square block, MXFP8 e4m3, [N, K] with "
                         "k_axis=1); use Scheme.apply or jquant.qdot")
    try:
        return prepack_w8(**args)
    except ValueError as err:
        raise ValueError(f"w8a16_matmul: {qt.fmt} QTensor of shape {qt.shape}: {err}") from None


def _supports(scheme: Scheme, capability: int, platform: str) -> bool:
    return (platform == "gpu" and has_wgmma(capability) and scheme.weight_only
            and scheme.weight.format in W8_FORMATS)


def _prepare(scheme: Scheme, qweight: QTensor) -> PackedW8NK | None:
    args = unified_w8(qweight)
    if args is None:
        return None
    try:
        return prepack_w8(**args)
    except ValueError:   # groups the kernel cannot step through: the scheme keeps XLA
        return None


def _run(scheme: Scheme, x: jax.Array, packed: PackedW8NK, bias: jax.Array | None) -> jax.Array:
    return w8a16_matmul(x, packed, bias=bias)


register_impl(Impl(name="pallas_w8a16", supports=_supports, prepare=_prepare, run=_run, priority=10))
