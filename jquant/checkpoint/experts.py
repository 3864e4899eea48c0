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

``moe_stack_to_tensors`` exports one expert stack of a ``jquant.models.moe.MoE`` layer (its
``gate_up_proj`` holds gate rows then up rows, not gpt-oss's interleave) in either layout; the
safetensors writer calls it for ``QExperts`` leaves. ``check_stack_arrays`` checks a stack's arrays
against its metadata (expert count, shapes) before it is saved, restored or exported.
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
from jquant.kernels.moe.experts import check_stack, split_rows, stack_experts, unstack_experts
from jquant.qtensor import QTensor

GPT_OSS = "gpt-oss"
FP8_BLOCK = "fp8-block"
DEEPSEEK_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The layouts expert stacks export to (moe_stack_to_tensors), and the bias a MoE layer keeps beside each
# stack (jquant.models.moe: gate_up_bias [E, 2I] in halves, down_bias [E, H]).
STACK_LAYOUTS = (GPT_OSS, FP8_BLOCK)
LAYER_BIASES = {"gate_up_proj": "gate_up_bias", "down_proj": "down_bias"}


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


def _gpt_oss_tensors(proj: str, stacks: list[QTensor], biases: list, module: str) -> dict[str, np.ndarray]:
    """``stacks`` (gate and up, or down alone) as gpt-oss's ``<proj>_blocks`` / ``_scales`` / ``_bias``,
    two stacks interleaved row by row (even rows the first)."""
    parts = [to_checkpoint(qt, GPT_OSS) for qt in stacks]
    join = (lambda xs: _interleave(*xs)) if len(stacks) == 2 else (lambda xs: xs[0])
    blocks_name, scales_name, bias_name = _gpt_oss_names(module, proj)
    out = {blocks_name: join([p["blocks"] for p in parts]), scales_name: join([p["scales"] for p in parts])}
    if biases[0] is not None:
        out[bias_name] = join([np.asarray(b) for b in biases])
    return out


def gpt_oss_experts_to_tensors(weights: ExpertWeights, module: str = "mlp.experts") -> dict[str, np.ndarray]:
    """The inverse of ``load_gpt_oss_experts``: the checkpoint's tensors, gate and up interleaved again."""
    if (weights.gate_bias is None) != (weights.up_bias is None):
        raise ValueError("gpt-oss stores one gate_up_proj_bias: give both gate_bias and up_bias, or neither")
    return {**_gpt_oss_tensors("gate_up_proj", [weights.gate, weights.up], [weights.gate_bias, weights.up_bias],
                               module),
            **_gpt_oss_tensors("down_proj", [weights.down], [weights.down_bias], module)}


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


def _deepseek_tensors(proj: str, stack: QTensor, module: str) -> dict[str, np.ndarray]:
    out = {}
    for e, qt in enumerate(unstack_experts(stack)):
        for key, array in to_checkpoint(qt, FP8_BLOCK).items():
            out[_deepseek_name(module, e, proj, key)] = array
    return out


def deepseek_experts_to_tensors(weights: ExpertWeights, module: str = "mlp.experts") -> dict[str, np.ndarray]:
    """The inverse of ``load_deepseek_experts``: ``weight`` and ``weight_scale_inv`` per expert and projection."""
    if any(b is not None for b in (weights.gate_bias, weights.up_bias, weights.down_bias)):
        raise ValueError("DeepSeek-V3 experts have no biases; this ExpertWeights holds some")
    out = {}
    for proj, stack in zip(DEEPSEEK_PROJECTIONS, (weights.gate, weights.up, weights.down)):
        out.update(_deepseek_tensors(proj, stack, module))
    return out


# ---- one stack of a MoE layer ------------------------------------------------------------------------

def check_stack_arrays(qt: Any, name: str = "experts") -> QTensor:
    """``check_stack``, and the arrays agree with the metadata: codes ``[E, N, K]`` (the packed axis
    shorter), scales and zero points one per block; raises a ValueError naming ``name`` otherwise.
    Stacks whose blocks run over the flattened tensor (bitsandbytes) are checked as ``check_stack`` does.

    Examples:
      >>> import numpy as np
      >>> from jquant.checkpoint.experts import check_stack_arrays
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> qt = quantize_expert_weights(np.ones((4, 8, 64), np.float32), "mxfp4")
      >>> check_stack_arrays(qt).shape
      (4, 8, 64)
      >>> check_stack_arrays(qt.replace(scale=qt.scale[:3]), "gate_up_proj")
      Traceback (most recent call last):
          ...
      ValueError: gate_up_proj: scale has shape (3, 8, 2), but a (4, 8, 64) stack with blocks (1, 1, 32)
      needs (4, 8, 2)
    """
    check_stack(qt, name)
    if len(qt.block) != qt.ndim:
        return qt
    blocks = tuple(-(-s // b) for s, b in zip(qt.shape, qt.block))
    for field in ("data", "scale", "zero"):
        leaf = getattr(qt, field)
        if leaf is None or isinstance(leaf, QTensor):
            continue
        got = tuple(getattr(leaf, "shape", ()))
        if field == "data":
            ok = len(got) == 3 and all(g == s for a, (g, s) in enumerate(zip(got, qt.shape)) if a != qt.pack_axis)
            want = "codes [E, N, K]" + ("" if qt.pack_axis is None else f" (axis {qt.pack_axis} packed)")
        else:
            ok, want = got == blocks, str(blocks)
        if not ok:
            raise ValueError(f"{name}: {field} has shape {got}, but a {qt.shape} stack with blocks {qt.block} "
                             f"needs {want}")
    return qt


def moe_stack_to_tensors(param: str, stack: QTensor, layout: str | None, module: str = "mlp.experts", *,
                         bias: Any = None, name: str | None = None) -> dict[str, np.ndarray]:
    """One expert stack of a ``jquant.models.moe.MoE`` layer as its format's checkpoints store it.

    ``param``: the layer's parameter, ``"gate_up_proj"`` (``[E, 2I, H]``, gate rows ``[0, I)``, up rows
    ``[I, 2I)``) or ``"down_proj"`` (``[E, H, I]``); ``bias``: the layer's ``gate_up_bias`` ``[E, 2I]``
    (halves likewise) or ``down_bias`` ``[E, H]``, or None. ``layout``:

    * ``"gpt-oss"`` (MXFP4): ``<module>.<param>_blocks`` / ``_scales`` / ``_bias``, gate and up
      interleaved again (even rows gate), as ``load_gpt_oss_experts`` reads them;
    * ``"fp8-block"`` (DeepSeek-V3): ``<module>.<e>.{gate,up,down}_proj.weight`` / ``.weight_scale_inv``
      per expert, as ``load_deepseek_experts`` reads them; no bias (DeepSeek-V3 experts have none).

    Any other layout (or none) raises a ValueError naming the parameter (``name``, default ``param``),
    its format and the layouts stacks export to: no other expert checkpoint layout is implemented, and a
    stack written as some dense layout's single tensor would load as nothing any MoE loader reads.

    Examples:
      >>> import numpy as np
      >>> from jquant.checkpoint.experts import load_gpt_oss_experts, moe_stack_to_tensors
      >>> from jquant.kernels.moe import quantize_expert_weights, split_rows
      >>> rng = np.random.default_rng(0)
      >>> e, h, i = 2, 64, 32
      >>> gate_up = quantize_expert_weights(rng.standard_normal((e, 2 * i, h)).astype(np.float32), "mxfp4")
      >>> down = quantize_expert_weights(rng.standard_normal((e, h, i)).astype(np.float32), "mxfp4")
      >>> tensors = {**moe_stack_to_tensors("gate_up_proj", gate_up, "gpt-oss"),
      ...            **moe_stack_to_tensors("down_proj", down, "gpt-oss")}
      >>> sorted(tensors)
      ['mlp.experts.down_proj_blocks', 'mlp.experts.down_proj_scales',
       'mlp.experts.gate_up_proj_blocks', 'mlp.experts.gate_up_proj_scales']
      >>> tensors["mlp.experts.gate_up_proj_blocks"].shape  # [E, 2I, H/32, 16]
      (2, 64, 2, 16)
      >>> loaded = load_gpt_oss_experts(tensors)  # de-interleaves: the halves come back
      >>> gate, up = split_rows(gate_up, [i, i])
      >>> bool((loaded.up.data == up.data).all()), bool((loaded.gate.scale == gate.scale).all())
      (True, True)
      >>> moe_stack_to_tensors("down_proj", down, "gptq", name="layers_0/mlp/down_proj")
      Traceback (most recent call last):
          ...
      ValueError: parameter 'layers_0/mlp/down_proj': expert stacks (fmt 'mxfp4') export only in the gpt-oss
      MXFP4 layout ('gpt-oss') and the DeepSeek-V3 block-FP8 layout ('fp8-block'), not in layout 'gptq';
      save it with orbax (jquant.flax.orbax_io.save_quantized)
    """
    what = f"parameter {name or param!r}"
    base = None if layout is None else layout.split("/", 1)[0]
    if base not in STACK_LAYOUTS:
        fmt = getattr(stack, "fmt", type(stack).__name__)
        raise ValueError(f"{what}: expert stacks (fmt {fmt!r}) export only in the gpt-oss MXFP4 layout "
                         f"({GPT_OSS!r}) and the DeepSeek-V3 block-FP8 layout ({FP8_BLOCK!r}), not in layout "
                         f"{layout!r}; save it with orbax (jquant.flax.orbax_io.save_quantized)")
    if param not in LAYER_BIASES:
        raise ValueError(f"{what}: a MoE layer's expert stacks are {tuple(LAYER_BIASES)}, not {param!r}; the "
                         f"{base} names depend on which one it is")
    check_stack_arrays(stack, what)
    e, n, _ = stack.shape
    if bias is not None and (getattr(bias, "ndim", None) != 2 or tuple(bias.shape) != (e, n)):
        raise ValueError(f"{what}: its bias {LAYER_BIASES[param]!r} has shape {tuple(getattr(bias, 'shape', ()))}, "
                         f"expected one per expert and row, {(e, n)}")
    if base == FP8_BLOCK and bias is not None:
        raise ValueError(f"{what}: DeepSeek-V3 ({FP8_BLOCK!r}) expert checkpoints hold no biases, but the layer has "
                         f"{LAYER_BIASES[param]!r}")
    if stack.fmt != ("mxfp4" if base == GPT_OSS else "fp8_e4m3"):
        raise ValueError(f"{what}: layout {layout!r} stores {'mxfp4' if base == GPT_OSS else 'fp8_e4m3'} "
                         f"expert stacks, got fmt {stack.fmt!r}")
    try:
        if param == "gate_up_proj":
            if n % 2:
                raise ValueError(f"gate_up_proj [E, 2I, H] has an odd number of rows {n}")
            stacks = split_rows(stack, [n // 2, n // 2])
            halves = [None, None] if bias is None else [np.asarray(bias)[:, :n // 2], np.asarray(bias)[:, n // 2:]]
        else:
            stacks, halves = [stack], [bias]
        if base == GPT_OSS:
            return _gpt_oss_tensors(param, stacks, halves, module)
        projs = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
        return {k: v for proj, qt in zip(projs, stacks) for k, v in _deepseek_tensors(proj, qt, module).items()}
    except ValueError as err:
        raise ValueError(f"{what} ({stack.fmt}, shape {stack.shape}) cannot be written in layout {layout!r}: "
                         f"{err}") from err
