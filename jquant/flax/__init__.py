"""Flax integration: quantize parameter trees by path rules, run linen and NNX models quantized."""

from jquant.schemes.qparam import QParam
from jquant.flax.rules import QuantizeReport, Rule, prepare_params, quantize_params
from jquant.flax.linen import intercept_quantized, quantized_apply
from jquant.flax.nnx import QLinear, quantize_nnx
from jquant.flax.orbax_io import restore_quantized, save_quantized

__all__ = ["QLinear", "QParam", "QuantizeReport", "Rule", "intercept_quantized", "prepare_params", "quantize_nnx",
           "quantize_params", "quantized_apply", "restore_quantized", "save_quantized"]
