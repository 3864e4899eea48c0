"""MoE expert tensors of a checkpoint ⇄ stacked expert QTensors ``[E, N, K]``, bit-exact both ways.

Each matrix goes through the single-tensor layouts (``from_checkpoint`` / ``to_checkpoint``); this
module only names, splits, stacks and interleaves.

* gpt-oss (transformers' checkpoint names, MXFP4 layout ``"gpt-oss"``):
  ``<module>.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``_scales`` uint8 ``[E, 2I, H/32]``,
  ``<module>.gate_up_proj_bias`` ``[E, 2I]``, ``down_proj_blocks`` ``[E, H, I/32, 16]``,
  ``down_proj_scales``, ``down_proj_bias`` ``[E, H]``. Gate and up are interleaved along the 2I output
  rows: even rows gate, odd rows up (gpt-oss reference fact 1 of ``docs/design/moe.md``: transformers'
  ``GptOssExperts`` takes ``gate_up[..., ::2]`` and ``gate_up[..., 1::2]`` of its ``[E, H, 2I]``
  product, the transpose of the checkpoint's rows). Loading splits them into separate gate and up
  stacks; export interleaves them back.
* DeepSeek-V3 (reference fact 6; layout ``"fp8-block"``): per expert
  ``<module>.{e}.{gate,up,down}_proj.weight`` float8_e4m3fn ``[N, K]`` with ``weight_scale_inv``
  float32 ``[ceil(N/128), ceil(K/128)]`` (a multiplier), stacked along a new expert axis.

Biases are kept as the arrays the checkpoint holds (their dtype included), so export gives them back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jquant.checkpoint.base import from_checkpoint, to_checkpoint
from jquant.checkpoint.writer import tensor_name
from jquant.kernels.moe.experts import check_stack, stack_experts, unstack_experts
from jquant.qtensor import QTensor

GPT_OSS = "gpt-oss"
FP8_BLOCK = "fp8-block"
DEEPSEEK_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's experts: ``gate``, ``up`` ``[E, I, H]`` and ``down`` ``[E, H, I]`` stacked
    QTensors (PyTorch orientation per expert), and optional biases ``gate_bias``, ``up_bias`` ``[E, I]``
    and ``down_bias`` ``[E, H]``."""

    gate: QTensor
    up: QTensor
    down: QTensor
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None

    def __post_init__(self):
        for name in ("gate", "up", "down"):
            check_stack(getattr(self, name), f"ExpertWeights.{name}")
        e, i, h = self.gate.shape
        if self.up.shape != (e, i, h) or self.down.shape != (e, h, i):
            raise ValueError(f"ExpertWeights: gate {self.gate.shape}, up {self.up.shape} and down {self.down.shape} "
                             f"do not fit: expected gate = up = [E, I, H] and down = [E, H, I]")
        for name, shape in (("gate_bias", (e, i)), ("up_bias", (e, i)), ("down_bias", (e, h))):
            bias = getattr(self, name)
            if hasattr(bias, "shape") and tuple(bias.shape) != shape:
                raise ValueError(f"ExpertWeights.{name} must have shape {shape}, got {tuple(bias.shape)}")

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


jax.tree_util.register_dataclass(ExpertWeights, meta_fields=[],
                                 data_fields=["gate", "up", "down", "gate_bias", "up_bias", "down_bias"])


def _get(tensors: dict, name: str, what: str) -> np.ndarray:
    if name not in tensors:
        near = sorted(k for k in tensors if k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0])[:8]
        raise ValueError(f"{what} checkpoint is missing tensor {name!r}; tensors beside it: "
                         f"{near or sorted(tensors)[:8]}")
    return np.asarray(tensors[name])


# ---- gpt-oss (MXFP4, gate/up interleaved) -----------------------------------------------------------

def _gpt_oss_names(module: str, proj: str) -> tuple[str, str, str]:
    base = f"{module}.{proj}" if module else proj
    return tensor_name(base, "blocks", GPT_OSS), tensor_name(base, "scales", GPT_OSS), f"{base}_bias"


