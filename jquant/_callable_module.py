"""A package that is also the function of the same name (``jquant.formats()`` lists the formats,
``jquant.formats.quantize`` is in the package): binding the function at the top level instead would
hide the package, so ``import jquant.formats as m`` and ``jquant.formats.presets()`` would fail."""

from __future__ import annotations

import sys
import types
from typing import Callable


def make_callable(module_name: str, fn: Callable) -> None:
    """Makes the module ``module_name`` callable as ``fn``."""
    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    CallableModule.__call__.__doc__ = fn.__doc__
    sys.modules[module_name].__class__ = CallableModule
