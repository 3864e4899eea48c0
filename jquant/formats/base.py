"""The quantizer registry: format name → ``quantize(x, **options) -> QTensor``."""

from __future__ import annotations

from typing import Any, Callable

from jquant.qtensor import QTensor

_QUANTIZERS: dict[str, Callable[..., QTensor]] = {}


def register_quantizer(name: str, fn: Callable[..., QTensor]) -> None:
    _QUANTIZERS[name] = fn


def formats() -> tuple[str, ...]:
    """Names accepted by ``quantize``."""
    return tuple(sorted(_QUANTIZERS))


def quantize(x: Any, fmt: str, **options) -> QTensor:
    """Quantizes ``x`` to format ``fmt``; ``options`` are the format's own (axis, group_size, ...)."""
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a format name (str), got {type(fmt).__name__}")
    fn = _QUANTIZERS.get(fmt)
    if fn is None:
        raise ValueError(f"unknown format {fmt!r}; known formats: {formats()}")
    return fn(x, **options)
