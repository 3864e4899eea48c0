"""Fused projections: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` kernel per layer.

At small batch a decode step is bound by per-GEMM cost, not by bytes: on the H200 the 8-layer
Llama-3-8B-shaped int4 step ran 56 W4A16 GEMMs of 9.8 µs each where their 4-bit bytes alone take 4 µs
(``docs/design/kv_cache.md``). vLLM loads these weights fused (``QKVParallelLinear``,
``MergedColumnParallelLinear``); ``fuse_projections`` does the same to a parameter tree, for a
``LlamaForCausalLM(..., fused_projections=True)``.

Float kernels ``[K, N]`` are concatenated along N. Quantized ones can be fused while they are plain
QTensors (``quantize_params(..., prepare=False)``, then ``prepare_params``) when their rows are
quantized independently of each other (per-channel, or groups along K, or row blocks the parts align
with): the fused codes and scales are then exactly those of quantizing the fused float kernel.
Per-tensor FP8 parts are requantized at their largest scale, as vLLM loads them
(``requantize_to_max_scale``). Other scales shared by a whole part (NVFP4's global scale) differ
between q, k and v, so such weights are refused: fuse the float kernels, then quantize.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from jquant.formats.fp8 import FP8_DTYPES, quantize_fp8_static
from jquant.qtensor import QTensor
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Prepared

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _per_tensor_fp8(p: QTensor) -> bool:
    return p.fmt in FP8_DTYPES and p.block == p.shape and p.global_scale is None and p.scale.size == 1


def requantize_to_max_scale(parts: list[QTensor], where: str = "requantize_to_max_scale") -> QTensor:
    """Per-tensor FP8 weights ``[N_i, K]`` (one scale each) as one ``[sum N_i, K]`` tensor at their largest
    scale, as vLLM's ``requantize_with_max_scale`` fuses q/k/v and gate/up: each part is dequantized to
    float16, then quantized statically at the max scale (``quantize_fp8_static``: sat(x · (1/s))). The part
    holding the max scale keeps its codes; the others lose at most half a code step. ``where`` names the
    parts in errors.

    In vLLM the dequantization is PyTorch's ``codes.to(float16) * scale[i]``: a float16 result, and on a
    CUDA device the float32 0-dim scale is cast to float16 first (the CUDA binary kernels cast every
    tensor operand to the common dtype; on the CPU torch 2.13 keeps it float32). This does the same
    where the scale is a normal float16 (2^-14 to 65504). A scale outside that range would be flushed or
    overflow there, destroying the part's weights; such parts are dequantized in float32 instead.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.formats.fp8 import quantize_fp8
      >>> from jquant.models.fused import requantize_to_max_scale
      >>> rng = np.random.default_rng(0)
      >>> q, k = (quantize_fp8(jnp.asarray(rng.standard_normal((4, 8)) * m, jnp.float32), granularity="tensor")
      ...         for m in (1.0, 0.5))
      >>> fused = requantize_to_max_scale([q, k])
      >>> fused.shape, float(fused.scale.reshape(())) == float(q.scale.reshape(()))
      ((8, 8), True)
      >>> bool((fused.data[:4] == q.data).all())  # the part at the max scale keeps its codes
      True
    """
    first = parts[0]
    if not all(_per_tensor_fp8(p) and p.data.ndim == 2 and (p.fmt, p.shape[1]) == (first.fmt, first.shape[1])
               for p in parts):
        raise ValueError(f"{where}: requantizing needs per-tensor FP8 parts [N_i, K] of one format and K, got "
                         f"{[(p.fmt, tuple(p.shape), tuple(p.block)) for p in parts]}")
    scales = jnp.stack([p.scale.reshape(()).astype(jnp.float32) for p in parts])
    if not bool(jnp.all(jnp.isfinite(scales) & (scales >= 0))):
        # a NaN max would turn every code of the fused weight into NaN, a negative one flip signs
        raise ValueError(f"{where}: per-tensor FP8 scales must be finite and ≥ 0 to be requantized, got "
                         f"{scales.tolist()}")
    top = jnp.max(scales)
    at = top if float(top) > 0 else jnp.float32(1.0)   # all scales 0: every part is zeros, not 0 / 0
    rows = []
    for p, s in zip(parts, scales):
        normal = bool(np.float32(2.0 ** -14) <= s <= np.float32(np.finfo(np.float16).max))
        s_dq = s.astype(jnp.float16).astype(jnp.float32) if normal else s
        dq = p.data.astype(jnp.float32) * s_dq
        if normal:
            dq = dq.astype(jnp.float16)
        rows.append(quantize_fp8_static(dq, at, first.fmt).data)
    data = jnp.concatenate(rows, axis=0)
    shape = (data.shape[0], first.shape[1])
    return first.replace(data=data, scale=top.reshape(first.scale.shape).astype(first.scale.dtype),
                         shape=shape, block=shape)


def _concat_qtensors(parts: list[QTensor], where: str) -> QTensor:
    first = parts[0]
    if all(_per_tensor_fp8(p) for p in parts):
        if any(p.k_axis != 1 for p in parts):
            raise ValueError(f"{where}: per-tensor FP8 parts not laid out [N, K] cannot be joined")
        return requantize_to_max_scale(parts, where)
    for p in parts:
        if isinstance(p.scale, QTensor) or p.k_axis != 1 or p.data.ndim != 2 or len(p.block) != 2:
            raise ValueError(f"{where}: {p.fmt} weights with nested scales, flat codes or no [N, K] "
                             "orientation cannot be joined; fuse the float kernels, then quantize")
        if p.block == p.shape or p.shape[0] % p.block[0] or p.global_scale is not None:
            raise ValueError(f"{where}: {p.fmt} blocks {p.block} (or a global scale) span the output rows "
                             "of more than one part; fuse the float kernels, then quantize")
        if p.group_index is not None:
            raise ValueError(f"{where}: act-order g_idx differs between the parts; fuse the float kernels, "
                             "then quantize")
        same = (p.fmt, p.dtype, p.pack_axis, p.options, p.shape[1:], p.block) == \
               (first.fmt, first.dtype, first.pack_axis, first.options, first.shape[1:], first.block)
        if not same:
            raise ValueError(f"{where}: the parts are quantized differently ({first.fmt} {first.block} vs "
                             f"{p.fmt} {p.block}); quantize them with one scheme")
    cat = lambda name: None if getattr(first, name) is None else jnp.concatenate(
        [getattr(p, name) for p in parts], axis=0)
    return first.replace(data=cat("data"), scale=cat("scale"), zero=cat("zero"),
                         shape=(sum(p.shape[0] for p in parts), *first.shape[1:]))


def _fuse_kernels(kernels: list, where: str):
    if all(isinstance(k, QParam) for k in kernels):
        schemes = {k.scheme for k in kernels}
        if len(schemes) != 1:
            raise ValueError(f"{where}: the parts use different schemes {sorted(s.name for s in schemes)}")
        if any(isinstance(k.weight, Prepared) for k in kernels):
            raise ValueError(f"{where}: the parts are already laid out for a kernel; fuse before "
                             "preparing (quantize_params(..., prepare=False), fuse_projections, then "
                             "prepare_params)")
        scales = [k.input_scale for k in kernels]
        if any(s is not None for s in scales) and not (
                all(s is not None for s in scales) and len({float(s) for s in scales}) == 1):
            raise ValueError(f"{where}: the parts' static activation scales differ ({scales}); one GEMM "
                             "takes one (vLLM keeps their max: load the checkpoint, whose loader shares it)")
        rotations = {k.input_rotation for k in kernels}
        if len(rotations) != 1:
            raise ValueError(f"{where}: the parts' input rotations differ ({sorted(map(str, rotations))}); "
                             "one GEMM reads one input")
        return QParam(_concat_qtensors([k.weight for k in kernels], where), kernels[0].scheme, scales[0],
                      rotations.pop())
    if any(isinstance(k, QParam) for k in kernels):
        raise ValueError(f"{where}: some parts are quantized and some are not")
    if len({k.shape[0] for k in kernels}) != 1:
        raise ValueError(f"{where}: the parts' input sizes differ: {[tuple(k.shape) for k in kernels]}")
    return jnp.concatenate(kernels, axis=1)


def fuse_projections(params: Mapping[str, Any]) -> dict:
    """``params`` (a Llama ``params`` collection, or variables holding one) with every layer's q/k/v and
    gate/up kernels fused; other leaves are shared, not copied. Layers already fused pass through."""
    if "params" in params and not any(k.startswith("layers_") for k in params):
        return {**params, "params": fuse_projections(params["params"])}
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        layer = dict(layer)
        for fused, parts in FUSED.items():
            if all(p in layer for p in parts):
                for p in parts:
                    if set(layer[p]) != {"kernel"}:
                        raise ValueError(f"{name}/{p} holds {sorted(layer[p])}; only bias-free kernels fuse")
                kernels = [layer.pop(p)["kernel"] for p in parts]
                layer[fused] = {"kernel": _fuse_kernels(kernels, f"{name}/{fused}")}
            elif any(p in layer for p in parts):
                raise ValueError(f"{name} has only some of {parts}")
        out[name] = layer
    return out
