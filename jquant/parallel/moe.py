"""A mixture-of-experts layer (``jquant.models.MoE``) split over a ``("tp",)`` mesh, quantized experts included.

Two splits of the routed experts (``MoEParallel.mode``), as vLLM's fused MoE offers them:

- ``"expert"`` (expert parallelism): device i holds experts ``[i·E/n, (i+1)·E/n)`` whole, with their
  biases. Every device routes every token (the router is replicated and small), runs the grouped GEMMs
  over the pairs of its own experts only, and weights them; a token's output is the sum over devices.
  A stack's codes, scales, zero points and per-expert global scales split along the expert axis, so
  every format whose blocks stay inside one expert carries over untouched.
- ``"tensor"``: every device holds every expert with ``I/n`` of its intermediate features: device i's
  gate/up stack is its gate rows next to its up rows (``[gate_i | up_i]``, which no contiguous split of
  the fused ``[gate | up]`` stack gives), its down stack the matching input columns; the down bias is
  added on device 0 only. A split that would cut a quantization group or a 128 × 128 FP8 block is
  refused with the parameter named.

The shared expert, if any, is split Megatron-style in both modes (gate/up column parallel, down row
parallel). Each device's output is a partial sum, and one all-reduce per layer (``Collectives``:
``"psum"``, or FP8 with ``"fp8"`` / ``"fp8_rs"``) gives every device the layer's output.

Expert parallelism reads each expert's bytes on one device only, so its weight traffic per device is
1/n of the layer's at any token count, but a device's work follows the routing (the experts the tokens
chose); the tensor split shares every expert's work evenly and reads 1/n of every expert the tokens
chose. Quantized stacks are laid out per device for that device's kernel after the split
(``prepare_experts``), as a kernel layout cannot be split after the fact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jquant.flax.linen import intercept_quantized
from jquant.flax.sharding import tensor_parallel_shardings
from jquant.kernels.moe.api import prepare_experts
from jquant.kernels.moe.experts import QExperts, join_rows, split_rows
from jquant.models.moe import MoE
from jquant.parallel.collectives import COLLECTIVES, Collectives
from jquant.parallel.llama import tp_mesh
from jquant.parallel.placement import (Sharded, _as_qtensor_param, _piece_specs, _prepare, _split_axes,
                                       local_params, local_qtensor_metadata, param_specs)
from jquant.schemes.qparam import QParam

MODES = ("expert", "tensor")
_SHARED_COLUMN = r"shared_expert/(gate|up)_proj/kernel"
_SHARED_ROW = r"shared_expert/down_proj/kernel"
# The two halves of a tensor-split gate_up stack (and bias), placed apart and joined per device.
_GATE, _UP = "gate_up_proj:gate", "gate_up_proj:up"
_GATE_B, _UP_B = "gate_up_bias:gate", "gate_up_bias:up"


@dataclasses.dataclass(frozen=True)
class MoEParallel:
    """How ``module`` runs over the one axis ``axis`` of ``mesh``: ``mode`` (``"expert"`` or
    ``"tensor"``, see the module docstring), ``collectives`` (how the devices' partial outputs are
    summed: ``"psum"``, ``"fp8"``, ``"fp8_rs"``). ``local_collectives``: the all-reduce replaced by a
    stand-in that moves nothing (timing only: the output is wrong). ``moe_parallel(module, n)`` builds one
    over the first n devices; ``shard_moe_params`` places a layer's parameters; ``apply`` runs the layer.

    Examples:
      >>> import jax
      >>> from jquant.models.moe import MoE
      >>> from jquant.parallel import moe_parallel
      >>> layer = MoE(num_experts=8, top_k=2, hidden=64, intermediate=32)
      >>> plan = moe_parallel(layer, 1, mode="tensor")
      >>> plan.local_module.intermediate, plan.local_module.num_experts
      (32, 8)
      >>> moe_parallel(MoE(num_experts=6, top_k=2, hidden=64, intermediate=32), 4)
      Traceback (most recent call last):
          ...
      ValueError: expert parallelism over 4 devices needs num_experts (6) divisible by 4
    """

    module: MoE
    mesh: Mesh
    mode: str = "expert"
    collectives: str = "psum"
    axis: str = "tp"
    local_collectives: bool = False

    def __post_init__(self):
        if not isinstance(self.module, MoE):
            raise TypeError(f"module must be a jquant.models.MoE, got {type(self.module).__name__}")
        if self.mesh.axis_names != (self.axis,):
            raise ValueError(f"the mesh must have the one axis {self.axis!r}, got {self.mesh.axis_names}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        if self.module.expert_axis is not None:
            raise ValueError("module already has an expert_axis; pass the MoE as it runs on one device")
        m, n = self.module, self.tp
        what = "expert parallelism" if self.mode == "expert" else "tensor parallelism"
        sizes = {"num_experts": m.num_experts} if self.mode == "expert" else {"intermediate": m.intermediate}
        if m.shared_expert:
            sizes["shared_intermediate"] = self._shared_intermediate
        if self.collectives == "fp8_rs":
            sizes["hidden"] = m.hidden
        for name, size in sizes.items():
            if size % n:
                raise ValueError(f"{what} over {n} devices needs {name} ({size}) divisible by {n}")

    @property
    def tp(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def _shared_intermediate(self) -> int:
        return self.module.shared_intermediate or self.module.intermediate

    @property
    def local_module(self) -> MoE:
        """The layer one device runs (its experts or its intermediate slice, its shared-expert slice)."""
        m, n = self.module, self.tp
        shared = self._shared_intermediate // n
        if self.mode == "expert":
            return m.clone(expert_axis=self.axis, shared_intermediate=shared)
        return m.clone(intermediate=m.intermediate // n, shared_intermediate=shared)

    @property
    def comm(self) -> Collectives:
        return Collectives(self.collectives, self.axis, self.tp, self.local_collectives)

    def apply(self, variables: Any, x: jax.Array) -> jax.Array:
        """``module.apply(variables, x)`` run on the mesh: ``variables`` from ``shard_moe_params``, ``x``
        replicated; returns the layer's output, replicated. Quantized shared-expert kernels run their
        scheme (``intercept_quantized``). Jit it for speed."""
        module, comm = self.local_module, self.comm

        def body(variables, x):
            with intercept_quantized():
                y = module.apply(local_params(variables), x)
            return comm.all_reduce(y)

        # check_vma off: the FP8 all-gather's sums are the same on every device by construction.
        run = jax.shard_map(body, mesh=self.mesh, in_specs=(param_specs(variables, self.axis), P()),
                            out_specs=P(), check_vma=False)
        return run(variables, x)


def moe_parallel(module: MoE, tp: int, *, devices=None, **options) -> MoEParallel:
    """A ``MoEParallel`` of ``module`` over the first ``tp`` of ``devices`` (default ``jax.devices()``);
    ``options``: the other fields (``mode``, ``collectives``, ``local_collectives``).

    Examples:
      >>> from jquant.models.moe import MoE
      >>> from jquant.parallel import moe_parallel
      >>> plan = moe_parallel(MoE(num_experts=8, top_k=2, hidden=64, intermediate=32), 1, collectives="fp8")
      >>> plan.mode, plan.collectives, plan.mesh.axis_names
      ('expert', 'fp8', ('tp',))
    """
    return MoEParallel(module, tp_mesh(tp, devices), **options)


def _split_spec(split: tuple[bool, ...], axis: str) -> P:
    return P(*(axis if cut else None for cut in split))


def _halves(path: str, value, intermediate: int):
    """A gate_up stack or bias as its gate and up halves (rows ``[0, I)``, ``[I, 2I)``)."""
    if isinstance(value, QExperts):
        qt, i = value.weight, intermediate
        if len(qt.block) == 3 and qt.block[1] == qt.shape[1] > 1:
            # One scale for all rows (per-tensor FP8): each half keeps it, as a block of its own rows.
            halves = [qt.replace(data=qt.data[:, rows], shape=(qt.shape[0], i, qt.shape[2]),
                                 block=(qt.block[0], i, qt.block[2])) for rows in (slice(0, i), slice(i, 2 * i))]
        else:
            try:
                halves = split_rows(qt, [i, i])
            except ValueError as e:
                raise ValueError(f"parameter {path!r}: {e}") from e
        return tuple(QExperts(h, value.scheme) for h in halves)
    return value[:, :intermediate], value[:, intermediate:]


def _plan(plan: MoEParallel, flat: dict) -> tuple[dict, dict]:
    """``(values, splits)``: the routed-expert parameters as they are placed (a tensor-split gate_up as
    its two halves) and, for each, which of its logical axes are cut; the rest is not in ``splits``."""
    expert = plan.mode == "expert"
    values, splits = dict(flat), {}
    for path, value in flat.items():
        if path in ("gate_up_proj", "down_proj") and not isinstance(value, QExperts) and not hasattr(value, "ndim"):
            raise ValueError(f"parameter {path!r} is laid out for a kernel ({type(value).__name__}); shard the "
                             "QExperts before prepare_experts: each device's piece is laid out after the split")
        if isinstance(value, QExperts) and value.weight.group_index is not None:
            raise ValueError(f"parameter {path!r}: act-order group_index cannot be split across devices")
        if path in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias") and expert:
            splits[path] = (True,) + (False,) * (len(value.shape) - 1)
        elif path in ("gate_up_proj", "gate_up_bias"):
            del values[path]
            names = (_GATE, _UP) if path == "gate_up_proj" else (_GATE_B, _UP_B)
            for name, half in zip(names, _halves(path, value, plan.module.intermediate)):
                values[name] = half
                splits[name] = (False, True) + (False,) * (len(half.shape) - 2)
        elif path == "down_proj":
            splits[path] = (False, False, True)
    return values, splits


def _place(plan: MoEParallel, values: dict, splits: dict) -> dict:
    """``values`` put on the mesh: routed-expert parameters as ``splits`` says (a QExperts' codes, scales
    and zero points along the same axes, a split through a block refused), the shared expert's kernels
    column / row parallel, the rest replicated."""
    mesh, axis = plan.mesh, plan.axis
    placed = {}
    for path, value in values.items():
        if path not in splits or path.startswith("shared_expert/"):
            continue
        sharding = NamedSharding(mesh, _split_spec(splits[path], axis))
        if isinstance(value, QExperts):
            try:
                tree = value.weight.sharding_tree(sharding)
            except ValueError as e:
                raise ValueError(f"parameter {path!r}: {e}") from e
            placed[path] = QExperts(jax.device_put(value.weight, tree), value.scheme)
        else:
            placed[path] = jax.device_put(value, sharding)
    rest = {p: v for p, v in values.items() if p not in placed}
    shardings = tensor_parallel_shardings(traverse_util.unflatten_dict(rest, sep="/"), mesh, column=_SHARED_COLUMN,
                                          row=_SHARED_ROW, axis=axis)
    placed.update(traverse_util.flatten_dict(jax.device_put(traverse_util.unflatten_dict(rest, sep="/"), shardings),
                                             sep="/"))
    return placed


def shard_moe_params(plan: MoEParallel, variables: dict) -> dict:
    """``variables`` (``{"params": ...}`` of ``plan.module``: expert stacks float or ``QExperts``, not yet
    laid out by ``prepare_experts``; shared-expert kernels float or QParams) as the devices of
    ``plan.mesh`` hold them: split parameters become ``Sharded`` (each device's piece with its own
    shape, laid out for its device's kernel), the router replicated. Feeds ``MoEParallel.apply``.

    Examples:
      Eight experts over two devices, each holding four, give the single-device layer's output:

      >>> import jax, jax.numpy as jnp
      >>> from jquant.models.moe import MoE
      >>> from jquant.parallel import moe_parallel, shard_moe_params
      >>> layer = MoE(num_experts=8, top_k=2, hidden=64, intermediate=32)
      >>> x = jax.random.normal(jax.random.key(1), (5, 64))
      >>> variables = layer.init(jax.random.key(0), x)
      >>> plan = moe_parallel(layer, min(2, jax.device_count()), mode="expert")
      >>> sharded = shard_moe_params(plan, variables)
      >>> sharded["params"]["down_proj"].pieces.addressable_shards[0].data.shape == (8 // plan.tp, 64, 32)
      True
      >>> bool(jnp.allclose(plan.apply(sharded, x), layer.apply(variables, x), atol=1e-5))
      True
    """
    if "params" not in variables:
        raise ValueError("shard_moe_params takes the layer's variables, {'params': ...}")
    flat = {p: _as_qtensor_param(p, v) for p, v in traverse_util.flatten_dict(dict(variables["params"]),
                                                                                 sep="/").items()}
    values, splits = _plan(plan, flat)
    placed = _place(plan, values, splits)
    axis, mesh, n = plan.axis, plan.mesh, plan.tp
    for path, value in placed.items():  # the shared expert's splits, read off its placement
        if path.startswith("shared_expert/") and any(cut := _split_axes(value, axis)):
            splits[path] = cut
    local = {p: local_qtensor_metadata(p.split(":")[0], v.weight if isinstance(v, QExperts) else v.qtensor,
                                       splits[p], n, v.scheme)
             for p, v in placed.items() if p in splits and isinstance(v, (QExperts, QParam))}
    owned = {p: placed[p] for p in splits}
    if plan.mode == "tensor" and "down_bias" in placed:
        owned["down_bias"] = placed["down_bias"]

    def body(owned):  # the device's pieces, with their own metadata; one compiled program for all
        piece = {}
        for p, v in owned.items():
            if p in local:
                shape, block = local[p]
                if isinstance(v, QExperts):
                    v = QExperts(v.weight.replace(shape=shape, block=block), v.scheme)
                else:
                    v = dataclasses.replace(v, weight=v.weight.replace(shape=shape, block=block))
            piece[p] = v
        if _GATE in piece:
            gate, up = piece.pop(_GATE), piece.pop(_UP)
            piece["gate_up_proj"] = (QExperts(join_rows([gate.weight, up.weight]), gate.scheme)
                                     if isinstance(gate, QExperts) else jnp.concatenate([gate, up], axis=1))
        if _GATE_B in piece:
            piece["gate_up_bias"] = jnp.concatenate([piece.pop(_GATE_B), piece.pop(_UP_B)], axis=1)
        if plan.mode == "tensor" and "down_bias" in piece:  # every device's partial would add it: device 0's only
            bias = piece["down_bias"]
            piece["down_bias"] = jnp.where(jax.lax.axis_index(axis) == 0, bias, jnp.zeros((), bias.dtype))
        return piece

    in_specs = (jax.tree.map(lambda a: a.sharding.spec, owned),)
    shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False), owned)
    pieces = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=_piece_specs(shapes, axis),
                                   check_vma=False))(owned)
    out = {p: v for p, v in placed.items() if p not in owned}
    for p, v in pieces.items():
        quantized = isinstance(v, (QExperts, QParam))
        out[p] = (_prepare(Sharded(v), mesh, axis, prepare_experts if isinstance(v, QExperts) else None)
                  if quantized else Sharded(v))
    return {**variables, "params": traverse_util.unflatten_dict(out, sep="/")}
