"""The checkpoint-layout registry: QTensor ⇄ the tensors a vLLM checkpoint stores.

A layout name may have variants (``"compressed-tensors"`` stores int4 as ``pack-quantized``, FP8 as
``float-quantized`` and NVFP4 as ``nvfp4-pack-quantized``). Each variant registers as
``"<layout>/<variant>"`` with the QTensor formats it writes and, optionally, a ``detect(tensors)``
that recognises its tensors; ``to_checkpoint(qt, "<layout>")`` then picks the variant by ``qt.fmt``
and ``from_checkpoint(tensors, "<layout>")`` by ``variant=`` or by detection.

Exports are exact: a layout whose storage dtypes cannot hold the QTensor's values (GPTQ's float16
scales of float32 ones, NVFP4's per-tensor scale as the other convention's reciprocal) raises a
ValueError naming the tensor, the dtypes, the largest change and how to quantize for it; such a layout
registers ``rounds=True`` and its export takes ``lossy=True`` to round anyway, with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import numpy as np

from jquant.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    to_fn: Callable[..., dict[str, np.ndarray]]
    from_fn: Callable[..., QTensor]
    fmts: tuple[str, ...] = ()
    detect: Callable[[dict], bool] | None = None
    rounds: bool = False  # to_fn takes lossy= (its storage dtypes may not hold every QTensor exactly)


_LAYOUTS: dict[str, Layout] = {}


def register_layout(name: str, to_fn, from_fn, fmts=(), detect=None, rounds: bool = False) -> None:
    """Adds checkpoint layout ``name`` (``"<layout>/<variant>"`` for a variant): ``to_fn(qt, **options)``
    gives its tensors, ``from_fn(tensors, **meta)`` the QTensor back; ``fmts`` are the QTensor formats it
    stores and ``detect(tensors)`` recognises its tensors among a layout's variants. The module docstring
    says which layouts register a ``to_fn`` that takes ``lossy=``.

    Examples:
      A layout that stores an int8 QTensor's codes and scales as they are:

      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.checkpoint import from_checkpoint, register_layout, to_checkpoint
      >>> def store(qt):
      ...     return {"weight": np.asarray(qt.data), "weight_scale": np.asarray(qt.scale)}
      >>> def load(tensors):
      ...     codes = jnp.asarray(tensors["weight"])
      ...     return jquant.QTensor(codes, jnp.asarray(tensors["weight_scale"]), fmt="int8",
      ...                           shape=codes.shape, block=(1, codes.shape[1]))
      >>> register_layout("raw-int8", store, load, fmts=("int8",))
      >>> w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
      >>> qt = jquant.quantize(w, "int8")
      >>> tensors = to_checkpoint(qt, "raw-int8")
      >>> sorted(tensors)
      ['weight', 'weight_scale']
      >>> back = from_checkpoint(tensors, "raw-int8")
      >>> back.k_axis, bool((back.dequantize() == qt.dequantize()).all())
      (1, True)
      >>> to_checkpoint(jquant.quantize(w, "int4"), "raw-int8")
      Traceback (most recent call last):
          ...
      ValueError: layout 'raw-int8' cannot store QTensor.fmt='int4'; it stores ['int8']
    """
    _LAYOUTS[name] = Layout(name, to_fn, from_fn, tuple(fmts), detect, rounds)


def layouts() -> tuple[str, ...]:
    """Registered layout names, variants as ``"<layout>/<variant>"`` (``to_checkpoint`` also takes the
    bare ``"<layout>"``).

    Examples:
      >>> import jquant
      >>> {"awq", "gptq", "fp8", "fp8-block", "bnb", "gpt-oss"} <= set(jquant.layouts())
      True
      >>> [name for name in jquant.layouts() if name.startswith("compressed-tensors/")]
      ['compressed-tensors/float-quantized', 'compressed-tensors/int-quantized',
       'compressed-tensors/mxfp4-pack-quantized', 'compressed-tensors/mxfp8-quantized',
       'compressed-tensors/nvfp4-pack-quantized',
       'compressed-tensors/pack-quantized']
    """
    return tuple(sorted(_LAYOUTS))


def _variants(layout: str) -> list[Layout]:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a layout name (str), got {type(layout).__name__}")
    if layout in _LAYOUTS:
        return [_LAYOUTS[layout]]
    found = [v for k, v in _LAYOUTS.items() if k.startswith(layout + "/")]
    if not found:
        raise ValueError(f"unknown checkpoint layout {layout!r}; known layouts: {layouts()}")
    return found


def to_checkpoint(qt: QTensor, layout: str, *, lossy: bool = False, **options) -> dict[str, np.ndarray]:
    """Tensors (name → numpy array, names without the module prefix) as ``layout`` stores ``qt``.

    ``qt`` is a weight in PyTorch orientation ``[N, K]`` (out_features, in_features) quantized along K.
    A ValueError says when ``layout`` cannot store ``qt`` exactly; ``lossy=True`` rounds it instead
    (with a warning). A bare layout name with several variants writes the first variant that stores
    ``qt.fmt``: an int8 QTensor goes to compressed-tensors ``pack-quantized`` (weight-only, as
    llm-compressor writes W8A16); a W8A8 checkpoint names ``"compressed-tensors/int-quantized"`` (the
    ``int8_w8a8`` scheme's ``checkpoint_layout``, which ``save_hf_checkpoint`` uses).

    Examples:
      GPTQ packs eight 4-bit codes per int32 and stores float16 scales, as the ``gptq`` schemes
      quantize them:

      >>> import numpy as np, jquant
      >>> w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
      >>> qt = jquant.get_scheme("int4_g32").quantize_weight(w)
      >>> tensors = jquant.to_checkpoint(qt, "gptq")
      >>> {name: (a.shape, str(a.dtype)) for name, a in sorted(tensors.items())}
      {'g_idx': ((64,), 'int32'), 'qweight': ((8, 8), 'int32'), 'qzeros': ((2, 1), 'int32'),
       'scales': ((2, 8), 'float16')}

      float32 scales do not fit float16 exactly, so that export is refused unless ``lossy=True``:

      >>> jquant.to_checkpoint(jquant.quantize(w, "int4", group_size=32), "gptq")
      Traceback (most recent call last):
          ...
      ValueError: gptq: tensor 'scales' (float32 QTensor scales stored as float16) changes 16 of 16 values, ...
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"to_checkpoint expects a QTensor, got {type(qt).__name__}")
    variants = _variants(layout)
    if len(variants) > 1 or variants[0].fmts:
        variants = [v for v in variants if qt.fmt in v.fmts]
        if not variants:
            raise ValueError(f"layout {layout!r} cannot store QTensor.fmt={qt.fmt!r}; it stores "
                             f"{sorted({f for v in _variants(layout) for f in v.fmts})}")
    if not isinstance(lossy, bool):
        raise TypeError(f"to_checkpoint: lossy must be a bool, got {lossy!r}")
    return variants[0].to_fn(qt, lossy=lossy, **options) if variants[0].rounds else variants[0].to_fn(qt, **options)


