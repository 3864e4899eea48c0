"""QParam: a quantized weight together with the scheme that applies it (a pytree leaf group)."""

from __future__ import annotations

import dataclasses

import jax

from jquant.formats import hadamard
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Prepared, Scheme


@dataclasses.dataclass(frozen=True)
class QParam:
    """A Dense kernel quantized under ``scheme``.

    ``weight`` is the scheme's prepared weight (``[N, K]``, laid out for its kernel) or the plain QTensor;
    ``scheme`` is static, so a jitted forward specialises on it. ``input_scale`` is the calibrated
    per-tensor activation scale of a static scheme (a checkpoint's ``input_scale``, a 0-d fp32 array
    leaf, so it jits and saves with the weight); None for every other scheme. ``input_rotation`` (static)
    is the block of a Walsh–Hadamard rotation of the input axis: the weight holds ``W H`` quantized and
    ``apply`` rotates ``x`` the same way first (``jquant.algorithms.rotation``); None: no rotation.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.flax import QParam
      >>> scheme = jquant.get_scheme("int8_ch")
      >>> kernel = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)  # Flax [K, N]
      >>> qparam = QParam(scheme.quantize_kernel(kernel), scheme)
      >>> qparam.qtensor.shape  # stored [N, K]
      (16, 64)
      >>> x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
      >>> y = qparam.apply(x)  # x @ kernel
      >>> y.shape, bool(jnp.allclose(y, x @ qparam.qtensor.dequantize().T, atol=1e-4))
      ((2, 16), True)
    """

    weight: Prepared | QTensor
    scheme: Scheme
    input_scale: jax.Array | None = None
    input_rotation: int | None = None

    def __post_init__(self):
        if self.input_rotation is not None:
            hadamard.check_block(self.input_rotation)

    @property
    def qtensor(self) -> QTensor:
        """The weight as a QTensor (the XLA layout keeps it as is)."""
        w = self.weight
        if isinstance(w, Prepared):
            if not isinstance(w.data, QTensor):
                raise ValueError(f"QParam of scheme {self.scheme.name!r} holds a {w.impl!r} kernel layout, "
                                 "not a QTensor; keep the QTensor (prepare=False) to export it")
            return w.data
        return w

    def apply(self, x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        """``x @ kernel + bias`` where kernel is the Flax ``[K, N]`` matrix this QParam replaced."""
        if self.input_rotation is not None:
            x = hadamard.hadamard_blocks(x, self.input_rotation).astype(x.dtype)
        return self.scheme.apply(x, self.weight, bias, input_scale=self.input_scale)

    def __jax_array__(self):
        # jnp.asarray calls this where a plain Dense meets a QParam (a linen model.apply on quantized params,
        # whose kernel shape matched); without it the error is "float() argument must be ... not 'QParam'".
        raise TypeError(f"this is a quantized parameter (QParam of scheme {self.scheme.name!r}), not an array; run "
                        "the model with jquant.flax.quantized_apply or inside jquant.flax.intercept_quantized()")


jax.tree_util.register_dataclass(QParam, data_fields=["weight", "input_scale"],
                                 meta_fields=["scheme", "input_rotation"])
