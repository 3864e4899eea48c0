"""QTensor: a quantized array as a pytree of packed codes, scales and static metadata.

Array leaves (``data``, ``scale``, ``zero``, ``global_scale``) move through ``jit``, ``vmap``,
``tree_map``, donation and ``device_put``; everything needed to interpret them is static metadata,
so a QTensor's treedef pins its format and logical shape.

Block convention: ``block[i]`` is the extent of one quantization block along logical axis ``i``
(per-tensor: ``block == shape``; per-output-channel of a [N, K] weight: ``(1, K)``; group 128
along K: ``(1, 128)``). ``scale`` (and ``zero``) then have shape ``ceil(shape / block)``, the same
rank as the data, so one ``PartitionSpec`` shards data and scales consistently. Formats that block a
flattened tensor (bitsandbytes) use ``block=(blocksize,)`` over ``shape`` flattened.

Orientation: ``k_axis`` records which logical axis is the contraction (K, input-feature) axis of a
matmul weight, or None where that is unknown. Every product with a QTensor weight contracts the last
axis of ``x`` with the weight's K axis and returns ``[..., N]``: ``qdot`` along ``k_axis`` (axis 0,
``jnp.dot``'s ``[K, N]``, when unknown), ``Scheme.apply`` and ``w4a16_matmul`` on ``[N, K]`` weights
(PyTorch's ``x @ W.T``); a weight whose recorded K axis is not the one a product needs is refused
with a ValueError rather than silently transposed. ``formats.quantize`` records the axis a format
blocks along (groups, channels), checkpoint loaders the last axis of their ``[N, K]`` weights.

Dtypes: ``dequantize(dtype)`` returns exactly ``dtype`` (any floating dtype), float32 when none is
given, for every format; ``QTensor.dtype`` only records the dtype of the array that was quantized
(or the one a checkpoint loader was asked for), so ``qt.dequantize(qt.dtype)`` gives it back in it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

DequantizeFn = Callable[["QTensor", Any], jax.Array]

_DEQUANTIZERS: dict[str, DequantizeFn] = {}


def register_format(name: str, dequantize_fn: DequantizeFn) -> None:
    """Registers how QTensors of format ``name`` turn back into floats."""
    _DEQUANTIZERS[name] = dequantize_fn


def registered_formats() -> tuple[str, ...]:
    return tuple(sorted(_DEQUANTIZERS))


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized tensor.

    Attributes:
      data: packed codes (uint8 / int8 / float8 / ...; several codes per byte for sub-byte formats).
      scale: per-block scales, shape ``ceil(shape / block)``; a nested QTensor for double quantization.
      zero: optional per-block zero points (same shape as ``scale``).
      global_scale: optional per-tensor scale (NVFP4), a 0-d array.
      group_index: optional int32 map from each index along the grouped axis to its group (GPTQ
        act-order ``g_idx``) along ``grouped_axis``; None means index ``i`` is in group ``i // block``.
      fmt: format name, a key of the format registry (``"int4"``, ``"fp8_e4m3"``, ``"mxfp4"``, ...).
      shape: logical (unquantized) shape.
      dtype: dtype of the array that was quantized (informational: ``dequantize`` returns float32
        unless asked for another dtype, see the module docstring).
      block: block extent per logical axis (see module docstring).
      pack_axis: axis along which sub-byte codes are packed, or None when stored one per element.
      options: format-specific static settings as sorted ``(key, value)`` pairs.
      k_axis: the logical axis that is the contraction (K) axis of a matmul weight, or None when
        unknown (see the module docstring).

    Examples:
      >>> import jax, numpy as np, jquant
      >>> w = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
      >>> qt = jquant.quantize(w, "int4", group_size=4)
      >>> qt.fmt, qt.shape, qt.block, qt.k_axis
      ('int4', (4, 8), (1, 4), 1)
      >>> qt.data.shape, str(qt.data.dtype), qt.scale.shape  # two codes a byte, a scale a group
      ((4, 4), 'uint8', (4, 2))
      >>> qt.nbytes, qt.bits_per_weight  # 16 bytes of codes + 8 float32 scales
      (48, 12.0)

      A QTensor is a pytree: its arrays cross ``jit``, its metadata is static.

      >>> len(jax.tree_util.tree_leaves(qt))
      2
      >>> jax.jit(lambda q: q.dequantize())(qt).shape
      (4, 8)
    """

    data: jax.Array
    scale: Any
    zero: jax.Array | None = None
    global_scale: jax.Array | None = None
    group_index: jax.Array | None = None
    fmt: str = ""
    shape: tuple[int, ...] = ()
    dtype: Any = jnp.float32
    block: tuple[int, ...] = ()
    pack_axis: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    k_axis: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))
        if self.k_axis is not None:
            ndim = len(self.shape)
            if isinstance(self.k_axis, bool) or not isinstance(self.k_axis, (int, np.integer)) \
                    or not -ndim <= self.k_axis < ndim:
                raise ValueError(f"QTensor.k_axis must be None or an axis of shape {self.shape}, "
                                 f"got {self.k_axis!r}")
            object.__setattr__(self, "k_axis", int(self.k_axis) % ndim)

    # ---- metadata -------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def grouped_axis(self) -> int:
        """The axis ``group_index`` maps: the last axis whose block spans more than one element."""
        return max((i for i, b in enumerate(self.block) if b > 1), default=self.ndim - 1)

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored leaf: codes, scales (nested included), zeros, global scale."""
        return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(self))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.size

    # ---- conversion -----------------------------------------------------------------------------
    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The float tensor this stands for, in ``dtype`` (any floating dtype; default float32)."""
        dtype = _float_dtype(dtype, self.fmt)
        fn = _DEQUANTIZERS.get(self.fmt)
        if fn is None:
            raise ValueError(f"QTensor.fmt={self.fmt!r} has no registered dequantizer; "
                             f"known formats: {registered_formats()}")
        out = fn(self, dtype)
        return out if out.dtype == dtype else out.astype(dtype)

    def expand(self, values: jax.Array) -> jax.Array:
        """Broadcasts per-block ``values`` (scales, zeros) to the logical shape, honouring ``group_index``."""
        if self.group_index is None:
            return expand_blocks(values, self.shape, self.block)
        axis = self.grouped_axis
        out = jnp.take(values, self.group_index, axis=axis)
        other = tuple(1 if i == axis else b for i, b in enumerate(self.block))
        return expand_blocks(out, self.shape, other)

    def replace(self, **changes) -> "QTensor":
        return dataclasses.replace(self, **changes)

    def sharding_tree(self, sharding: jax.sharding.NamedSharding) -> "QTensor":
        """Per-leaf shardings for ``jax.device_put``: leaves of the data's rank take ``sharding``'s
        spec (so scales split along the same axes as the codes); lower-rank leaves are replicated.

        Raises ValueError when a sharded axis would split a quantization block.
        """
        spec = tuple(sharding.spec) + (None,) * (self.ndim - len(sharding.spec))
        mesh = sharding.mesh
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def parts_of(names):
            names = names if isinstance(names, tuple) else (names,)
            return math.prod(mesh.shape[n] for n in names)

        if len(self.block) != self.ndim:
            # Blocks run over the flattened tensor (bitsandbytes): only a split of the leading axis keeps
            # each shard's elements, and so its blocks, contiguous; 1-D leaves split the same way.
            if any(n is not None for n in spec[1:]):
                raise ValueError(f"fmt {self.fmt!r} blocks the flattened tensor: shard only axis 0, got spec {spec}")
            if spec[0] is None:
                return jax.tree_util.tree_map(lambda leaf: replicated, self)
            parts = parts_of(spec[0])
            per_shard = self.size // parts
            if self.shape[0] % parts or per_shard % self.block[0]:
                raise ValueError(f"sharding splits axis 0 of shape {self.shape} into {parts} parts of "
                                 f"{per_shard} elements, not a multiple of the block {self.block[0]}: "
                                 "a shard would cut a block")
            flat = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(spec[0]))
            return jax.tree_util.tree_map(
                lambda leaf: flat if leaf.ndim == 1 and leaf.shape[0] % parts == 0 else replicated, self)

        for axis, names in enumerate(spec):
            if names is None:
                continue
            parts = parts_of(names)
            nblocks = -(-self.shape[axis] // self.block[axis])
            # One block spanning the axis (per-channel scales under row parallelism) splits the codes
            # only: its scale is needed whole by every shard, so scale leaves replicate that axis.
            if nblocks != 1 and nblocks % parts:
                raise ValueError(
                    f"sharding splits axis {axis} of shape {self.shape} into {parts} parts, but it "
                    f"holds {nblocks} quantization blocks of {self.block[axis]}: a shard would cut a block")

        def leaf_sharding(leaf):
            if leaf.ndim != self.ndim:
                return replicated
            leaf_spec = tuple(None if leaf.shape[i] == 1 and self.shape[i] != 1 else n for i, n in enumerate(spec))
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*leaf_spec))

        return jax.tree_util.tree_map(leaf_sharding, self)


