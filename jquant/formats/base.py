"""The quantizer registry: format name → ``quantize(x, **options) -> QTensor``, and the reference
presets: ``quantize(x, fmt, like="torchao")`` sets every option that makes ``fmt`` match one library.

``quantize`` runs each format's kernel as one compiled program per format, shape and options
(array options traced, the rest static), and records the blocked axis as the QTensor's ``k_axis``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from jquant.qtensor import QTensor

_QUANTIZERS: dict[str, Callable[..., QTensor]] = {}
_PRESETS: dict[tuple[str, str], dict[str, Any]] = {}


def register_quantizer(name: str, fn: Callable[..., QTensor]) -> None:
    """Makes ``quantize(x, name, **options)`` call ``fn(x, **options)`` (replacing any earlier ``name``).

    ``fn`` returns a QTensor whose ``fmt`` has a dequantizer: a new name for a family's quantizer with
    some options fixed needs nothing else.

    Examples:
      >>> import functools, numpy as np
      >>> from jquant.formats import formats, quantize, register_quantizer
      >>> from jquant.formats.integer import quantize_int
      >>> register_quantizer("int4_group32", functools.partial(quantize_int, bits=4, symmetric=True, group_size=32))
      >>> "int4_group32" in formats()
      True
      >>> qt = quantize(np.ones((2, 64), np.float32), "int4_group32")
      >>> qt.fmt, qt.block  # an ordinary int4 QTensor
      ('int4', (1, 32))
    """
    _QUANTIZERS[name] = fn


def register_preset(like: str, fmt: str, options: dict[str, Any]) -> None:
    """Declares the options with which format ``fmt`` reproduces library ``like`` bit for bit.

    Examples:
      >>> import numpy as np
      >>> from jquant.formats import quantize, register_preset
      >>> register_preset("my-lib", "int4", {"group_size": 32, "scale_dtype": "float16"})
      >>> w = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
      >>> qt = quantize(w, "int4", like="my-lib")
      >>> qt.block, str(qt.scale.dtype)
      ((1, 32), 'float16')
      >>> quantize(w, "int4", like="my-lib", group_size=64)
      Traceback (most recent call last):
          ...
      ValueError: like='my-lib' sets group_size=32 for 'int4'; got group_size=64
    """
    _PRESETS[(like, fmt)] = dict(options)


def formats() -> tuple[str, ...]:
    """Names accepted by ``quantize``.

    Examples:
      >>> from jquant.formats import formats
      >>> {"int4", "uint4", "fp8_e4m3", "mxfp4", "nvfp4", "nf4"} <= set(formats())
      True
    """
    return tuple(sorted(_QUANTIZERS))


def presets() -> dict[str, tuple[str, ...]]:
    """Reference library → the formats it has a preset for (the values ``like=`` takes).

    Examples:
      >>> from jquant.formats import presets
      >>> presets()["modelopt"]
      ('mxfp8_e4m3', 'nvfp4')
      >>> {"mxfp4", "nvfp4"} <= set(presets()["torchao"])
      True
    """
    out: dict[str, list[str]] = {}
    for like, fmt in sorted(_PRESETS):
        out.setdefault(like, []).append(fmt)
    return {like: tuple(fmts) for like, fmts in out.items()}


def preset_options(like: str, fmt: str) -> dict[str, Any]:
    """The options ``quantize(x, fmt, like=like)`` passes to the format; a ValueError names the
    libraries that do have a preset for ``fmt`` when ``like`` has none.

    Examples:
      >>> from jquant.formats import preset_options
      >>> preset_options("modelopt", "nvfp4")
      {'convention': 'modelopt'}
      >>> preset_options("modelopt", "int4")
      Traceback (most recent call last):
          ...
      ValueError: no 'modelopt' preset for format 'int4'; presets for 'int4': ['compressed-tensors'] ...
    """
    if not isinstance(like, str):
        raise TypeError(f"like must be a reference library name (str), got {type(like).__name__}")
    if (like, fmt) not in _PRESETS:
        known = sorted(lib for lib, f in _PRESETS if f == fmt)
        raise ValueError(f"no {like!r} preset for format {fmt!r}; presets for {fmt!r}: {known or 'none'} "
                         f"(all presets: {presets()})")
    return dict(_PRESETS[(like, fmt)])


def quantize(x: Any, fmt: str, *, like: str | None = None, **options) -> QTensor:
    """Quantizes ``x`` to format ``fmt``; ``options`` are the format's own (axis, group_size, ...).

    ``like`` names a reference library (``presets()`` lists them): its preset sets the options that make
    the codes and scales bit-identical to that library's; an explicit option that contradicts the preset
    raises, one the preset does not set (axis, group_size, ...) is passed on.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
      >>> qt = jquant.quantize(w, "int4", group_size=32)  # groups along the last axis
      >>> qt.fmt, qt.block, qt.k_axis
      ('int4', (1, 32), 1)
      >>> bool(jnp.abs(qt.dequantize() - w).max() <= qt.scale.max() / 2)  # at most half a step off
      True
      >>> jquant.quantize(w, "nvfp4", like="modelopt").block  # modelopt's NVFP4: 16 E2M1 values a scale
      (1, 16)
      >>> qb = jquant.quantize(w.astype(jnp.bfloat16), "int4", group_size=32, like="compressed-tensors")
      >>> print(qb.scale.dtype)  # compressed-tensors keeps scales in the weight's dtype
      bfloat16
    """
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a format name (str), got {type(fmt).__name__}")
    fn = _QUANTIZERS.get(fmt)
    if fn is None:
        raise ValueError(f"unknown format {fmt!r}; known formats: {formats()}")
    if like is not None:
        preset = preset_options(like, fmt)
        clash = sorted(k for k in options if k in preset and options[k] != preset[k])
        if clash:
            raise ValueError(f"like={like!r} sets {', '.join(f'{k}={preset[k]!r}' for k in clash)} for {fmt!r}; "
                             f"got {', '.join(f'{k}={options[k]!r}' for k in clash)}")
        options = preset | options
    return _with_k_axis(_run(fn, x, options))


@dataclasses.dataclass(frozen=True)
class _StaticOptions:
    """Non-array options as a jit cache key that tells ``1``, ``1.0`` and ``True`` (equal in Python)
    apart, and ``0.0`` from ``-0.0``, so a cached trace never skips a format's own option checks."""

    options: tuple[tuple[str, Any], ...] = dataclasses.field(compare=False)
    key: tuple = ()

    @classmethod
    def of(cls, options: dict[str, Any]) -> "_StaticOptions":
        items = tuple(sorted(options.items()))
        return cls(items, tuple((k, _typed(v)) for k, v in items))


