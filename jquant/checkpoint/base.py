"""The checkpoint-layout registry: QTensor ⇄ the tensors a vLLM checkpoint stores."""

from __future__ import annotations

from typing import Callable

import numpy as np

from jquant.qtensor import QTensor

ToFn = Callable[..., dict[str, np.ndarray]]
FromFn = Callable[..., QTensor]
_LAYOUTS: dict[str, tuple[ToFn, FromFn]] = {}


def register_layout(name: str, to_fn: ToFn, from_fn: FromFn) -> None:
    _LAYOUTS[name] = (to_fn, from_fn)


def layouts() -> tuple[str, ...]:
    return tuple(sorted(_LAYOUTS))


def _lookup(layout: str):
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a layout name (str), got {type(layout).__name__}")
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r}; known layouts: {layouts()}")
    return _LAYOUTS[layout]


def to_checkpoint(qt: QTensor, layout: str, **options) -> dict[str, np.ndarray]:
    """Tensors (name → numpy array, names without the module prefix) as ``layout`` stores ``qt``.

    ``qt`` is a weight in PyTorch orientation ``[N, K]`` (out_features, in_features) quantized along K.
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"to_checkpoint expects a QTensor, got {type(qt).__name__}")
    return _lookup(layout)[0](qt, **options)


def from_checkpoint(tensors: dict[str, np.ndarray], layout: str, **meta) -> QTensor:
    """Rebuilds the QTensor (PyTorch orientation ``[N, K]``) from a checkpoint's tensors."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name → array, got {type(tensors).__name__}")
    return _lookup(layout)[1](tensors, **meta)


def require(tensors: dict, names, layout: str) -> None:
    """Raises a ValueError naming the missing tensors of ``layout``."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{layout} checkpoint is missing tensor(s) {missing}; got {sorted(tensors)}")
