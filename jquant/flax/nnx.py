"""NNX: a quantized Linear and in-place replacement of ``nnx.Linear`` layers by path rules."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from flax import nnx

from jquant.schemes.qparam import QParam
from jquant.flax.rules import DEFAULT_SKIP, quantize_params


class QLinear(nnx.Module):
    """``nnx.Linear`` with its kernel quantized: ``y = x @ kernel + bias`` via the kernel's scheme.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.flax import QLinear, QParam
      >>> scheme = jquant.get_scheme("int8_ch")
      >>> kernel = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)  # [K, N]
      >>> layer = QLinear(QParam(scheme.quantize_kernel(kernel), scheme), bias=jnp.ones(16))
      >>> x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
      >>> y = layer(x)
      >>> y.shape, bool(jnp.allclose(y, x @ layer.qkernel.get_value().qtensor.dequantize().T + 1, atol=1e-4))
      ((2, 16), True)
    """

    def __init__(self, qparam: QParam, bias: jax.Array | None = None):
        if not isinstance(qparam, QParam):
            raise TypeError(f"QLinear needs a QParam, got {type(qparam).__name__}")
        self.qkernel = nnx.Param(qparam)
        self.bias = None if bias is None else nnx.Param(bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...].astype(x.dtype)
        return self.qkernel.get_value().apply(x, bias)


def quantize_nnx(model: nnx.Module, rules, *, skip: Sequence[str | Callable[[str], bool]] = DEFAULT_SKIP,
                 prepare: bool = True, strict: bool = True):
    """Replaces, in place, every ``nnx.Linear`` whose ``<path>/kernel`` a rule quantizes by a ``QLinear``.

    Returns the report of ``quantize_params`` (paths like ``layers/0/q_proj/kernel``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> from jquant.flax import quantize_nnx
      >>> class Model(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.proj = nnx.Linear(64, 16, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.proj(x)
      >>> model = Model(nnx.Rngs(0))
      >>> x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
      >>> y = model(x)
      >>> quantize_nnx(model, "int8_ch").quantized
      {'proj/kernel': 'int8_ch'}
      >>> type(model.proj).__name__, bool(jnp.abs(model(x) - y).max() < 0.05)
      ('QLinear', True)
    """
    linears = {"/".join(map(str, path)): (path, m) for path, m in nnx.iter_modules(model)
               if isinstance(m, nnx.Linear)}
    kernels = {f"{name}/kernel" if name else "kernel": m.kernel[...] for name, (_, m) in linears.items()}
    quantized, report = quantize_params(kernels, rules, skip=skip, prepare=prepare, strict=strict)
    for key, value in quantized.items():
        if not isinstance(value, QParam):
            continue
        path, linear = linears[key.rsplit("/", 1)[0] if "/" in key else ""]
        bias = linear.bias[...] if linear.bias is not None else None
        _set_child(model, path, QLinear(value, bias))
    return report


def _set_child(root, path, new):
    if not path:
        raise ValueError("quantize_nnx cannot replace the root module itself; wrap the Linear in a Module")
    parent = root
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)
