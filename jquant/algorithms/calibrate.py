"""Calibrating a Llama layer by layer: each projection is quantized from the inputs it sees when every
earlier projection is already quantized, as GPTQ's sequential mode does.

Per decoder layer, the projections are taken in the order the layer runs them, in groups that read the
same input (q/k/v, o, gate/up, down; or the fused qkv / gate_up). For each group the layer is run on the
calibration activations with the weights quantized so far, the group's input is recorded, and
``quantize_group`` turns the group's float kernels into QParams. The layer's output under its quantized
weights is the next layer's input. Everything else (embeddings, norms) stays float.
"""

from __future__ import annotations

from typing import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from tqdm import tqdm

from jquant.formats.hadamard import hadamard_blocks
from jquant.models.llama import DecoderLayer, LlamaForCausalLM, causal_mask
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Scheme, get_scheme

# Projections that read the same input, in the order a layer runs them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
FUSED_GROUPS = (("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",))

# (kernels {name: float [K, N]}, inputs [tokens, K]) -> {name: QParam}
QuantizeGroup = Callable[[Mapping[str, jax.Array], jax.Array], Mapping[str, QParam]]


def _recording_interceptor(record: dict):
    """Records each Dense's input (by module name) and runs QParam kernels through their scheme."""
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if not (isinstance(module, nn.Dense) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        (x,) = args
        record[module.name] = x
        kernel = module.get_variable("params", "kernel")
        if isinstance(kernel, QParam):
            return kernel.apply(x.astype(module.dtype or x.dtype))
        return next_fun(*args, **kwargs)
    return intercept


def layer_pass(layer: DecoderLayer, positions, mask):
    """Jitted ``(params, x) -> (output, {projection: input})``; every layer has the same shapes, so one
    compile serves all of them at each stage of quantization."""
    def run(params, x):
        record: dict = {}
        with nn.intercept_methods(_recording_interceptor(record)):
            out, _ = layer.apply({"params": params}, x, positions, mask, None, None)
        return out, record
    return jax.jit(run)


def calibrate_llama(model: LlamaForCausalLM, params: dict, calibration_ids: jax.Array,
                    quantize_group: QuantizeGroup, *, progress: bool = True) -> dict:
    """``params`` (a Llama ``params`` collection, float) with every projection quantized by
    ``quantize_group`` from calibration activations of ``calibration_ids [rows, seq_len]``.

    Returns the params with QParams (plain QTensors: ``jquant.flax.prepare_params`` lays them out for
    this device's kernels, ``save_hf_checkpoint`` writes them)."""
    c = model.config
    ids = jnp.asarray(calibration_ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"calibration_ids must be [rows, seq_len], got shape {ids.shape}")
    x = jnp.take(params["embed_tokens"]["embedding"], ids, axis=0).astype(model.dtype)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    run = layer_pass(DecoderLayer(c, model.dtype, nn.Dense, model.fused_projections), positions,
                      causal_mask(positions[0], positions[0]))
    groups = FUSED_GROUPS if model.fused_projections else GROUPS
    out = dict(params)
    for i in tqdm(range(c.num_layers), desc="calibrating layers", disable=not progress):
        layer_params = dict(params[f"layers_{i}"])
        for group in groups:
            inputs = run(layer_params, x)[1][group[0]]
            kernels = {name: layer_params[name]["kernel"] for name in group}
            quantized = quantize_group(kernels, inputs.reshape(-1, inputs.shape[-1]).astype(jnp.float32))
            for name in group:
                layer_params[name] = {"kernel": quantized[name]}
        x = run(layer_params, x)[0]
        out[f"layers_{i}"] = layer_params
    return out


def _rotated(kernels, inputs, rotation):
    """The kernels ``[K, N]`` and inputs ``[tokens, K]`` in the rotated basis (unchanged for None)."""
    if rotation is None:
        return kernels, inputs
    return ({n: hadamard_blocks(k, rotation, axis=0) for n, k in kernels.items()},
            hadamard_blocks(inputs, rotation))


def rtn_group(scheme: str | Scheme, *, rotation: int | None = None) -> QuantizeGroup:
    """Round-to-nearest with ``scheme`` (the inputs are not used): the baseline calibration beats.
    ``rotation``: quantize ``W H`` for a block-``rotation`` Hadamard ``H`` (the QParams rotate their
    inputs to match)."""
    scheme = get_scheme(scheme)

    def quantize_group(kernels, inputs):
        kernels, _ = _rotated(kernels, inputs[:0], rotation)
        return {n: QParam(scheme.quantize_kernel(k), scheme, input_rotation=rotation) for n, k in kernels.items()}
    return quantize_group


def gptq_group(scheme: str | Scheme, *, rotation: int | None = None, **options) -> QuantizeGroup:
    """GPTQ with ``scheme`` (an integer format, MXFP4 or NVFP4); the projections of a group share one
    Hessian. ``rotation``: as ``rtn_group``, GPTQ then runs in the rotated basis. ``options``:
    ``damp_percent``, ``block_size``, ``act_order``, ``static_groups``."""
    from jquant.algorithms.gptq import accumulate_hessian, gptq_quantize_kernel

    scheme = get_scheme(scheme)

    def quantize_group(kernels, inputs):
        kernels, inputs = _rotated(kernels, inputs, rotation)
        hessian = accumulate_hessian(inputs, inputs.shape[-1])
        return {n: QParam(gptq_quantize_kernel(k, hessian, scheme=scheme, **options), scheme,
                          input_rotation=rotation) for n, k in kernels.items()}
    return quantize_group
