"""Products with quantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.qtensor import QTensor


def qdot(x: jax.Array, w: QTensor, *, preferred_element_type=None) -> jax.Array:
    """``x [..., K]`` times a 2-D QTensor weight, contracted along the weight's K axis: ``[..., N]``.

    The K axis is ``w.k_axis`` when the QTensor records it (``quantize`` records the axis it groups
    along, checkpoint loaders axis 1 of their ``[N, K]`` weights, so those give ``x @ W.T``), else
    axis 0: ``jnp.dot(x, w)`` for a Flax kernel ``[K, N]``. A square weight that does not record its K
    axis (per-tensor and 2-D tile formats) is refused: either orientation would give a plausible answer.

    Dequantizes ``w`` to ``x``'s dtype and accumulates in fp32; the result has ``x``'s dtype unless
    ``preferred_element_type`` says otherwise. ``Scheme.apply`` runs ``[N, K]`` weights on a kernel path.

    Examples:
      A Flax kernel ``[K, N]`` quantized along K (axis 0) records ``k_axis=0``:

      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> kernel = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
      >>> qk = jquant.quantize(kernel, "int8", axis=0)
      >>> qk.k_axis
      0
      >>> x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
      >>> y = jquant.qdot(x, qk)
      >>> y.shape, str(y.dtype)
      ((2, 3), 'float32')
      >>> bool(jnp.abs(y - x @ kernel).max() < 0.05)  # int8 per channel: close to the float product
      True
      >>> print(jquant.qdot(x.astype(jnp.bfloat16), qk).dtype)  # x's dtype
      bfloat16
    """
    if not isinstance(w, QTensor):
        raise TypeError(f"qdot expects a QTensor weight, got {type(w).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"qdot: x must be a float array, got {x.dtype} (shape {tuple(x.shape)})")
    if w.k_axis is None and w.ndim == 2 and w.shape[0] == w.shape[1]:
        raise ValueError(f"qdot: the square weight of shape {w.shape} ({w.fmt}) does not record its K axis; "
                         "say which it is with w.replace(k_axis=1) for a [N, K] weight (PyTorch) or "
                         "k_axis=0 for a [K, N] Flax kernel")
    k_axis = 0 if w.k_axis is None else w.k_axis
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[k_axis]:
        need = "w[K, N]" if k_axis == 0 else "w[N, K]"
        raise ValueError(f"qdot: x with shape {tuple(x.shape)} cannot multiply a weight of shape {w.shape} "
                         f"with k_axis={w.k_axis} (need x[..., K] and {need})")
    dims = (((x.ndim - 1,), (k_axis,)), ((), ()))
    y = jax.lax.dot_general(x, w.dequantize(x.dtype), dims, preferred_element_type=jnp.float32)
    return y.astype(preferred_element_type or x.dtype)