def _mxfp4_stack(tensors: dict, module: str, proj: str) -> tuple[np.ndarray, np.ndarray, Any]:
    blocks_name, scales_name, bias_name = _gpt_oss_names(module, proj)
    blocks = _get(tensors, blocks_name, GPT_OSS)
    scales = _get(tensors, scales_name, GPT_OSS)
    if blocks.ndim != 4:
        raise ValueError(f"{GPT_OSS}: tensor {blocks_name!r} must be stacked experts [E, N, K/32, 16], got shape "
                         f"{blocks.shape}")
    bias = np.asarray(tensors[bias_name]) if bias_name in tensors else None
    return blocks, scales, bias


def load_gpt_oss_gate_up(tensors: dict, module: str = "mlp.experts", *, dtype=jnp.float32):
    """gpt-oss ``gate_up_proj`` tensors → ``(gate, up, gate_bias, up_bias)``: the even rows of each expert
    are gate, the odd rows up (MXFP4 stacks ``[E, I, H]``; biases ``[E, I]`` or None)."""
    blocks, scales, bias = _mxfp4_stack(tensors, module, "gate_up_proj")
    names = _gpt_oss_names(module, "gate_up_proj")
    if blocks.shape[1] % 2:
        raise ValueError(f"{GPT_OSS}: tensor {names[0]!r} {blocks.shape} has an odd number of rows "
                         f"{blocks.shape[1]}; gate and up interleave, so it must be 2·I")
    if bias is not None and (bias.ndim != 2 or bias.shape != blocks.shape[:2]):
        raise ValueError(f"{GPT_OSS}: tensor {names[2]!r} has shape {bias.shape}, expected {blocks.shape[:2]} "
                         f"(one per expert and gate/up row)")
    gate = _load_mxfp4(blocks[:, 0::2], scales[:, 0::2], dtype)
    up = _load_mxfp4(blocks[:, 1::2], scales[:, 1::2], dtype)
    return gate, up, None if bias is None else bias[:, 0::2], None if bias is None else bias[:, 1::2]


def _load_mxfp4(blocks, scales, dtype) -> QTensor:
    return from_checkpoint({"blocks": np.ascontiguousarray(blocks), "scales": np.ascontiguousarray(scales)},
                           GPT_OSS, dtype=dtype)


def load_gpt_oss_experts(tensors: dict, module: str = "mlp.experts", *, dtype=jnp.float32) -> ExpertWeights:
    """gpt-oss expert tensors (``module`` prefix, e.g. ``model.layers.0.mlp.experts``) → ExpertWeights with
    gate and up de-interleaved (MXFP4 stacks, logical dtype ``dtype``)."""
    gate, up, gate_bias, up_bias = load_gpt_oss_gate_up(tensors, module, dtype=dtype)
    down_blocks, down_scales, down_bias = _mxfp4_stack(tensors, module, "down_proj")
    down = _load_mxfp4(down_blocks, down_scales, dtype)
    if down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
        raise ValueError(f"{GPT_OSS}: tensor {_gpt_oss_names(module, 'down_proj')[0]!r} holds experts {down.shape} "
                         f"[E, N, K], but gate_up_proj gives E={gate.shape[0]}, I={gate.shape[1]}, "
                         f"H={gate.shape[2]}: expected [E, H, I] = {(gate.shape[0], gate.shape[2], gate.shape[1])}")
    return ExpertWeights(gate, up, down, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)


def _interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    out = np.empty((even.shape[0], 2 * even.shape[1]) + even.shape[2:], even.dtype)
    out[:, 0::2], out[:, 1::2] = even, odd
    return out


