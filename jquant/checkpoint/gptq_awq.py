"""GPTQ, AWQ and compressed-tensors ``pack-quantized`` checkpoints of ``int*`` / ``uint*`` QTensors.

All three take a weight ``[N, K]`` grouped along K (``block == (1, G)``) and store unsigned codes in
little-endian int32 words (code ``i`` of a run at bits ``[i·b, (i+1)·b)``, so 3-bit codes run 32 to
three words), scales, and zero points; symmetric ``int*`` tensors store the zero point ``2**(b-1)``
(GPTQ, AWQ) or none (compressed-tensors).

* ``gptq``: ``qweight`` int32 ``[K·b/32, N]`` (packed along K), ``qzeros`` int32 ``[K/G, ⌈N·b/32⌉]``
  (packed along N), ``scales`` ``[K/G, N]`` (float16; bfloat16 kept), ``g_idx`` int32 ``[K]``.
  ``checkpoint_format="gptq"`` (v1) stores each zero point minus one, field by field modulo
  ``2**b`` (gptqmodel's logical conversion; it is its word-wide subtraction whenever no zero point
  is 0). A v1 zero point of 0 is unreadable for vLLM's ``+1`` decoder, so writing one is refused and
  reading a stored ``2**b - 1`` warns; ``"gptq_v2"`` stores them as they are. A non-trivial ``g_idx`` (act-order) is
  ``QTensor.group_index``.
* ``awq`` (4-bit): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]`` packed along N
  with the nibble order ``AWQ_ORDER`` (nibble ``p`` of a word holds column ``8c + AWQ_ORDER[p]``),
  ``scales`` ``[K/G, N]``.
* ``compressed-tensors/pack-quantized`` (4 and 8 bits): ``weight_packed`` int32 ``[N, ⌈K·b/32⌉]``
  (packed along K), ``weight_scale`` ``[N, K/G]`` in the QTensor's scale dtype, ``weight_shape`` int64
  ``[N, K]``, for ``uint*`` ``weight_zero_point`` int32 ``[⌈N·b/32⌉, K/G]`` (packed along N) and, for
  act-order (``actorder: "group"``), ``weight_g_idx`` int32 ``[K]``, GPTQ's ``g_idx``: it is read
  whenever present, so loading needs nothing from the config. compressed-tensors keeps signed codes
  and adds ``2**(b-1)`` when packing, which is exactly the stored unsigned code here.

Exports are exact: GPTQ/AWQ scales that float16 cannot hold exactly (float32 scales in general)
raise a ValueError naming the tensor and the error, unless ``lossy=True`` asks to round them (with a
warning); quantize with ``scale_dtype=jnp.float16`` (the gptq and awq schemes do) to export as is.

``from_checkpoint`` takes ``sym`` (None: GPTQ/AWQ infer it from all zero points being ``2**(b-1)``,
compressed-tensors from ``weight_zero_point`` being absent), ``bits`` and ``group_size`` (inferred from
the shapes when None, checked when given) and ``dtype`` (the logical dtype ``QTensor.dtype``; default
float32 whatever the stored scales' dtype).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np

from jquant.checkpoint.base import check_exact, register_layout, require
from jquant.formats.integer import int_format, parse_int_format
from jquant.formats.packing import bytes_to_int32, codes_per_group, int32_to_bytes, pack_bits, unpack_bits
from jquant.qtensor import QTensor

GPTQ_BITS = (2, 3, 4, 8)
CT_BITS = (4, 8)
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
AWQ_REVERSE_ORDER = np.argsort(AWQ_ORDER)  # [0, 4, 1, 5, 2, 6, 3, 7]
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
CT_LAYOUT = "compressed-tensors/pack-quantized"


def _fmts(bits):
    return tuple(int_format(b, s) for b in bits for s in (True, False))


# ---- word packing ---------------------------------------------------------------------------------
def _codes_to_words(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned codes along ``axis`` → ``⌈n·bits/32⌉`` little-endian int32 words (zero-padded)."""
    n = codes.shape[axis]
    pads = [(0, 0)] * codes.ndim
    pads[axis] = (0, -n % 32)
    words = bytes_to_int32(np.asarray(pack_bits(np.pad(codes, pads), bits, axis)), axis)
    return np.take(words, np.arange(-(-n * bits // 32)), axis=axis)


def _words_to_codes(words: np.ndarray, bits: int, count: int, axis: int) -> np.ndarray:
    """Inverse of ``_codes_to_words``: the first ``count`` codes (uint8) along ``axis``."""
    packed = int32_to_bytes(words, axis)
    pads = [(0, 0)] * packed.ndim
    pads[axis] = (0, -packed.shape[axis] % codes_per_group(bits)[1])
    codes = np.asarray(unpack_bits(np.pad(packed, pads), bits, axis))
    return np.take(codes, np.arange(count), axis=axis)


# ---- checks -----------------------------------------------------------------------------------------
def _check_qtensor(qt: QTensor, layout: str, allowed_bits) -> tuple[int, bool, int, int, int]:
    """(bits, symmetric, N, K, G) of a QTensor a layout can store, else a ValueError."""
    bits, symmetric = parse_int_format(qt.fmt)
    if bits not in allowed_bits:
        raise ValueError(f"{layout} stores {allowed_bits}-bit codes, got QTensor.fmt={qt.fmt!r}")
    if qt.ndim != 2 or qt.block[0] != 1 or qt.pack_axis not in (1, None):
        raise ValueError(f"{layout} stores a weight [N, K] quantized in groups along K (block (1, G), packed "
                         f"along axis 1); got shape {qt.shape}, block {qt.block}, pack_axis {qt.pack_axis}")
    if isinstance(qt.scale, QTensor):
        raise ValueError(f"{layout} cannot store double-quantized (nested QTensor) scales")
    n, k = qt.shape
    return bits, symmetric, n, k, qt.block[1]


def _zero_codes(qt: QTensor, bits: int) -> np.ndarray:
    """Zero points [N, K/G] as uint8; ``2**(b-1)`` for symmetric tensors."""
    if qt.zero is None:
        return np.full(np.shape(qt.scale), 2 ** (bits - 1), np.uint8)
    return np.asarray(qt.zero, np.uint8)


def _unsigned_codes(qt: QTensor, bits: int) -> np.ndarray:
    data = np.asarray(qt.data)
    return data if qt.pack_axis is None else np.asarray(unpack_bits(data, bits, qt.pack_axis))


def _store_scale_16(qt: QTensor, layout: str, lossy: bool) -> np.ndarray:
    """GPTQ/AWQ scales [N, K/G]: float16 (gptqmodel casts float32 scales to float16), bfloat16 kept."""
    scale = np.asarray(qt.scale)
    if scale.dtype in (np.float16, jnp.bfloat16):
        return scale
    with np.errstate(over="ignore"):  # overflow to inf is reported by check_exact
        stored = scale.astype(np.float16)
    check_exact(scale, stored, what=f"tensor 'scales' ({scale.dtype} QTensor scales stored as float16)",
                layout=layout, lossy=lossy,
                fix=f"quantize with scale_dtype=jnp.float16 (as the {layout} schemes do)")
    return stored


def _tensor(tensors: dict, name: str, layout: str, shape=None, kind: str = "int32") -> np.ndarray:
    """``tensors[name]`` as numpy after checking its dtype kind ("int32", "int", "float") and shape."""
    a = np.asarray(tensors[name])
    ok = {"int32": a.dtype == np.int32, "int": jnp.issubdtype(a.dtype, jnp.integer),
          "float": jnp.issubdtype(a.dtype, jnp.floating)}[kind]
    if not ok:
        raise ValueError(f"{layout}: tensor {name!r} must have dtype {kind}, got {a.dtype} with shape {a.shape}")
    if shape is not None and a.shape != tuple(shape):
        raise ValueError(f"{layout}: tensor {name!r} has shape {a.shape}, expected {tuple(shape)}")
    return a


def _matrix(tensors, name, layout, kind="int32"):
    a = _tensor(tensors, name, layout, kind=kind)
    if a.ndim != 2:
        raise ValueError(f"{layout}: tensor {name!r} must be 2-D, got shape {a.shape}")
    return a


def _group_size(k: int, groups: int, group_size, layout: str, scales_name: str) -> int:
    if groups == 0 or k % groups:
        raise ValueError(f"{layout}: {scales_name} holds {groups} groups, which do not divide K={k}")
    g = k // groups
    if group_size is not None and (k if group_size == -1 else group_size) != g:
        raise ValueError(f"{layout}: group_size={group_size} given, but {scales_name} holds {groups} groups "
                         f"for K={k} (group size {g})")
    return g


def _group_index(g_idx: np.ndarray | None, k: int, groups: int, group: int, layout: str, name: str):
    """An act-order ``g_idx`` as ``QTensor.group_index``; None when absent or ``i // G`` (no act-order)."""
    if g_idx is None or np.array_equal(g_idx, np.arange(k) // group):
        return None
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{layout}: {name} values must lie in [0, {groups}), got [{g_idx.min()}, {g_idx.max()}]")
    return g_idx


def _is_symmetric(zeros: np.ndarray, bits: int, sym, layout: str) -> bool:
    all_mid = bool(np.all(zeros == 2 ** (bits - 1)))
    if sym and not all_mid:
        raise ValueError(f"{layout}: sym=True but the zero points are not all {2 ** (bits - 1)}")
    return all_mid if sym is None else bool(sym)


def _qtensor(codes_nk, zeros_ngroups, scales_ngroups, bits, symmetric, group, dtype, group_index=None):
    """Builds the QTensor from codes [N, K], zero points and scales [N, K/G] (numpy)."""
    n, k = codes_nk.shape
    data = codes_nk if bits == 8 else np.asarray(pack_bits(codes_nk, bits, 1))
    return QTensor(data=jnp.asarray(data), scale=jnp.asarray(scales_ngroups),
                   zero=None if symmetric else jnp.asarray(zeros_ngroups, jnp.uint8),
                   group_index=None if group_index is None else jnp.asarray(group_index, jnp.int32),
                   fmt=int_format(bits, symmetric), shape=(n, k), dtype=dtype,
                   block=(1, group), pack_axis=None if bits == 8 else 1)


# ---- GPTQ --------------------------------------------------------------------------------------------
def _check_checkpoint_format(checkpoint_format):
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {GPTQ_CHECKPOINT_FORMATS}, got {checkpoint_format!r}")


def gptq_to_checkpoint(qt: QTensor, checkpoint_format: str = "gptq", desc_act: bool | None = None,
                       lossy: bool = False):
    _check_checkpoint_format(checkpoint_format)
    bits, _, n, k, group = _check_qtensor(qt, "gptq", GPTQ_BITS)
    if k * bits % 32:
        raise ValueError(f"gptq: K={k} must make whole int32 words of {bits}-bit codes (K·{bits} % 32 == 0)")
    if desc_act is False and qt.group_index is not None:
        raise ValueError("gptq: desc_act=False, but the QTensor has an act-order group_index")
    zeros = _zero_codes(qt, bits)
    if checkpoint_format == "gptq":
        if np.any(zeros == 0):
            # v1 stores zero - 1: a 0 would be stored as 2**bits - 1, which vLLM's decoder reads back as
            # 2**bits (and gptqmodel's word-wide one takes a borrow from the neighbour): silently wrong.
            channels, groups = np.nonzero(np.asarray(zeros) == 0)   # zeros: [N, K / G]
            raise ValueError(f"gptq: zero point 0 (output channels {channels[:4].tolist()}, groups "
                             f"{groups[:4].tolist()}, ...) cannot be stored in checkpoint_format='gptq' (v1 stores "
                             "each zero point minus one); write checkpoint_format='gptq_v2'")
        zeros = (zeros.astype(np.int32) - 1) % 2 ** bits
    g_idx = np.arange(k, dtype=np.int32) // group if qt.group_index is None else qt.group_index
    return {
        "qweight": np.ascontiguousarray(_codes_to_words(_unsigned_codes(qt, bits).T, bits, axis=0)),
        "qzeros": _codes_to_words(np.ascontiguousarray(zeros.T).astype(np.uint8), bits, axis=1),
        "scales": np.ascontiguousarray(_store_scale_16(qt, "gptq", lossy).T),
        "g_idx": np.asarray(g_idx, np.int32),
    }


def _infer_gptq_bits(qweight, qzeros, n, k, layout):
    if k is not None:
        found = [b for b in GPTQ_BITS if k * b == 32 * qweight.shape[0]]
    else:
        found = [b for b in GPTQ_BITS if -(-n * b // 32) == qzeros.shape[1]]
    if len(found) != 1:
        raise ValueError(f"{layout}: cannot infer bits from qweight {qweight.shape} / qzeros {qzeros.shape}; "
                         f"pass bits=")
    return found[0]


def gptq_from_checkpoint(tensors: dict, checkpoint_format: str = "gptq", sym: bool | None = None,
                         bits: int | None = None, group_size: int | None = None, desc_act: bool | None = None,
                         dtype=jnp.float32) -> QTensor:
    layout = "gptq"
    _check_checkpoint_format(checkpoint_format)
    require(tensors, ("qweight", "qzeros", "scales"), layout)
    scales = _matrix(tensors, "scales", layout, kind="float")
    qweight, qzeros = _matrix(tensors, "qweight", layout), _matrix(tensors, "qzeros", layout)
    groups, n = scales.shape
    g_idx = _tensor(tensors, "g_idx", layout, kind="int") if "g_idx" in tensors else None
    if g_idx is not None and g_idx.ndim != 1:
        raise ValueError(f"{layout}: tensor 'g_idx' must be 1-D [K], got shape {g_idx.shape}")
    if bits is None:
        bits = _infer_gptq_bits(qweight, qzeros, n, None if g_idx is None else g_idx.shape[0], layout)
    elif bits not in GPTQ_BITS:
        raise ValueError(f"{layout}: bits must be one of {GPTQ_BITS}, got {bits!r}")
    k = qweight.shape[0] * 32 // bits if g_idx is None else g_idx.shape[0]
    group = _group_size(k, groups, group_size, layout, "scales")
    _tensor(tensors, "qweight", layout, (k * bits // 32, n))
    _tensor(tensors, "qzeros", layout, (groups, -(-n * bits // 32)))
    group_index = _group_index(g_idx, k, groups, group, layout, "g_idx")
    if group_index is not None and desc_act is False:
        raise ValueError(f"{layout}: desc_act=False, but g_idx is not i // {group} (act-order)")
    zeros = _words_to_codes(qzeros, bits, n, axis=1)
    if checkpoint_format == "gptq":
        if np.any(zeros == 2 ** bits - 1):
            warnings.warn(f"gptq: a v1 zero-point field holds {2 ** bits - 1} (a zero point of 0 stored minus "
                          f"one): read as 0 here, as {2 ** bits} by vLLM's v1 decoder; the writer of this "
                          "checkpoint should have used checkpoint_format='gptq_v2'", stacklevel=2)
        zeros = ((zeros.astype(np.int32) + 1) % 2 ** bits).astype(np.uint8)
    codes = _words_to_codes(qweight, bits, k, axis=0).T
    return _qtensor(np.ascontiguousarray(codes), np.ascontiguousarray(zeros.T), np.ascontiguousarray(scales.T),
                    bits, _is_symmetric(zeros, bits, sym, layout), group, dtype, group_index)


# ---- AWQ ---------------------------------------------------------------------------------------------
def _awq_interleave(codes_kn: np.ndarray) -> np.ndarray:
    rows, n = codes_kn.shape
    return codes_kn.reshape(rows, n // 8, 8)[..., AWQ_ORDER].reshape(rows, n)


def _awq_deinterleave(codes_kn: np.ndarray) -> np.ndarray:
    rows, n = codes_kn.shape
    return codes_kn.reshape(rows, n // 8, 8)[..., AWQ_REVERSE_ORDER].reshape(rows, n)


def awq_to_checkpoint(qt: QTensor, lossy: bool = False) -> dict[str, np.ndarray]:
    _, _, n, _, _ = _check_qtensor(qt, "awq", (4,))
    if n % 8:
        raise ValueError(f"awq: N={n} (out_features) must be a multiple of 8")
    if qt.group_index is not None:
        raise ValueError("awq cannot store an act-order group_index")
    return {
        "qweight": _codes_to_words(_awq_interleave(_unsigned_codes(qt, 4).T), 4, axis=1),
        "qzeros": _codes_to_words(_awq_interleave(np.ascontiguousarray(_zero_codes(qt, 4).T)), 4, axis=1),
        "scales": np.ascontiguousarray(_store_scale_16(qt, "awq", lossy).T),
    }


def awq_from_checkpoint(tensors: dict, sym: bool | None = None, group_size: int | None = None,
                        dtype=jnp.float32) -> QTensor:
    layout = "awq"
    require(tensors, ("qweight", "qzeros", "scales"), layout)
    scales = _matrix(tensors, "scales", layout, kind="float")
    groups, n = scales.shape
    if n % 8:
        raise ValueError(f"{layout}: scales {scales.shape} give N={n}, which must be a multiple of 8")
    k = _matrix(tensors, "qweight", layout).shape[0]
    qweight = _tensor(tensors, "qweight", layout, (k, n // 8))
    qzeros = _tensor(tensors, "qzeros", layout, (groups, n // 8))
    group = _group_size(k, groups, group_size, layout, "scales")
    zeros = _awq_deinterleave(_words_to_codes(qzeros, 4, n, axis=1))
    codes = _awq_deinterleave(_words_to_codes(qweight, 4, n, axis=1))
    return _qtensor(np.ascontiguousarray(codes.T), np.ascontiguousarray(zeros.T), np.ascontiguousarray(scales.T),
                    4, _is_symmetric(zeros, 4, sym, layout), group, dtype)


# ---- compressed-tensors pack-quantized -------------------------------------------------------------
def ct_to_checkpoint(qt: QTensor) -> dict[str, np.ndarray]:
    bits, symmetric, n, k, _ = _check_qtensor(qt, CT_LAYOUT, CT_BITS)
    out = {"weight_packed": _codes_to_words(_unsigned_codes(qt, bits), bits, axis=1),
           "weight_scale": np.asarray(qt.scale),
           "weight_shape": np.array([n, k], np.int64)}
    if not symmetric:
        out["weight_zero_point"] = _codes_to_words(np.asarray(qt.zero, np.uint8), bits, axis=0)
    if qt.group_index is not None:
        out["weight_g_idx"] = np.asarray(qt.group_index, np.int32)
    return out


def ct_from_checkpoint(tensors: dict, sym: bool | None = None, bits: int | None = None,
                       group_size: int | None = None, dtype=jnp.float32) -> QTensor:
    layout = CT_LAYOUT
    require(tensors, ("weight_packed", "weight_scale", "weight_shape"), layout)
    n, k = (int(d) for d in _tensor(tensors, "weight_shape", layout, (2,), kind="int"))
    scales = _matrix(tensors, "weight_scale", layout, kind="float")
    packed = _matrix(tensors, "weight_packed", layout)
    if scales.shape[0] != n:
        raise ValueError(f"{layout}: tensor 'weight_scale' has shape {scales.shape}, expected ({n}, K/G) "
                         f"for weight_shape [{n}, {k}]")
    groups = scales.shape[1]
    if bits is None:
        found = [b for b in CT_BITS if packed.shape[1] == -(-k * b // 32)]
        if not found:
            others = [b for b in range(1, 9) if b not in CT_BITS and packed.shape[1] == -(-k * b // 32)]
            raise ValueError(f"{layout}: weight_packed {packed.shape} holds no 4- or 8-bit codes of K={k}"
                             + (f" (it fits {others[0]}-bit codes, which vLLM's pack-quantized kernels do not "
                                "take: 4 and 8 only)" if others else ""))
        if len(found) != 1:   # a K this small packs 4 and 8 bits into the same words
            raise ValueError(f"{layout}: weight_packed {packed.shape} fits both 4- and 8-bit codes of K={k}; "
                             "pass bits= (the config's num_bits)")
        bits = found[0]
    elif bits not in CT_BITS:
        raise ValueError(f"{layout}: bits must be one of {CT_BITS}, got {bits!r}")
    _tensor(tensors, "weight_packed", layout, (n, -(-k * bits // 32)))
    group = _group_size(k, groups, group_size, layout, "weight_scale")
    codes = _words_to_codes(packed, bits, k, axis=1)
    if "weight_zero_point" in tensors:
        zp = _tensor(tensors, "weight_zero_point", layout, (-(-n * bits // 32), groups))
        zeros = _words_to_codes(zp, bits, n, axis=0)
        symmetric = _is_symmetric(zeros, bits, sym, layout) if sym else False
    elif sym is False:
        raise ValueError(f"{layout}: sym=False but the checkpoint has no 'weight_zero_point'")
    else:
        zeros, symmetric = None, True
    g_idx = _tensor(tensors, "weight_g_idx", layout, (k,), kind="int") if "weight_g_idx" in tensors else None
    group_index = _group_index(g_idx, k, groups, group, layout, "weight_g_idx")
    return _qtensor(codes, zeros, scales, bits, symmetric, group, dtype, group_index)


def ct_detect(tensors: dict) -> bool:
    return "weight_packed" in tensors and np.asarray(tensors["weight_packed"]).dtype == np.int32


register_layout("gptq", gptq_to_checkpoint, gptq_from_checkpoint, fmts=_fmts(GPTQ_BITS), rounds=True)
register_layout("awq", awq_to_checkpoint, awq_from_checkpoint, fmts=_fmts((4,)), rounds=True)
register_layout(CT_LAYOUT, ct_to_checkpoint, ct_from_checkpoint, fmts=_fmts(CT_BITS), detect=ct_detect)