jax.tree_util.register_dataclass(
    QTensor,
    data_fields=["data", "scale", "zero", "global_scale", "group_index"],
    meta_fields=["fmt", "shape", "dtype", "block", "pack_axis", "options", "k_axis"],
)


def _float_dtype(dtype: Any, fmt: str) -> np.dtype:
    if dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"dequantize (QTensor fmt={fmt!r}): dtype must be a floating dtype such as "
                        f"jnp.float32 or jnp.bfloat16, got {dtype!r}") from err
    # issubdtype, not dt.kind: ml_dtypes' bfloat16 and float8 types have kind 'V'.
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dequantize (QTensor fmt={fmt!r}) returns floats: dtype must be a floating "
                        f"dtype such as jnp.float32 or jnp.bfloat16, got {dt}; cast the result instead")
    return dt


def dequantize(qt: QTensor, dtype: Any = None) -> jax.Array:
    """Returns the float tensor ``qt`` stands for (see ``QTensor.dequantize``).

    Examples:
      Integers up to 7 are exact in int4 with a scale of 1:

      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> qt = jquant.quantize(np.array([[7., -3., 2., 0.]], np.float32), "int4")
      >>> jquant.dequantize(qt).tolist()
      [[7.0, -3.0, 2.0, 0.0]]
      >>> print(jquant.dequantize(qt, jnp.bfloat16).dtype)
      bfloat16
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"dequantize expects a QTensor, got {type(qt).__name__}")
    return qt.dequantize(dtype)


def expand_blocks(values: jax.Array, shape: tuple[int, ...], block: tuple[int, ...]) -> jax.Array:
    """Broadcasts per-block ``values`` (shape ``ceil(shape/block)``) to every element of ``shape``."""
    out = values
    for axis, (size, b) in enumerate(zip(shape, block)):
        if b != 1:
            out = jnp.repeat(out, b, axis=axis)
        if out.shape[axis] != size:
            out = jax.lax.slice_in_dim(out, 0, size, axis=axis)
    return out
