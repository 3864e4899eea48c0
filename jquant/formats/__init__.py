"""Quantization formats: pure functions from float arrays to QTensors and back."""

from jquant.formats.base import formats, preset_options, presets, quantize, register_preset, register_quantizer

# Importing a family module registers its quantizers and dequantizers.
from jquant.formats import integer as _integer  # noqa: F401,E402
from jquant.formats import fp8 as _fp8  # noqa: F401,E402
from jquant.formats import mx as _mx  # noqa: F401,E402
from jquant.formats import nvfp4 as _nvfp4  # noqa: F401,E402
from jquant.formats import bnb as _bnb  # noqa: F401,E402

__all__ = ["formats", "preset_options", "presets", "quantize", "register_preset", "register_quantizer"]
