"""Per-input-channel scales migrated through a Llama layer (AWQ, SmoothQuant), folded so inference pays
nothing.

A group of projections that read one input ``x [.., K]`` computes the same outputs from ``x / s`` and
kernels whose K rows are multiplied by ``s``. ``x / s`` is free when ``x`` is the output of something
linear in its last axis: the RMSNorm before q/k/v and before gate/up (its scale divides by ``s``), and
up_proj before down_proj (its output columns divide by ``s``, as SiLU(gate) · up is linear in up).
o_proj's input is the attention output, linear in v_proj's columns only when every query head has
its own KV head; with grouped-query attention one KV head serves several query heads, so o_proj is
not scaled (AutoAWQ skips it for the same reason).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from tqdm import tqdm

from jquant.algorithms.calibrate import FUSED_GROUPS, GROUPS, layer_runner
from jquant.models.llama import LlamaConfig, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class ScaledGroup:
    """Projections reading one input, and the parameter that produces that input.

    Attributes:
      linears: the Dense modules of the group (the first one's recorded input is the group's).
      previous: ``"input_norm"``/``"post_attention_norm"`` (an RMSNorm scale), ``"v_proj"`` or
        ``"up_proj"`` (a kernel's output columns; ``"gate_up_proj"``'s second half when fused), or None
        when the input cannot absorb a scale.
    """

    linears: tuple[str, ...]
    previous: str | None


def scaled_groups(config: LlamaConfig, fused: bool) -> tuple[ScaledGroup, ...]:
    """The layer's groups in the order it runs them, with where each one's ``1/s`` folds."""
    o_previous = "v_proj" if config.num_kv_heads == config.num_heads and not fused else None
    previous = ("input_norm", o_previous, "post_attention_norm", "up_proj")
    return tuple(ScaledGroup(linears, prev) for linears, prev in zip(FUSED_GROUPS if fused else GROUPS, previous))


def group_weight(layer_params: Mapping, group: ScaledGroup) -> jax.Array:
    """The group's kernels as one PyTorch-orientation weight ``[sum N, K]`` (float32)."""
    return jnp.concatenate([jnp.asarray(layer_params[n]["kernel"], jnp.float32).T for n in group.linears])


def fold_scales(layer_params: Mapping, group: ScaledGroup, scales: jax.Array, config: LlamaConfig) -> dict:
    """``layer_params`` with the group's kernels' K rows multiplied by ``scales [K]`` and the group's
    input divided by them at ``group.previous``; the layer computes the same function (to rounding).

    Raises:
      ValueError: the group's input cannot absorb a scale (``previous`` is None).
    """
    if group.previous is None:
        raise ValueError(f"the input of {group.linears} cannot absorb a scale (grouped-query attention or a "
                         "fused layer feeds it)")
    s = jnp.asarray(scales, jnp.float32)
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in layer_params.items()}
    for name in group.linears:
        kernel = out[name]["kernel"]
        out[name]["kernel"] = (jnp.asarray(kernel, jnp.float32) * s[:, None]).astype(kernel.dtype)
    prev = group.previous
    if prev.endswith("_norm"):
        norm = out[prev]["scale"]
        out[prev]["scale"] = (jnp.asarray(norm, jnp.float32) / s).astype(norm.dtype)
        return out
    name, columns = prev, slice(None)
    if prev == "up_proj" and "gate_up_proj" in out:
        name, columns = "gate_up_proj", slice(config.intermediate_size, None)
    kernel = jnp.asarray(out[name]["kernel"])
    cols = kernel[:, columns].astype(jnp.float32) / s[None, :]
    out[name]["kernel"] = kernel.at[:, columns].set(cols.astype(kernel.dtype))
    return out


LayerQuantizer = Callable[[dict, Mapping[str, jax.Array]], dict]


def walk_float_layers(model: LlamaForCausalLM, params: dict, calibration_ids, quantize_layer: LayerQuantizer,
                      *, desc: str, progress: bool = True) -> dict:
    """Runs the float model layer by layer on ``calibration_ids [rows, seq_len]``; each layer's params and
    the inputs its projections saw (``{name: [tokens, K]}`` float32) go to ``quantize_layer``, whose
    returned params replace the layer's. The next layer's input is the float layer's output, as AWQ
    and SmoothQuant compute their statistics on the float model."""
    x, run = layer_runner(model, params, calibration_ids)
    out = dict(params)
    for i in tqdm(range(model.config.num_layers), desc=desc, disable=not progress):
        layer_params = params[f"layers_{i}"]
        x, record = run(layer_params, x)
        inputs = {n: v.reshape(-1, v.shape[-1]).astype(jnp.float32) for n, v in record.items()}
        out[f"layers_{i}"] = quantize_layer(dict(layer_params), inputs)
    return out
