"""compressed-tensors ``int-quantized`` (INT8 W8A8, vLLM's ``CompressedTensorsW8A8Int8``), from/to
``"int8"`` QTensors in PyTorch orientation [N, K].

==================================  ==============================================================
layout                              tensors
==================================  ==============================================================
``compressed-tensors/int-quantized``  ``weight`` int8 [N, K] (signed codes, not packed);
                                    ``weight_scale`` fp32 / bf16 / fp16 ``[N, 1]`` per channel or
                                    ``[1]`` per tensor; ``weight_zero_point`` (if present) all 0;
                                    ``input_scale`` fp32 ``[1]`` when activations are static
==================================  ==============================================================

Export is exact: codes and scales are stored as they are (jquant's ``"int8"`` keeps ``q + 128`` in
uint8, here ``q``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jquant.checkpoint.base import register_layout, require
from jquant.qtensor import QTensor

LAYOUT = "compressed-tensors/int-quantized"
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def to_int_quantized(qt: QTensor, input_scale=None) -> dict[str, np.ndarray]:
    """The tensors of an int8 ``[N, K]`` QTensor with a scale per output channel or per tensor.

    Examples:
      >>> import numpy as np, jquant
      >>> from jquant.checkpoint import from_checkpoint, to_checkpoint
      >>> qt = jquant.quantize(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32), "int8")
      >>> tensors = to_checkpoint(qt, "compressed-tensors/int-quantized")
      >>> {k: (str(v.dtype), v.shape) for k, v in tensors.items()}
      {'weight': ('int8', (4, 8)), 'weight_scale': ('float32', (4, 1))}
      >>> back = from_checkpoint(tensors, "compressed-tensors/int-quantized")
      >>> bool(np.array_equal(back.data, qt.data)), bool(np.array_equal(back.scale, qt.scale))
      (True, True)
    """
    if qt.fmt != "int8" or qt.ndim != 2 or qt.zero is not None or isinstance(qt.scale, QTensor):
        raise ValueError(f"{LAYOUT} stores 2-D symmetric int8 weights [N, K]; got QTensor.fmt={qt.fmt!r} with "
                         f"shape {qt.shape}")
    n, k = qt.shape
    scale = np.asarray(qt.scale)
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{LAYOUT} stores weight_scale as {[str(d) for d in _SCALE_DTYPES]}, got {scale.dtype}")
    if tuple(qt.block) == (1, k):
        scale = scale.reshape(n, 1)
    elif tuple(qt.block) == (n, k):
        scale = scale.reshape(1)
    else:
        raise ValueError(f"{LAYOUT} stores per-channel or per-tensor scales; QTensor with shape {qt.shape} has "
                         f"block {qt.block}")
    out = {"weight": (np.asarray(qt.data).astype(np.int16) - 128).astype(np.int8), "weight_scale": scale}
    if input_scale is not None:
        s = np.asarray(input_scale)
        if s.size != 1 or not jnp.issubdtype(s.dtype, jnp.floating):
            raise ValueError(f"input_scale must be a single float, got {s.dtype} with shape {s.shape}")
        out["input_scale"] = s.astype(np.float32).reshape(1)
    return out


def from_int_quantized(tensors: dict, dtype=jnp.float32) -> QTensor:
    """The int8 QTensor of ``int-quantized`` tensors (``to_int_quantized`` shows a round trip)."""
    require(tensors, ["weight", "weight_scale"], LAYOUT)
    weight, scale = np.asarray(tensors["weight"]), np.asarray(tensors["weight_scale"])
    if weight.dtype != np.int8 or weight.ndim != 2:
        raise ValueError(f"{LAYOUT}: tensor 'weight' must be int8 [N, K], got {weight.dtype} with shape "
                         f"{weight.shape}")
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{LAYOUT}: tensor 'weight_scale' must be {[str(d) for d in _SCALE_DTYPES]}, got "
                         f"{scale.dtype} with shape {scale.shape}")
    n, k = weight.shape
    if scale.shape == (n, 1):
        block, stored = (1, k), scale
    elif scale.shape in ((), (1,)):
        block, stored = (n, k), scale.reshape(1, 1)
    else:
        raise ValueError(f"{LAYOUT}: tensor 'weight_scale' has shape {scale.shape}, but weight {weight.shape} "
                         f"needs [{n}, 1] (channel) or [1] (tensor)")
    if "weight_zero_point" in tensors and np.any(np.asarray(tensors["weight_zero_point"])):
        raise ValueError(f"{LAYOUT}: nonzero 'weight_zero_point' (asymmetric INT8 weights) is not supported")
    if "input_scale" in tensors:
        s = np.asarray(tensors["input_scale"])
        if s.size != 1 or not jnp.issubdtype(s.dtype, jnp.floating):
            raise ValueError(f"{LAYOUT}: tensor 'input_scale' must be one float, got {s.dtype} with shape {s.shape}")
    data = (weight.astype(np.int16) + 128).astype(np.uint8)
    return QTensor(data=jnp.asarray(data), scale=jnp.asarray(stored), fmt="int8", shape=(n, k), dtype=dtype,
                   block=block, k_axis=1)


def _detect(tensors: dict) -> bool:
    return getattr(tensors.get("weight"), "dtype", None) == np.int8 and "weight_scale" in tensors


register_layout(LAYOUT, to_int_quantized, from_int_quantized, fmts=("int8",), detect=_detect)
