"""Quantization formats: pure functions from float arrays to QTensors and back.

Calling the package lists the registered format names (``jquant.formats()``).

Examples:
  >>> import jquant, jax.numpy as jnp
  >>> {"int4", "mxfp4", "nvfp4", "fp8_e4m3"} <= set(jquant.formats())
  True
  >>> jquant.formats.quantize(jnp.ones((2, 32)), "mxfp4").fmt
  'mxfp4'
"""

from jquant.formats.base import formats, preset_options, presets, quantize, register_preset, register_quantizer

# Importing a family module registers its quantizers and dequantizers.
from jquant.formats import integer as _integer  # noqa: F401,E402
from jquant.formats import fp8 as _fp8  # noqa: F401,E402
from jquant.formats import mx as _mx  # noqa: F401,E402
from jquant.formats import nvfp4 as _nvfp4  # noqa: F401,E402
from jquant.formats import bnb as _bnb  # noqa: F401,E402
from jquant.formats import bnb_int8 as _bnb_int8  # noqa: F401,E402

from jquant._callable_module import make_callable  # noqa: E402

make_callable(__name__, formats)   # jquant.formats() lists the formats; jquant.formats.* is this package

__all__ = ["formats", "preset_options", "presets", "quantize", "register_preset", "register_quantizer"]
