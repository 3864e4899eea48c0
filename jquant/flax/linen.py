"""Run an existing linen model with quantized Dense kernels, without changing its code."""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from jquant.schemes.qparam import QParam


def _dense_interceptor(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, nn.Dense) and context.method_name == "__call__" and module.has_variable("params", "kernel"):
        kernel = module.get_variable("params", "kernel")
        if isinstance(kernel, QParam):
            (x,) = args
            bias = module.get_variable("params", "bias") if module.use_bias else None
            dtype = module.dtype or x.dtype
            return kernel.apply(x.astype(dtype), None if bias is None else bias.astype(dtype))
    return next_fun(*args, **kwargs)


def intercept_quantized():
    """A context in which ``nn.Dense`` layers whose kernel is a QParam run their scheme (wrap any code that
    traces ``model.apply``, e.g. a generation loop).

    Examples:
      >>> import jax, numpy as np, flax.linen as nn
      >>> from jquant.flax import intercept_quantized, quantize_params
      >>> model = nn.Dense(16)
      >>> x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
      >>> variables = model.init(jax.random.key(0), x)
      >>> qparams, _ = quantize_params(variables["params"], "int8_ch")
      >>> with intercept_quantized():
      ...     y = jax.jit(model.apply)({"params": qparams}, x)
      >>> y.shape
      (2, 16)
    """
    return nn.intercept_methods(_dense_interceptor)


def quantized_apply(model: nn.Module, variables: Any, *args, **kwargs):
    """``model.apply(variables, *args, **kwargs)`` where ``nn.Dense`` layers whose kernel is a QParam
    (from ``quantize_params``) run their scheme instead of a float matmul. A quantized layer computes
    in its ``dtype`` if set, else in its input's: a float32 kernel fed bfloat16 gives bfloat16, where
    Flax promotes to float32 (a quantized kernel has no float dtype left to promote with).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
      >>> from jquant.flax import quantize_params, quantized_apply
      >>> model = nn.Dense(16)
      >>> x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
      >>> variables = model.init(jax.random.key(0), x)
      >>> qparams, report = quantize_params(variables["params"], "int8_ch")
      >>> report.quantized
      {'kernel': 'int8_ch'}
      >>> y = quantized_apply(model, {"params": qparams}, x)
      >>> y.shape, bool(jnp.abs(y - model.apply(variables, x)).max() < 0.05)
      ((2, 16), True)
    """
    with intercept_quantized():
        return model.apply(variables, *args, **kwargs)