def gpt_oss_experts_to_tensors(weights: ExpertWeights, module: str = "mlp.experts") -> dict[str, np.ndarray]:
    """The inverse of ``load_gpt_oss_experts``: the checkpoint's tensors, gate and up interleaved again."""
    if (weights.gate_bias is None) != (weights.up_bias is None):
        raise ValueError("gpt-oss stores one gate_up_proj_bias: give both gate_bias and up_bias, or neither")
    gate = to_checkpoint(weights.gate, GPT_OSS)
    up = to_checkpoint(weights.up, GPT_OSS)
    down = to_checkpoint(weights.down, GPT_OSS)
    gate_up_names = _gpt_oss_names(module, "gate_up_proj")
    down_names = _gpt_oss_names(module, "down_proj")
    out = {gate_up_names[0]: _interleave(gate["blocks"], up["blocks"]),
           gate_up_names[1]: _interleave(gate["scales"], up["scales"]),
           down_names[0]: down["blocks"], down_names[1]: down["scales"]}
    if weights.gate_bias is not None:
        out[gate_up_names[2]] = _interleave(np.asarray(weights.gate_bias), np.asarray(weights.up_bias))
    if weights.down_bias is not None:
        out[down_names[2]] = np.asarray(weights.down_bias)
    return out


# ---- DeepSeek-V3 (block FP8, one tensor per expert) -------------------------------------------------

def _deepseek_name(module: str, e: int, proj: str, key: str) -> str:
    return f"{module}.{e}.{proj}.{key}" if module else f"{e}.{proj}.{key}"


def deepseek_num_experts(tensors: dict, module: str = "mlp.experts") -> int:
    """The number of experts whose tensors ``tensors`` holds under ``module`` (1 + the largest index)."""
    pattern = re.compile(re.escape(f"{module}.") + r"(\d+)\." if module else r"(\d+)\.")
    found = [int(m.group(1)) for k in tensors if (m := pattern.match(k))]
    if not found:
        raise ValueError(f"{FP8_BLOCK}: no expert tensors named '{module}.<e>.<proj>.weight' among "
                         f"{sorted(tensors)[:8]}")
    return max(found) + 1


def load_deepseek_experts(tensors: dict, module: str = "mlp.experts", *, num_experts: int | None = None,
                          dtype=jnp.float32, block_size=(128, 128)) -> ExpertWeights:
    """DeepSeek-V3 per-expert block-FP8 tensors under ``module`` → ExpertWeights (stacked ``fp8_e4m3``
    QTensors with blocks ``(1, 128, 128)``); every expert ``0..num_experts-1`` must be present."""
    if num_experts is None:
        num_experts = deepseek_num_experts(tensors, module)
    stacks = {}
    for proj in DEEPSEEK_PROJECTIONS:
        per_expert = []
        for e in range(num_experts):
            names = [_deepseek_name(module, e, proj, key) for key in ("weight", "weight_scale_inv")]
            pair = dict(zip(("weight", "weight_scale_inv"), (_get(tensors, n, FP8_BLOCK) for n in names)))
            try:
                per_expert.append(from_checkpoint(pair, FP8_BLOCK, dtype=dtype, block_size=tuple(block_size)))
            except ValueError as err:
                raise ValueError(f"expert tensors {names}: {err}") from err
        try:
            stacks[proj] = stack_experts(per_expert)
        except ValueError as err:
            raise ValueError(f"{FP8_BLOCK}: the experts' {module}.<e>.{proj} tensors do not stack: {err}") from err
    return ExpertWeights(stacks["gate_proj"], stacks["up_proj"], stacks["down_proj"])


def deepseek_experts_to_tensors(weights: ExpertWeights, module: str = "mlp.experts") -> dict[str, np.ndarray]:
    """The inverse of ``load_deepseek_experts``: ``weight`` and ``weight_scale_inv`` per expert and projection."""
    if any(b is not None for b in (weights.gate_bias, weights.up_bias, weights.down_bias)):
        raise ValueError("DeepSeek-V3 experts have no biases; this ExpertWeights holds some")
    out = {}
    for proj, stack in zip(DEEPSEEK_PROJECTIONS, (weights.gate, weights.up, weights.down)):
        for e, qt in enumerate(unstack_experts(stack)):
            for key, array in to_checkpoint(qt, FP8_BLOCK).items():
                out[_deepseek_name(module, e, proj, key)] = array
    return out
