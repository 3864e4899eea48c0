"""FP8 weight checkpoints vLLM reads, from/to ``"fp8_e4m3"`` QTensors in PyTorch orientation [N, K].

======================================  ==========================================================
layout                                  tensors
======================================  ==========================================================
``compressed-tensors/float-quantized``  ``weight`` e4m3 [N, K]; ``weight_scale`` in the QTensor's
                                        scale dtype (fp32/bf16/fp16; llm-compressor writes the
                                        model's dtype): ``[1]`` per tensor, ``[N, 1]`` per channel,
                                        ``[ceil(N/bh), ceil(K/bw)]`` per block; ``input_scale`` fp32
                                        ``[1]`` when activations are static
``modelopt/fp8``                        ``weight``; ``weight_scale`` fp32, by ``quant_algo``: ``FP8``
                                        ``[]`` with ``input_scale`` fp32 ``[]``;
                                        ``FP8_PER_CHANNEL_PER_TOKEN`` ``[N]``; ``FP8_PB_WO``
                                        ``[N/128, 1, K/128, 1]`` (128 × 128 blocks, N and K
                                        multiples of 128); those two store no ``input_scale``
``fp8`` (vLLM / AutoFP8)                ``weight``; ``weight_scale`` fp32 ``[]`` or ``[N, 1]``;
                                        ``input_scale`` fp32 ``[]``
``fp8-block`` (DeepSeek V3)             ``weight``; ``weight_scale_inv`` fp32 ``[ceil(N/bh), ceil(K/bw)]``
                                        (a multiplier, despite its name), block from the config's
                                        ``weight_block_size`` (default 128 × 128)
``compressed-tensors/mxfp8-quantized``  ``"mxfp8_e4m3"`` QTensors: ``weight`` e4m3 [N, K]; ``weight_scale``
``modelopt/mxfp8``                      uint8 [N, K/32], biased E8M0 exponents (2^(s-127)); the two layouts
                                        store the same tensors
======================================  ==========================================================

``to_checkpoint(qt, layout, input_scale=...)`` adds the activation scale; ``from_checkpoint`` checks
it (a single float) but returns only the weight. ``from_checkpoint(..., dtype=...)`` sets the
QTensor's logical dtype (default float32, whatever the stored scale's dtype); ``block_size=(bh, bw)``
gives the block of block-scaled tensors (default 128 × 128); ``modelopt``'s ``granularity=`` (what the
config's ``quant_algo`` stores) refuses scales of any other shape. Every export is exact: the scales are
stored in their own dtype (compressed-tensors) or widened to float32.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jquant.checkpoint.base import register_layout, require
from jquant.formats import mx
from jquant.qtensor import QTensor

_FMT = "fp8_e4m3"
_WEIGHT_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_FP8_DTYPES = (_WEIGHT_DTYPE, np.dtype(ml_dtypes.float8_e5m2))
_CT_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
_FP32 = (np.dtype(np.float32),)
_DEFAULT_BLOCK = (128, 128)
_CT = "compressed-tensors/float-quantized"
_CT_MXFP8 = "compressed-tensors/mxfp8-quantized"
_BLOCK = "fp8-block"


# ---- shared checks ---------------------------------------------------------------------------------

def _granularity(shape, block) -> str:
    if tuple(block) == tuple(shape):
        return "tensor"
    if tuple(block) == (1, shape[1]):
        return "channel"
    return "block"


def _check_qtensor(qt: QTensor, layout: str, granularities) -> str:
    if qt.fmt != _FMT or qt.ndim != 2 or qt.pack_axis is not None:
        raise ValueError(f"{layout} stores 2-D fp8_e4m3 weights [N, K]; got QTensor.fmt={qt.fmt!r} "
                         f"with shape {qt.shape}")
    granularity = _granularity(qt.shape, qt.block)
    if granularity == "tensor" and qt.option("granularity") == "block":
        granularity = "block"   # a weight of exactly one block: its block alone reads as per tensor
    if granularity not in granularities:
        raise ValueError(f"{layout} stores {' or '.join(granularities)} scales; QTensor with shape "
                         f"{qt.shape} has block {qt.block} ({granularity})")
    return granularity


def _fp32_scale(qt: QTensor) -> np.ndarray:
    # Every scale dtype fp8.py makes (bf16, fp16, e8m0) widens to fp32 exactly.
    return np.asarray(qt.scale).astype(np.float32)


def _input_scale(value, shape) -> dict[str, np.ndarray]:
    if value is None:
        return {}
    scale = np.asarray(value)
    if scale.size != 1 or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"input_scale must be a single float, got {scale.dtype} with shape {scale.shape}")
    return {"input_scale": scale.astype(np.float32).reshape(shape)}


def _read(tensors: dict, name: str, layout: str) -> np.ndarray:
    require(tensors, [name], layout)
    return np.asarray(tensors[name])


def _read_weight(tensors: dict, layout: str) -> np.ndarray:
    weight = _read(tensors, "weight", layout)
    if weight.dtype != _WEIGHT_DTYPE or weight.ndim != 2:
        raise ValueError(f"{layout}: tensor 'weight' must be float8_e4m3fn [N, K], got {weight.dtype} "
                         f"with shape {weight.shape}")
    return weight


def _read_scale(tensors, name, layout, dtypes) -> np.ndarray:
    scale = _read(tensors, name, layout)
    if scale.dtype not in dtypes:
        raise ValueError(f"{layout}: tensor {name!r} must be {[str(d) for d in dtypes]}, got {scale.dtype} "
                         f"with shape {scale.shape}")
    return scale


def _check_input_scale(tensors, layout, shapes):
    if "input_scale" not in tensors:
        return
    scale = np.asarray(tensors["input_scale"])
    if scale.shape not in shapes or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"{layout}: tensor 'input_scale' must be a float of shape "
                         f"{' or '.join(map(str, shapes))}, got {scale.dtype} with shape {scale.shape}")


def _block_grid(shape, block_size) -> tuple[int, int]:
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_size)):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def _ct_scale_block(weight, scale, block_size) -> tuple[int, int]:
    """The block a compressed-tensors weight_scale implies: [1] per tensor, [N, 1] per output
    channel, otherwise the ``block_size`` grid."""
    n, k = weight.shape
    if scale.shape in ((), (1,)):
        return n, k
    if scale.shape == (n, 1):
        return 1, k
    grid = _block_grid(weight.shape, block_size)
    if scale.shape == grid:
        return tuple(block_size)
    raise ValueError(f"{_CT}: tensor 'weight_scale' has shape {scale.shape}, but weight {weight.shape} "
                     f"needs [1] (tensor), [{n}, 1] (channel) or {list(grid)} (block {tuple(block_size)})")


def _qtensor(weight, scale, block, dtype, granularity: str | None = None) -> QTensor:
    shape = weight.shape
    nblocks = tuple(-(-s // b) for s, b in zip(shape, block))
    return QTensor(data=jnp.asarray(weight), scale=jnp.asarray(scale.reshape(nblocks)), fmt=_FMT,
                   shape=shape, dtype=dtype, block=block,
                   options=(("granularity", granularity or _granularity(shape, block)),))


def _is_fp8_weight(tensors: dict) -> bool:
    return getattr(tensors.get("weight"), "dtype", None) in _FP8_DTYPES


# ---- compressed-tensors float-quantized -------------------------------------------------------------

def to_compressed_tensors(qt: QTensor, input_scale=None) -> dict[str, np.ndarray]:
    granularity = _check_qtensor(qt, _CT, ("tensor", "channel", "block"))
    scale = np.asarray(qt.scale)
    if scale.dtype not in _CT_SCALE_DTYPES:
        raise ValueError(f"{_CT} stores weight_scale as {[str(d) for d in _CT_SCALE_DTYPES]}, got "
                         f"{scale.dtype}; quantize with scale_dtype=jnp.float32")
    if granularity == "tensor":
        scale = scale.reshape(1)  # compressed-tensors reshapes 0-d scales to [1]
    return {"weight": np.asarray(qt.data), "weight_scale": scale, **_input_scale(input_scale, (1,))}


def from_compressed_tensors(tensors: dict, dtype=jnp.float32, block_size=_DEFAULT_BLOCK) -> QTensor:
    weight = _read_weight(tensors, _CT)
    scale = _read_scale(tensors, "weight_scale", _CT, _CT_SCALE_DTYPES)
    if "weight_zero_point" in tensors and np.any(np.asarray(tensors["weight_zero_point"], np.float32)):
        raise ValueError(f"{_CT}: nonzero 'weight_zero_point' (asymmetric FP8) is not supported")
    _check_input_scale(tensors, _CT, ((1,), ()))
    block = _ct_scale_block(weight, scale, block_size)
    # A 2-D scale that is not [N, 1] is a block grid, even of one block.
    return _qtensor(weight, scale, block, dtype,
                    "block" if scale.ndim == 2 and scale.shape != (weight.shape[0], 1) else None)


def _detect_compressed_tensors(tensors: dict) -> bool:
    return (_is_fp8_weight(tensors) and "weight_scale" in tensors and "weight_packed" not in tensors
            and not _detect_mxfp8(tensors))


# ---- MXFP8: compressed-tensors mxfp8-quantized and ModelOpt MXFP8 -------------------------------------

def _to_mxfp8(layout: str):
    def to_mxfp8(qt: QTensor) -> dict[str, np.ndarray]:
        scale = np.asarray(qt.scale)
        if (qt.fmt != "mxfp8_e4m3" or qt.ndim != 2 or qt.block != (1, mx.BLOCK_SIZE)
                or scale.dtype != ml_dtypes.float8_e8m0fnu):
            raise ValueError(f"{layout} stores [N, K] 'mxfp8_e4m3' QTensors blocked by {mx.BLOCK_SIZE} along K "
                             f"with E8M0 scales; got fmt={qt.fmt!r}, shape {qt.shape}, block {qt.block}, "
                             f"scales {scale.dtype}")
        return {"weight": np.asarray(qt.data), "weight_scale": scale.view(np.uint8)}
    return to_mxfp8


def _from_mxfp8(layout: str):
    def from_mxfp8(tensors: dict, dtype=jnp.float32, group_size: int | None = None) -> QTensor:
        if group_size is not None and group_size != mx.BLOCK_SIZE:
            raise ValueError(f"{layout}: group_size={group_size!r} given, but MXFP8 blocks are {mx.BLOCK_SIZE} "
                             "elements along K")
        weight = _read_weight(tensors, layout)
        scale = _read_scale(tensors, "weight_scale", layout, (np.dtype(np.uint8),))
        n, k = weight.shape
        if k % mx.BLOCK_SIZE or scale.shape != (n, k // mx.BLOCK_SIZE):
            raise ValueError(f"{layout}: tensors 'weight' {weight.shape} and 'weight_scale' {scale.shape} do not "
                             f"fit: expected [N, K] and [N, K/{mx.BLOCK_SIZE}] with K a multiple of {mx.BLOCK_SIZE}")
        return QTensor(data=jnp.asarray(weight), scale=jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)),
                       fmt="mxfp8_e4m3", shape=weight.shape, dtype=dtype, block=(1, mx.BLOCK_SIZE))
    return from_mxfp8


def _detect_mxfp8(tensors: dict) -> bool:
    return _is_fp8_weight(tensors) and getattr(tensors.get("weight_scale"), "dtype", None) == np.uint8


# ---- ModelOpt FP8 (quant_algo FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO) -------------------------------

_MODELOPT = "modelopt/fp8"
_MODELOPT_BLOCK = (128, 128)  # vLLM's ModelOptFp8PbWoLinearMethod reads FP8_PB_WO in these blocks only


def _modelopt_scale_shapes(n: int, k: int) -> dict[str, tuple]:
    """``weight_scale`` shapes vLLM's ModelOpt FP8 linear methods load for a weight [n, k], by granularity."""
    bh, bw = _MODELOPT_BLOCK
    block = ((n // bh, 1, k // bw, 1),) if n % bh == 0 and k % bw == 0 else ()
    return {"tensor": ((), (1,)), "channel": ((n,),), "block": block}


def _modelopt_expected(granularity: str, n: int, k: int) -> str:
    if granularity == "block" and not _modelopt_scale_shapes(n, k)["block"]:
        return f"N and K multiples of {_MODELOPT_BLOCK[0]} for block scales (FP8_PB_WO)"
    return " or ".join(str(list(s)) for s in _modelopt_scale_shapes(n, k)[granularity]) + f" ({granularity})"


def to_modelopt(qt: QTensor, input_scale=None) -> dict[str, np.ndarray]:
    granularity = _check_qtensor(qt, _MODELOPT, ("tensor", "channel", "block"))
    tensors = {"weight": np.asarray(qt.data)}
    scale = _fp32_scale(qt)
    if granularity == "tensor":
        return {**tensors, "weight_scale": scale.reshape(()), **_input_scale(input_scale, ())}
    if input_scale is not None:
        raise ValueError(f"{_MODELOPT}: only per-tensor weights (quant_algo FP8) store a static input_scale; "
                         f"{granularity} scaled ones quantize activations dynamically")
    if granularity == "channel":
        return {**tensors, "weight_scale": scale.reshape(qt.shape[0])}
    shapes = _modelopt_scale_shapes(*qt.shape)["block"]
    if tuple(qt.block) != _MODELOPT_BLOCK or not shapes:
        raise ValueError(f"{_MODELOPT} stores {_MODELOPT_BLOCK[0]} × {_MODELOPT_BLOCK[1]} block scales of weights "
                         f"whose N and K are multiples of them (FP8_PB_WO); QTensor with shape {qt.shape} has "
                         f"block {qt.block}")
    return {**tensors, "weight_scale": scale.reshape(shapes[0])}


def from_modelopt(tensors: dict, dtype=jnp.float32, granularity: str | None = None) -> QTensor:
    weight = _read_weight(tensors, _MODELOPT)
    scale = _read_scale(tensors, "weight_scale", _MODELOPT, _FP32)
    n, k = weight.shape
    shapes = _modelopt_scale_shapes(n, k)
    if granularity is not None and granularity not in shapes:
        raise ValueError(f"{_MODELOPT}: granularity must be one of {sorted(shapes)}, got {granularity!r}")
    candidates = (granularity,) if granularity else tuple(shapes)
    fits = [g for g in candidates if scale.shape in shapes[g]]
    if not fits:
        expected = " or ".join(_modelopt_expected(g, n, k) for g in candidates)
        raise ValueError(f"{_MODELOPT}: tensor 'weight_scale' has shape {scale.shape}, but weight {weight.shape} "
                         f"needs {expected}")
    found = fits[0]
    if found == "tensor":
        _check_input_scale(tensors, _MODELOPT, ((), (1,)))
    elif "input_scale" in tensors:
        # vLLM's per-channel and block methods quantize activations dynamically and load no input_scale.
        raise ValueError(f"{_MODELOPT}: {found} scaled weights (FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO) take "
                         "dynamic activations; tensor 'input_scale' has no place beside them")
    block = {"tensor": (n, k), "channel": (1, k), "block": _MODELOPT_BLOCK}[found]
    return _qtensor(weight, scale, block, dtype, found)


def _detect_modelopt(tensors: dict) -> bool:
    return (_is_fp8_weight(tensors) and "weight_scale" in tensors and "weight_scale_2" not in tensors
            and not _detect_mxfp8(tensors))


# ---- vLLM fp8 (per tensor / per channel) ------------------------------------------------------------

def to_fp8(qt: QTensor, input_scale=None) -> dict[str, np.ndarray]:
    granularity = _check_qtensor(qt, "fp8", ("tensor", "channel"))
    scale = _fp32_scale(qt)
    scale = scale.reshape(()) if granularity == "tensor" else scale
    return {"weight": np.asarray(qt.data), "weight_scale": scale, **_input_scale(input_scale, ())}


def from_fp8(tensors: dict, dtype=jnp.float32) -> QTensor:
    weight = _read_weight(tensors, "fp8")
    scale = _read_scale(tensors, "weight_scale", "fp8", _FP32)
    _check_input_scale(tensors, "fp8", ((), (1,)))
    n, k = weight.shape
    if scale.size == 1 and scale.ndim <= 1:
        block = (n, k)
    elif scale.shape == (n, 1):
        block = (1, k)
    else:
        raise ValueError(f"fp8: tensor 'weight_scale' has shape {scale.shape}, but weight {weight.shape} needs "
                         f"[] or [1] or [{n}, 1]")
    return _qtensor(weight, scale, block, dtype)


# ---- DeepSeek-style block FP8 -----------------------------------------------------------------------

def to_fp8_block(qt: QTensor) -> dict[str, np.ndarray]:
    _check_qtensor(qt, _BLOCK, ("block",))
    return {"weight": np.asarray(qt.data), "weight_scale_inv": _fp32_scale(qt)}


def from_fp8_block(tensors: dict, dtype=jnp.float32, block_size=_DEFAULT_BLOCK) -> QTensor:
    weight = _read_weight(tensors, _BLOCK)
    scale = _read_scale(tensors, "weight_scale_inv", _BLOCK, _FP32)
    grid = _block_grid(weight.shape, block_size)
    if scale.shape != grid:
        raise ValueError(f"{_BLOCK}: tensor 'weight_scale_inv' has shape {scale.shape}, but weight "
                         f"{weight.shape} with block {tuple(block_size)} needs {list(grid)}")
    return _qtensor(weight, scale, tuple(block_size), dtype, "block")


register_layout(_CT, to_compressed_tensors, from_compressed_tensors, fmts=(_FMT,),
                detect=_detect_compressed_tensors)
register_layout(_MODELOPT, to_modelopt, from_modelopt, fmts=(_FMT,), detect=_detect_modelopt)
for _layout in (_CT_MXFP8, "modelopt/mxfp8"):
    register_layout(_layout, _to_mxfp8(_layout), _from_mxfp8(_layout), fmts=("mxfp8_e4m3",), detect=_detect_mxfp8)
register_layout("fp8", to_fp8, from_fp8, fmts=(_FMT,))
register_layout(_BLOCK, to_fp8_block, from_fp8_block, fmts=(_FMT,))
