"""The XLA implementation of ``Scheme.apply``: runs everywhere, and is the twin kernels are checked against.

Weight-only schemes dequantize and dot (XLA materialises the float weight: correct, not fast). W8A8 INT8
schemes multiply the int8 codes with int32 accumulation everywhere; bitsandbytes' LLM.int8() schemes run
its mixed int8 / bfloat16 matmul (``formats.bnb_int8``). W8A8 FP8 schemes use XLA's native FP8 dot with
per-row/per-column scales on a GPU (``dispatch.native_fp8_dot``; it lowers to cuBLASLt's f8 GEMM), and
dequantize both operands elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.formats import bnb_int8
from jquant.formats import fp8 as fp8_format
from jquant.formats import int8_activations
from jquant.qtensor import QTensor
from jquant.schemes import dispatch
from jquant.schemes.scheme import Impl, Scheme, register_impl

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")


def quantize_activation(scheme: Scheme, x: jax.Array, input_scale: jax.Array | None = None) -> QTensor:
    """Quantizes activations ``x [..., K]`` the way ``scheme.activation`` says (static schemes: with
    ``input_scale``, else the spec's ``input_scale``)."""
    spec = scheme.activation
    fmt = spec.format
    if fmt == "int8":
        if spec.mode == "dynamic_per_token":
            return int8_activations.quantize_int8_per_token(x)
        scale = spec.input_scale if input_scale is None else input_scale
        if scale is None:
            raise ValueError(f"scheme {scheme.name!r} has static activations but no input_scale")
        return int8_activations.quantize_int8_static(x, scale)
    if spec.mode == "dynamic_per_token":
        return fp8_format.quantize_fp8_per_token(x, fmt=fmt)
    if spec.mode == "dynamic_per_token_group":
        return fp8_format.quantize_fp8_per_token_group(x, group_size=spec.group_size, ue8m0=spec.ue8m0, fmt=fmt)
    if spec.mode == "dynamic_per_tensor":
        return fp8_format.quantize_fp8_dynamic_per_tensor(x, fmt=fmt)
    if spec.mode == "static":
        if input_scale is None and spec.input_scale is None:
            raise ValueError(f"scheme {scheme.name!r} has static activations but no input_scale")
        scale = spec.input_scale if input_scale is None else input_scale
        return fp8_format.quantize_fp8_static(x, jnp.asarray(scale, jnp.float32), fmt=fmt)
    raise ValueError(f"scheme {scheme.name!r} does not quantize activations")


def _contract_last(a: jax.Array, w: jax.Array) -> jax.Array:
    """``a [..., K] · w [N, K]ᵀ`` accumulated in fp32."""
    return jax.lax.dot_general(a, w, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _row_scales(qt: QTensor) -> jax.Array | None:
    """The scale as one value per row (shape ``[rows, 1]``), if the QTensor has that granularity."""
    if isinstance(qt.scale, QTensor) or qt.global_scale is not None or qt.zero is not None:
        return None
    # One scale per row: blocks span the whole last axis and one row each, or the whole tensor. A
    # 128 × 128 block weight with K = 128 spans the last axis but not one row.
    whole_rows = qt.block[-1:] == qt.shape[-1:] and all(b == 1 for b in qt.block[:-1])
    if whole_rows or tuple(qt.block) == tuple(qt.shape):
        return jnp.broadcast_to(qt.scale.astype(jnp.float32).reshape(-1, 1), (qt.size // qt.shape[-1], 1))
    return None


# Largest fp32 [K blocks, M, N] partials the blockwise FP8 dot keeps; past it, dequantize and dot.
BLOCKWISE_FP8_MAX_BYTES = 2**28


def blockwise_fp8_fits(blocks: int, m: int, n: int) -> bool:
    """Whether the fp32 partials ``[blocks, m, n]`` of ``blockwise_fp8_dot`` stay within
    ``BLOCKWISE_FP8_MAX_BYTES``."""
    return blocks * m * n * 4 <= BLOCKWISE_FP8_MAX_BYTES


def _fp8_blocks(xq: QTensor, qw: QTensor) -> tuple[int, int] | None:
    """(K group, weight rows per block) where block-scaled FP8 (1 × G activation groups, Bn × G weight
    blocks) can run as one batched FP8 dot per K group on this device, else None."""
    if not (dispatch.native_fp8_dot() and xq.fmt in FP8_FORMATS and qw.fmt in FP8_FORMATS):
        return None
    if any(isinstance(t.scale, QTensor) or t.global_scale is not None or t.zero is not None or t.ndim != 2
           for t in (xq, qw)):
        return None
    (m, k), (n, _) = xq.shape, qw.shape
    g = xq.block[-1]
    if xq.block[0] != 1 or qw.block[-1] != g or k % g or qw.group_index is not None:
        return None
    if not blockwise_fp8_fits(k // g, m, n):
        return None
    return g, qw.block[0]


def _blockwise_fp8_dot(xq: QTensor, qw: QTensor, rows: int) -> jax.Array:
    """``Σ_b sx[:, b] · sw[:, b] · (xq_b · wq_bᵀ)``: FP8 codes into XLA's dot per K group (cuBLASLt on a
    GPU), the block scales applied to each group's fp32 sum, as block-FP8 kernels promote them.
    Dequantizing the weight to fp32 instead wrote 4 bytes a weight every call: 544 µs for a
    28672 × 8192 weight at M = 1 on the H200, against 116 µs for its bf16 dot."""
    n = qw.shape[0]
    sx = xq.scale.astype(jnp.float32).T                                      # [b, m]
    sw = jnp.repeat(qw.scale.astype(jnp.float32), rows, axis=0)[:n].T       # [b, n]
    return blockwise_fp8_dot(xq.data, qw.data, sx, sw)


def blockwise_fp8_dot(x_codes: jax.Array, w_codes: jax.Array, sx: jax.Array, sw: jax.Array) -> jax.Array:
    """``Σ_b sx[b, :, None] · sw[b, None, :] · (x_b · w_bᵀ)`` for FP8 codes ``x [M, K]``, ``w [N, K]`` cut
    into ``b`` equal K groups (``sx [b, M]``, ``sw [b, N]`` fp32): one batched FP8 dot, fp32 partials."""
    (m, k), n = x_codes.shape, w_codes.shape[0]
    b = sx.shape[0]
    parts = jax.lax.dot_general(x_codes.reshape(m, b, k // b), w_codes.reshape(n, b, k // b),
                                (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)  # [b, m, n]
    return jnp.sum(parts * sx[:, :, None] * sw[:, None, :], axis=0)


def _llm_int8_apply(scheme: Scheme, x: jax.Array, qweight: QTensor, bias: jax.Array | None) -> jax.Array:
    """vLLM's ``_apply_8bit_weight``: x in bfloat16 through bitsandbytes' matmul, the product kept in a
    float16 buffer, then x's dtype, then the bias added in that dtype."""
    y = bnb_int8.llm_int8_matmul(x.astype(jnp.bfloat16), qweight, scheme.activation.outlier_threshold)
    y = y.astype(jnp.float16).astype(x.dtype)
    return y if bias is None else y + bias.astype(x.dtype)


def xla_apply(scheme: Scheme, x: jax.Array, qweight: QTensor, bias: jax.Array | None,
              input_scale: jax.Array | None = None) -> jax.Array:
    if scheme.activation.mode == "llm_int8":
        return _llm_int8_apply(scheme, x, qweight, bias)
    if scheme.weight_only:
        y = _contract_last(x, qweight.dequantize(x.dtype))
    else:
        lead = x.shape[:-1]
        xq = quantize_activation(scheme, x.reshape(-1, x.shape[-1]), input_scale)
        xs, ws = _row_scales(xq), _row_scales(qweight)
        native = (dispatch.native_fp8_dot() and xs is not None and ws is not None
                  and xq.fmt in FP8_FORMATS and qweight.fmt in FP8_FORMATS)
        if xq.fmt == "int8" and qweight.fmt == "int8" and xs is not None and ws is not None:
            # int8 × int8 with exact int32 sums (cuBLASLt's IMMA on GPUs), scaled once in fp32.
            acc = jax.lax.dot_general(int8_activations.signed_int8(xq), int8_activations.signed_int8(qweight),
                                      (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
            y = xs * (ws.T * acc.astype(jnp.float32))
        elif native:
            # CUTLASS's epilogue order, s_a · (s_b · acc): fp32 products are not associative.
            y = xs * (ws.T * _contract_last(xq.data, qweight.data))
        elif (blocks := _fp8_blocks(xq, qweight)) is not None:
            y = _blockwise_fp8_dot(xq, qweight, rows=blocks[1])
        else:
            y = _contract_last(xq.dequantize(jnp.float32), qweight.dequantize(jnp.float32))
        y = y.reshape(*lead, -1)
        if bias is not None and scheme.activation.mode == "dynamic_per_token_group":
            # vLLM's block-FP8 GEMMs return x's dtype and add the bias to that (two roundings).
            return y.astype(x.dtype) + bias.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


register_impl(Impl(
    name="xla",
    supports=lambda scheme, capability, platform: True,
    prepare=lambda scheme, qweight: qweight,
    run=xla_apply,
    priority=0,
))
