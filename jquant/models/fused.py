"""Fused projections: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` kernel per layer.

At small batch a decode step is bound by per-GEMM cost, not by bytes: on the H200 the 8-layer
Llama-3-8B-shaped int4 step ran 56 W4A16 GEMMs of 9.8 µs each where their 4-bit bytes alone take 4 µs
(``docs/design/kv_cache.md``). vLLM loads these weights fused (``QKVParallelLinear``,
``MergedColumnParallelLinear``); ``fuse_projections`` does the same to a parameter tree, for a
``LlamaForCausalLM(..., fused_projections=True)``.

Float kernels ``[K, N]`` are concatenated along N. Quantized ones can be fused while they are plain
QTensors (``quantize_params(..., prepare=False)``, then ``prepare_params``) when their rows are
quantized independently of each other (per-channel, or groups along K, or row blocks the parts align
with): the fused codes and scales are then exactly those of quantizing the fused float kernel. A
per-tensor scale (per-tensor FP8, NVFP4's global scale) differs between q, k and v, so such weights
are refused: fuse the float kernels, then quantize.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from jquant.qtensor import QTensor
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Prepared

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _concat_qtensors(parts: list[QTensor], where: str) -> QTensor:
    first = parts[0]
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
