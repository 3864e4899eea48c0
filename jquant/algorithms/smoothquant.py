"""SmoothQuant for a Llama: per layer, migration scales from the float model's activation maxima
(``smoothquant_core``), folded into the norms / up_proj (``scaling``), then round-to-nearest in a W8A8
scheme, whose activations are quantized at run time from the smoothed (folded) inputs."""

from __future__ import annotations

from jquant.algorithms import smoothquant_core
from jquant.algorithms.scaling import fold_scales, scaled_groups, walk_float_layers
from jquant.models.llama import LlamaForCausalLM
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Scheme, get_scheme


def smoothquant_llama(model: LlamaForCausalLM, params: dict, calibration_ids, scheme: str | Scheme, *,
                      alpha: float = 0.5, progress: bool = True) -> dict:
    """``params`` with the SmoothQuant scales (strength ``alpha``) folded in and every projection
    quantized to ``scheme`` (any scheme; its point is one that quantizes activations, such as
    ``fp8_e4m3_channel``). The scales pool the column maxima of a group's kernels (q/k/v, gate/up),
    since one folded scale serves all of them.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.algorithms import smoothquant_llama
      >>> from jquant.flax import quantized_apply
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=64)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 32)
      >>> params = model.init(jax.random.key(0), ids)["params"]
      >>> q = smoothquant_llama(model, params, ids, "fp8_e4m3_channel", alpha=0.5, progress=False)
      >>> q["layers_0"]["down_proj"]["kernel"].scheme.name
      'fp8_e4m3_channel'
      >>> quantized_apply(model, {"params": q}, ids)[0].shape
      (2, 16, 32)
    """
    scheme = get_scheme(scheme)
    groups = scaled_groups(model.config, model.fused_projections)

    def quantize_layer(layer_params, inputs):
        for group in groups:
            if group.previous is None:
                continue
            kernels = [layer_params[n]["kernel"].T for n in group.linears]
            absmax = smoothquant_core.activation_absmax(inputs[group.linears[0]])
            scales = smoothquant_core.smooth_scales(absmax, kernels, alpha)
            layer_params = fold_scales(layer_params, group, scales, model.config)
        for group in groups:
            for name in group.linears:
                layer_params[name] = {"kernel": QParam(scheme.quantize_kernel(layer_params[name]["kernel"]), scheme)}
        return layer_params

    return walk_float_layers(model, params, calibration_ids, quantize_layer, desc="SmoothQuant layers",
                             progress=progress)
