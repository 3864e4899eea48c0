"""Flax integration: quantize parameter trees by path rules, run linen and NNX models quantized."""

from jquant.nn.qparam import QParam
from jquant.nn.rules import QuantizeReport, Rule, prepare_params, quantize_params
from jquant.nn.linen import intercept_quantized, quantized_apply
from jquant.nn.nnx import QLinear, quantize_nnx

__all__ = ["QLinear", "QParam", "QuantizeReport", "Rule", "intercept_quantized", "prepare_params", "quantize_nnx", "quantize_params", "quantized_apply"]
