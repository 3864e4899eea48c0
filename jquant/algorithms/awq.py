"""AWQ for a Llama: per layer, a scale search for each group of projections on the float model's
activations, the scales folded into the norms / up_proj (``scaling``), a clip search per projection,
then round-to-nearest in the target scheme. The math is ``awq_core``.

Follows AutoAWQ's order: every group's scales are searched on the same float activations before any
is applied (scaling one group leaves the others' inputs unchanged, up to the folded ``1/s``), clip
bounds are searched on the finally scaled weights, and the next layer sees the float layer's output.
One simplification: a group's scale-search loss is its own projections' output error, where AutoAWQ
measures the whole attention block's or MLP's output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jquant.algorithms import awq_core
from jquant.algorithms.scaling import fold_scales, group_weight, scaled_groups, walk_float_layers
from jquant.models.llama import LlamaForCausalLM
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Scheme, get_scheme

# AutoAWQ does not clip q/k: their errors act through the attention scores, not an output sum.
NO_CLIP = ("q_proj", "k_proj", "qkv_proj")

_scale_search = jax.jit(awq_core.scale_search, static_argnames=("qdq", "n_grid", "n_loss_tokens"))
# The scale search's loss over 2048 sampled tokens: on SmolLM2 with 8192 calibration tokens the full
# loss is 20 GEMMs of 8192 tokens per group, ~1 TFLOP a layer, most of a CPU calibration's time.
N_LOSS_TOKENS = 2048
_clip_search = jax.jit(awq_core.clip_search, static_argnames=("qdq", "group_size", "n_grid"))


@functools.lru_cache(maxsize=None)
def scheme_qdq(scheme: Scheme) -> awq_core.QDQ:
    """Round-to-nearest quantize-dequantize of an ``[N, K]`` weight in ``scheme``'s format (one cached
    jitted callable per scheme, so the searches compile once per shape)."""
    return jax.jit(lambda w: scheme.quantize_weight(w).dequantize(jnp.float32))


def block_along_k(scheme: Scheme, weight) -> int:
    """Values per scale along K of ``weight [N, K]`` in ``scheme`` (K for per-channel formats)."""
    return int(jax.eval_shape(scheme.quantize_weight, jax.ShapeDtypeStruct(weight.shape, jnp.float32)).block[1])


def awq_llama(model: LlamaForCausalLM, params: dict, calibration_ids, scheme: str | Scheme, *,
              n_grid: int = awq_core.N_GRID, duo_scaling: bool = True, clip: bool = True,
              n_loss_tokens: int | None = N_LOSS_TOKENS, progress: bool = True) -> dict:
    """``params`` with every projection AWQ-quantized to ``scheme`` and the scales folded into the norms
    (and up_proj; v_proj when the model has no grouped-query attention).

    Args:
      model, params: a float ``LlamaForCausalLM`` and its ``params`` collection.
      calibration_ids: ``[rows, seq_len]`` token ids.
      scheme: any weight-only scheme (the searches run its own round-to-nearest).
      n_grid, duo_scaling, clip: as ``awq_core.awq`` (duo scaling is AutoAWQ's default).
      n_loss_tokens: tokens the scale search's loss samples (``awq_core.scale_search``; None: all).

    Returns:
      The params with QParams (plain QTensors) and folded norm scales.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.algorithms import awq_llama
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 32)
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> q = awq_llama(model, params, ids, "int4_g32", progress=False)
      >>> q["layers_0"]["gate_proj"]["kernel"].scheme.name
      'int4_g32'
      >>> bool(jnp.any(q["layers_0"]["input_norm"]["scale"] != params["layers_0"]["input_norm"]["scale"]))
      True
    """
    scheme = get_scheme(scheme)
    qdq = scheme_qdq(scheme)
    groups = scaled_groups(model.config, model.fused_projections)

    def quantize_layer(layer_params, inputs):
        found = []
        for group in groups:
            x = inputs[group.linears[0]]
            if group.previous is None:
                found.append(None)
                continue
            w = group_weight(layer_params, group)
            w_mean = awq_core.weight_mean(w, block_along_k(scheme, w)) if duo_scaling else None
            found.append(_scale_search(w, x, qdq, n_grid, w_mean, n_loss_tokens)[0])
        for group, s in zip(groups, found):
            if s is not None:
                layer_params = fold_scales(layer_params, group, s, model.config)
        for group, s in zip(groups, found):
            x = inputs[group.linears[0]] if s is None else inputs[group.linears[0]] / s
            for name in group.linears:
                kernel = layer_params[name]["kernel"]
                w = jnp.asarray(kernel, jnp.float32).T
                if clip and name not in NO_CLIP:
                    bound = _clip_search(w, x, qdq, group_size=block_along_k(scheme, w), n_grid=n_grid)
                    w = awq_core.apply_clip(w, bound)
                qt = scheme.quantize_weight(w).replace(dtype=kernel.dtype)
                layer_params[name] = {"kernel": QParam(qt, scheme)}
        return layer_params

    return walk_float_layers(model, params, calibration_ids, quantize_layer, desc="AWQ layers", progress=progress)
