"""The quantizer registry: format name → ``quantize(x, **options) -> QTensor``, and the reference
presets: ``quantize(x, fmt, like="torchao")`` sets every option that makes ``fmt`` match one library.
"""

from __future__ import annotations

from typing import Any, Callable

from jquant.qtensor import QTensor

_QUANTIZERS: dict[str, Callable[..., QTensor]] = {}
_PRESETS: dict[tuple[str, str], dict[str, Any]] = {}


def register_quantizer(name: str, fn: Callable[..., QTensor]) -> None:
    _QUANTIZERS[name] = fn


def register_preset(like: str, fmt: str, options: dict[str, Any]) -> None:
    """Declares the options with which format ``fmt`` reproduces library ``like`` bit for bit."""
    _PRESETS[(like, fmt)] = dict(options)


def formats() -> tuple[str, ...]:
    """Names accepted by ``quantize``."""
    return tuple(sorted(_QUANTIZERS))


def presets() -> dict[str, tuple[str, ...]]:
    """Reference library → the formats it has a preset for (the values ``like=`` takes)."""
    out: dict[str, list[str]] = {}
    for like, fmt in sorted(_PRESETS):
        out.setdefault(like, []).append(fmt)
    return {like: tuple(fmts) for like, fmts in out.items()}


def preset_options(like: str, fmt: str) -> dict[str, Any]:
    """The options ``quantize(x, fmt, like=like)`` passes to the format; a ValueError names the
    libraries that do have a preset for ``fmt`` when ``like`` has none."""
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
    return fn(x, **options)
