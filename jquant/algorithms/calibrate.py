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


def layer_runner(model: LlamaForCausalLM, params: dict, calibration_ids) -> tuple[jax.Array, Callable]:
    """The first layer's input (the embedded ``calibration_ids [rows, seq_len]``) and a jitted
    ``(layer_params, x) -> (output, {projection: input})``; every layer has the same shapes, so one
    compile serves all of them at each stage of quantization."""
    ids = jnp.asarray(calibration_ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"calibration_ids must be [rows, seq_len], got shape {ids.shape}")
    x = jnp.take(params["embed_tokens"]["embedding"], ids, axis=0).astype(model.dtype)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    mask = causal_mask(positions[0], positions[0])
    layer = DecoderLayer(model.config, model.dtype, nn.Dense, model.fused_projections)

    def run(layer_params, x):
        record: dict = {}
        with nn.intercept_methods(_recording_interceptor(record)):
            out, _ = layer.apply({"params": layer_params}, x, positions, mask, None, None)
        return out, record
    return x, jax.jit(run)


def calibrate_llama(model: LlamaForCausalLM, params: dict, calibration_ids: jax.Array,
                    quantize_group: QuantizeGroup, *, progress: bool = True) -> dict:
    """``params`` (a Llama ``params`` collection, float) with every projection quantized by
    ``quantize_group`` from calibration activations of ``calibration_ids [rows, seq_len]``.

    Returns the params with QParams (plain QTensors: ``jquant.flax.prepare_params`` lays them out for
    this device's kernels, ``save_hf_checkpoint`` writes them).

    Examples:
      A tiny random Llama quantized to int4, groups of 32, with ``rtn_group`` (no calibration needed):

      >>> import jax, jax.numpy as jnp
      >>> from jquant.algorithms import calibrate_llama, rtn_group
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jnp.array([[1, 5, 7, 2]], jnp.int32)  # calibration token ids [rows, seq_len]
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> qparams = calibrate_llama(model, params, ids, rtn_group("int4_g32"), progress=False)
      >>> kernel = qparams["layers_0"]["k_proj"]["kernel"]
      >>> type(kernel).__name__, kernel.scheme.name, kernel.qtensor.shape  # [N, K]
      ('QParam', 'int4_g32', (32, 64))
      >>> type(qparams["layers_0"]["input_norm"]["scale"]).__name__  # norms and embeddings stay float
      'ArrayImpl'

      ``jquant.flax.quantized_apply(model, {"params": qparams}, ids)`` then runs the quantized model.
    """
    x, run = layer_runner(model, params, calibration_ids)
    groups = FUSED_GROUPS if model.fused_projections else GROUPS
    out = dict(params)
    for i in tqdm(range(model.config.num_layers), desc="calibrating layers", disable=not progress):
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


def _rotated(kernels, rotation):
    """The kernels ``[K, N]`` in the rotated basis (unchanged for None)."""
    if rotation is None:
        return kernels
    return {n: hadamard_blocks(k, rotation, axis=0) for n, k in kernels.items()}


def rtn_group(scheme: str | Scheme, *, rotation: int | None = None) -> QuantizeGroup:
    """Round-to-nearest with ``scheme`` (the inputs are not used): the baseline calibration beats.
    ``rotation``: quantize ``W H`` for a block-``rotation`` Hadamard ``H`` (the QParams rotate their
    inputs to match).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.algorithms import rtn_group
      >>> rng = np.random.default_rng(0)
      >>> kernels = {"q_proj": rng.standard_normal((64, 16)).astype(np.float32)}  # Flax [K, N]
      >>> x = rng.standard_normal((4, 64)).astype(np.float32)
      >>> qparams = rtn_group("int4_g32", rotation=32)(kernels, x)
      >>> q = qparams["q_proj"]
      >>> q.scheme.name, q.input_rotation, q.qtensor.shape
      ('int4_g32', 32, (16, 64))
      >>> ref = x @ kernels["q_proj"]
      >>> def relative_error(y):
      ...     return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
      >>> relative_error(q.apply(x)) < 0.15  # apply rotates x to match
      True
      >>> relative_error(x @ q.qtensor.dequantize().T) > 1  # the stored weight is W H, not W
      True
    """
    scheme = get_scheme(scheme)

    def quantize_group(kernels, inputs):
        kernels = _rotated(kernels, rotation)
        return {n: QParam(scheme.quantize_kernel(k), scheme, input_rotation=rotation) for n, k in kernels.items()}
    return quantize_group


def gptq_group(scheme: str | Scheme, *, rotation: int | None = None, **options) -> QuantizeGroup:
    """GPTQ with ``scheme`` (an integer format, MXFP4 or NVFP4); the projections of a group share one
    Hessian. ``rotation``: as ``rtn_group``, GPTQ then runs in the rotated basis. ``options``:
    ``damp_percent``, ``block_size``, ``act_order``, ``static_groups``.

    Examples:
      >>> import numpy as np
      >>> from jquant.algorithms import gptq_group
      >>> rng = np.random.default_rng(0)
      >>> kernels = {name: rng.standard_normal((64, 16)).astype(np.float32) for name in ("gate_proj", "up_proj")}
      >>> inputs = rng.standard_normal((256, 64)).astype(np.float32)  # [tokens, K], shared by the group
      >>> qparams = gptq_group("int4_g32")(kernels, inputs)
      >>> sorted(qparams), qparams["up_proj"].qtensor.shape
      (['gate_proj', 'up_proj'], (16, 64))
    """
    from jquant.algorithms.gptq import accumulate_hessian, gptq_quantize_kernel

    scheme = get_scheme(scheme)

    def quantize_group(kernels, inputs):
        kernels = _rotated(kernels, rotation)
        inputs = inputs if rotation is None else hadamard_blocks(inputs, rotation)
        hessian = accumulate_hessian(inputs, inputs.shape[-1])
        return {n: QParam(gptq_quantize_kernel(k, hessian, scheme=scheme, **options), scheme,
                          input_rotation=rotation) for n, k in kernels.items()}
    return quantize_group
