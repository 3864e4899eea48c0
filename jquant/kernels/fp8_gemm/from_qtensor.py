"""The FP8 GEMM as a registry implementation for W8A8 FP8 schemes on Hopper: the e4m3 weight (per
tensor, per channel or 128 × 128 blocks) laid out once by ``prepack_fp8``; ``apply`` quantizes the
activations exactly as the scheme says (``quantize_scheme_activation``: per token or per 1 × 128 group
in one Triton-backend pass, per tensor or static as XLA) and runs ``fp8_gemm``, which picks the kernel
or XLA's FP8 dot on the same layout by M (``dispatch.fp8_gemm_impl``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.kernels.act_quant import quantize_scheme_activation
from jquant.kernels.fp8_gemm.api import fp8_gemm
from jquant.kernels.fp8_gemm.config import BLOCK_K
from jquant.kernels.fp8_gemm.layout import PackedFp8, prepack_fp8
from jquant.qtensor import QTensor
from jquant.schemes import dispatch
from jquant.schemes.scheme import Impl, Scheme, register_impl


def pack_fp8_qtensor(qt: QTensor) -> PackedFp8 | None:
    """``prepack_fp8`` of an e4m3 ``[N, K]`` QTensor (per tensor, per channel along K, or 128 × 128
    blocks), or None for other layouts.

    Examples:
      >>> import numpy as np, jquant
      >>> from jquant.kernels.fp8_gemm.from_qtensor import pack_fp8_qtensor
      >>> w = np.random.default_rng(0).standard_normal((256, 384)).astype(np.float32)
      >>> pack_fp8_qtensor(jquant.get_scheme("fp8_e4m3_block128x128").quantize_weight(w)).scale.shape
      (3, 256)
    """
    if qt.fmt != "fp8_e4m3" or qt.ndim != 2 or isinstance(qt.scale, QTensor) or qt.global_scale is not None:
        return None
    n, k = qt.shape
    block = tuple(qt.block)
    if block == (n, k):
        return prepack_fp8(qt.data, qt.scale.reshape(()))
    if block == (1, k) and qt.k_axis in (1, None):
        return prepack_fp8(qt.data, qt.scale.reshape(n))
    if block == (BLOCK_K, BLOCK_K):
        return prepack_fp8(qt.data, qt.scale)
    return None


def _supports(scheme: Scheme, capability: int, platform: str) -> bool:
    return (platform == "gpu" and dispatch.has_wgmma(capability) and not scheme.weight_only and scheme.weight.format == "fp8_e4m3"
            and scheme.activation.format == "fp8_e4m3")


def _prepare(scheme: Scheme, qweight: QTensor) -> PackedFp8 | None:
    return pack_fp8_qtensor(qweight)


def fp8_scheme_gemm(scheme: Scheme, x: jax.Array, packed: PackedFp8, bias: jax.Array | None = None,
                    input_scale: jax.Array | None = None, *, impl: str = "auto", config=None,
                    interpret: bool = False) -> jax.Array:
    """``x [..., K]`` times the packed weight as the W8A8 FP8 ``scheme`` computes it: x quantized as the
    scheme says, then ``fp8_gemm`` (``impl``, ``config``, ``interpret`` as its)."""
    lead = x.shape[:-1]
    xq = quantize_scheme_activation(scheme, x.reshape(-1, x.shape[-1]), input_scale, interpret=interpret)
    scale = xq.scale if not isinstance(xq.scale, QTensor) else xq.scale.dequantize(jnp.float32)
    # Block FP8: the bias goes onto the rounded output, as XLA's path (and vLLM's block-FP8 linear) does.
    late_bias = bias is not None and scheme.activation.mode == "dynamic_per_token_group"
    y = fp8_gemm(xq.data, scale.astype(jnp.float32), packed, bias=None if late_bias else bias,
                 out_dtype=x.dtype, impl=impl, config=config, interpret=interpret)
    if late_bias:
        y = y + bias.astype(x.dtype)
    return y.reshape(*lead, packed.n)


register_impl(Impl(name="pallas_fp8", supports=_supports, prepare=_prepare, run=fp8_scheme_gemm, priority=10))