def from_checkpoint(tensors: dict[str, np.ndarray], layout: str, variant: str | None = None,
                    **meta) -> QTensor:
    """Rebuilds the QTensor (PyTorch orientation ``[N, K]``, so ``k_axis`` is the last axis) from a
    checkpoint's tensors.

    Examples:
      >>> import numpy as np, jquant
      >>> w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
      >>> qt = jquant.get_scheme("int4_g32").quantize_weight(w)
      >>> back = jquant.from_checkpoint(jquant.to_checkpoint(qt, "gptq"), "gptq")
      >>> back.fmt, back.shape, back.block, back.k_axis
      ('int4', (8, 64), (1, 32), 1)
      >>> bool((back.dequantize() == qt.dequantize()).all())  # the export is exact
      True
    """
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name → array, got {type(tensors).__name__}")
    variants = _variants(layout if variant is None else f"{layout}/{variant}")
    if len(variants) > 1:
        variants = [v for v in variants if v.detect is not None and v.detect(tensors)]
        if len(variants) != 1:
            raise ValueError(f"cannot tell which {layout!r} variant tensors {sorted(tensors)} are; "
                             f"pass variant= one of {[v.name.split('/', 1)[1] for v in _variants(layout)]}")
    qt = variants[0].from_fn(tensors, **meta)
    return qt if qt.k_axis is not None else qt.replace(k_axis=qt.ndim - 1)


def require(tensors: dict, names, layout: str) -> None:
    """Raises a ValueError naming the missing tensors of ``layout``."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{layout} checkpoint is missing tensor(s) {missing}; got {sorted(tensors)}")


def check_exact(original, stored, *, what: str, layout: str, fix: str, lossy: bool) -> None:
    """Raises a ValueError (warns, with ``lossy``) when ``stored`` differs from ``original`` anywhere.

    ``what`` names the tensor and its dtypes, ``fix`` says how to quantize for ``layout``; NaNs match NaNs.
    """
    a, b = np.asarray(original, np.float64), np.asarray(stored, np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if np.all(same):
        return
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)[~same]
    error = np.nanmax(diff) if np.any(~np.isnan(diff)) else np.nan
    message = (f"{layout}: {what} changes {int(np.sum(~same))} of {same.size} values, by up to {error:.3g}")
    if not lossy:
        raise ValueError(f"{message}; {fix}, or pass lossy=True to round them")
    warnings.warn(f"{message} (lossy=True)", stacklevel=5)  # the caller of to_checkpoint