def _typed(value):
    if isinstance(value, tuple):
        return (tuple, tuple(_typed(v) for v in value))
    if isinstance(value, (float, np.floating)):
        return (type(value), repr(value))
    hash(value)  # TypeError for unhashable options (lists, dicts)
    return (type(value), value)


def _traceable(value) -> bool:
    """An array ``jit`` passes through unchanged (it would turn float64 into float32 and give lists
    one tracer per element, which the formats' own input checks must see as they are)."""
    return (isinstance(value, (jax.Array, np.ndarray, np.generic))
            and jax.dtypes.canonicalize_dtype(value.dtype) == value.dtype)


# Eager, the int and FP8 kernels dispatch dozens of ops one by one: int4 g128 of a 4096×4096 fp32
# weight took 1.33 s eager and 0.15 s as one program (int8 per channel 1.06 → 0.11 s, FP8 per channel
# 1.07 → 0.20 s; 2-core CPU, jax 0.11.2). Same ops, so the same bits.
@functools.partial(jax.jit, static_argnums=(0, 3))
def _compiled(fn, x, arrays, static: _StaticOptions):
    return fn(x, **arrays, **dict(static.options))


def _run(fn, x, options: dict[str, Any]) -> QTensor:
    arrays = {k: v for k, v in options.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = {k: v for k, v in options.items() if k not in arrays}
    if not all(_traceable(v) for v in (x, *arrays.values())):
        return fn(x, **options)
    try:
        key = _StaticOptions.of(static)
    except TypeError:
        return fn(x, **options)
    return _compiled(fn, x, arrays, key)


def _with_k_axis(qt: QTensor) -> QTensor:
    if not isinstance(qt, QTensor) or qt.k_axis is not None:
        return qt
    axis = blocked_axis(qt)
    return qt if axis is None else qt.replace(k_axis=axis)


def blocked_axis(qt: QTensor) -> int | None:
    """The one axis ``qt``'s blocks run along (groups, channels), or None (per tensor, 2-D tiles).

    Blocks of the flattened tensor (bitsandbytes) run along its last axis, as checkpoints read them.
    """
    if len(qt.block) != qt.ndim:
        return qt.ndim - 1
    if qt.block == qt.shape:
        return None
    along = [i for i, b in enumerate(qt.block) if b > 1]
    return along[0] if len(along) == 1 else None
