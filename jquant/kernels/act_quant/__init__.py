"""Dynamic e4m3 activation quantization (per token, per 1 × G group) for the W8A8 FP8 GEMMs, one pass."""

from jquant.kernels.act_quant.api import choose_impl, quantize_fp8_activations, quantize_scheme_activation
from jquant.kernels.act_quant.triton import ActQuantConfig

__all__ = ["ActQuantConfig", "choose_impl", "quantize_fp8_activations", "quantize_scheme_activation"]
