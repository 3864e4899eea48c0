"""The ``"bnb"`` layout: what bitsandbytes/transformers save for a ``Linear4bit`` weight (Params4bit), and
for a ``Linear8bitLt`` one (Int8Params, LLM.int8()).

Tensors, named relative to the module (``Linear4bit._save_to_state_dict`` +
``QuantState.as_dict(packed=True)``, bitsandbytes 0.50.2):

| name | dtype | shape |
|---|---|---|
| weight | uint8 | [ceil(n/2), 1]: codes packed two per byte, even element in the high nibble |
| weight.absmax | float32 (uint8 codes with double quant) | [ceil(n/blocksize)] |
| weight.quant_map | float32 | [16]: the 4-bit table |
| weight.nested_absmax | float32 | [ceil(blocks/nested_blocksize)] (double quant only) |
| weight.nested_quant_map | float32 | [256]: the dynamic map (double quant only) |
| weight.quant_state.bitsandbytes__nf4 (or __fp4) | uint8 | [bytes]: the JSON below |

The JSON is ``json.dumps`` (UTF-8) of ``{"quant_type", "blocksize", "dtype", "shape"}`` followed, with
double quantization, by ``"nested_blocksize", "nested_dtype", "nested_offset"`` (a float; NaN as
``NaN``). ``n`` is the element count of the logical ``shape`` (PyTorch [N, K]), blocked row-major.
A weight stored with another ``quant_storage`` dtype (bnb's FSDP option) is read as its bytes.

``Linear8bitLt`` (an ``"int8_bnb"`` QTensor) saves ``weight`` int8 ``[N, K]`` (the codes), ``SCB``
float32 ``[N]`` (each row's absmax) and ``weight_format`` (a 0-d uint8, 0 for bitsandbytes' row-major
layout; older releases could save 1 or 2, tiled for Turing / Ampere, which are refused).
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np

from jquant.checkpoint.base import register_layout, require
from jquant.formats.bnb import FOUR_BIT_BLOCKSIZES, code_table, dynamic_map
from jquant.qtensor import QTensor

LAYOUT = "bnb"
QUANT_TYPES = {"nf4": "nf4", "fp4_bnb": "fp4"}  # QTensor.fmt -> bnb quant_type
_FORMATS = {v: k for k, v in QUANT_TYPES.items()}
_STATE_PREFIX = "weight.quant_state.bitsandbytes__"
_DTYPES = ("float32", "bfloat16", "float16")
INT8_FORMAT = "int8_bnb"
_ROW_FORMAT = 0   # bitsandbytes' weight_format code of the row-major int8 layout


def _json_tensor(fields: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(fields).encode("utf-8"), dtype=np.uint8).copy()


def _to_int8(qt: QTensor) -> dict[str, np.ndarray]:
    if qt.k_axis != 1:
        raise ValueError(f"{LAYOUT}: an int8_bnb weight is saved as [N, K] with K last; this one has K on axis "
                         f"{qt.k_axis}")
    return {"weight": np.asarray(qt.data, dtype=np.int8), "SCB": np.asarray(qt.scale, dtype=np.float32).reshape(-1),
            "weight_format": np.array(_ROW_FORMAT, dtype=np.uint8)}


def _from_int8(tensors: dict) -> QTensor:
    require(tensors, ["weight", "SCB"], LAYOUT)
    weight = np.asarray(tensors["weight"])
    if weight.dtype != np.int8 or weight.ndim != 2 or 0 in weight.shape:
        raise ValueError(f"{LAYOUT}: an 8-bit weight must be int8 [N, K], got {weight.dtype} with shape "
                         f"{weight.shape}")
    scb = _array(tensors, "SCB", np.float32, (weight.shape[0],))
    if "weight_format" in tensors:
        fmt = np.asarray(tensors["weight_format"])
        if fmt.size != 1 or not np.issubdtype(fmt.dtype, np.integer) or int(fmt.reshape(-1)[0]) != _ROW_FORMAT:
            raise ValueError(f"{LAYOUT}: weight_format {fmt.reshape(-1).tolist()} is not bitsandbytes' row-major "
                             f"layout (0); tiled Turing / Ampere layouts (1, 2) are not supported")
    return QTensor(data=jnp.asarray(weight), scale=jnp.asarray(scb).reshape(-1, 1), fmt=INT8_FORMAT,
                   shape=weight.shape, dtype=jnp.float32, block=(1, weight.shape[1]), k_axis=1)


def to_bnb(qt: QTensor) -> dict[str, np.ndarray]:
    """The tensors bnb saves for ``qt`` (an ``"nf4"`` / ``"fp4_bnb"`` / ``"int8_bnb"`` QTensor)."""
    if qt.fmt == INT8_FORMAT:
        return _to_int8(qt)
    quant_type = QUANT_TYPES[qt.fmt]
    fields = {"quant_type": quant_type, "blocksize": qt.block[0], "dtype": qt.dtype.name,
              "shape": list(qt.shape)}
    tensors = {"weight": np.asarray(qt.data, dtype=np.uint8).reshape(-1, 1)}
    if isinstance(qt.scale, QTensor):
        nested = qt.scale
        tensors["weight.absmax"] = np.asarray(nested.data, dtype=np.uint8)
        tensors["weight.quant_map"] = code_table(qt.fmt)
        tensors["weight.nested_absmax"] = np.asarray(nested.scale, dtype=np.float32)
        tensors["weight.nested_quant_map"] = dynamic_map()
        fields.update(nested_blocksize=nested.block[0], nested_dtype=nested.dtype.name,
                      nested_offset=float(np.asarray(nested.zero, dtype=np.float32)))
    else:
        tensors["weight.absmax"] = np.asarray(qt.scale, dtype=np.float32)
        tensors["weight.quant_map"] = code_table(qt.fmt)
    tensors[_STATE_PREFIX + quant_type] = _json_tensor(fields)
    return tensors


def _state_key(tensors: dict) -> str:
    keys = [k for k in tensors if k.startswith("weight.quant_state.")]
    if len(keys) != 1 or keys[0][len(_STATE_PREFIX):] not in _FORMATS:
        raise ValueError(f"{LAYOUT} checkpoint needs exactly one tensor named {_STATE_PREFIX}nf4 or "
                         f"{_STATE_PREFIX}fp4; got {sorted(tensors)}")
    return keys[0]


def _fields(tensors: dict, key: str) -> dict:
    raw = np.asarray(tensors[key])
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"{LAYOUT}: {key} must be 1-D uint8 (packed JSON), got {raw.dtype} {raw.shape}")
    try:
        fields = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{LAYOUT}: {key} does not hold UTF-8 JSON ({err})") from None
    quant_type = key[len(_STATE_PREFIX):]
    if not isinstance(fields, dict) or fields.get("quant_type") != quant_type:
        raise ValueError(f"{LAYOUT}: {key} must hold a JSON object with quant_type {quant_type!r}, "
                         f"got {fields!r}")
    shape = fields.get("shape")
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) and d > 0 for d in shape)):
        raise ValueError(f"{LAYOUT}: {key} has shape {shape!r}; expected a non-empty list of positive ints")
    if fields.get("blocksize") not in FOUR_BIT_BLOCKSIZES:
        raise ValueError(f"{LAYOUT}: {key} has blocksize {fields.get('blocksize')!r}; expected one of "
                         f"{FOUR_BIT_BLOCKSIZES}")
    if fields.get("dtype") not in _DTYPES:
        raise ValueError(f"{LAYOUT}: {key} has dtype {fields.get('dtype')!r}; expected one of {_DTYPES}")
    return fields


def _array(tensors: dict, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    value = np.asarray(tensors[name])
    if value.dtype != dtype or value.shape != shape:
        raise ValueError(f"{LAYOUT}: tensor {name} must be {np.dtype(dtype).name} with shape {shape}, "
                         f"got {value.dtype} with shape {value.shape}")
    return value


def _table(tensors: dict, name: str, expected: np.ndarray, what: str) -> None:
    value = _array(tensors, name, np.float32, expected.shape)
    if not np.array_equal(value.view(np.uint32), expected.view(np.uint32)):
        raise ValueError(f"{LAYOUT}: tensor {name} is not bitsandbytes' {what}; custom code books are not "
                         f"supported")


def _packed_weight(tensors: dict, n: int) -> np.ndarray:
    weight = np.ascontiguousarray(tensors["weight"])
    nbytes = -(-n // 2)
    if weight.ndim not in (1, 2) or (weight.ndim == 2 and weight.shape[1] != 1) or weight.nbytes != nbytes:
        raise ValueError(f"{LAYOUT}: tensor weight must hold {nbytes} bytes as [{nbytes}, 1] uint8 (the "
                         f"packed codes of {n} elements), got {weight.dtype} with shape {weight.shape}")
    return weight.reshape(-1).view(np.uint8)


def from_bnb(tensors: dict) -> QTensor:
    """Rebuilds the QTensor from a Linear4bit (or, with ``SCB``, a Linear8bitLt) weight's saved tensors."""
    if "SCB" in tensors:
        return _from_int8(tensors)
    if "weight" in tensors and np.asarray(tensors["weight"]).dtype == np.int8:
        raise ValueError(f"{LAYOUT}: an int8 weight (Linear8bitLt) needs its SCB tensor beside it; got "
                         f"{sorted(tensors)}")
    key = _state_key(tensors)
    require(tensors, ["weight", "weight.absmax", "weight.quant_map", key], LAYOUT)
    fields = _fields(tensors, key)
    fmt = _FORMATS[fields["quant_type"]]
    shape, blocksize = tuple(fields["shape"]), fields["blocksize"]
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    data = _packed_weight(tensors, n)
    _table(tensors, "weight.quant_map", code_table(fmt), f"{fields['quant_type']} table")
    if "weight.nested_absmax" in tensors:
        require(tensors, ["weight.nested_quant_map"], LAYOUT)
        nested_blocksize = fields.get("nested_blocksize")
        if not (isinstance(nested_blocksize, int) and nested_blocksize > 0 and fields.get("nested_dtype") == "float32"
                and isinstance(fields.get("nested_offset"), (int, float))):
            raise ValueError(f"{LAYOUT}: {key} must give a positive int nested_blocksize, nested_dtype "
                             f"'float32' and a number nested_offset with double quantization, got {fields!r}")
        _table(tensors, "weight.nested_quant_map", dynamic_map(), "dynamic map")
        codes = _array(tensors, "weight.absmax", np.uint8, (blocks,))
        nested_absmax = _array(tensors, "weight.nested_absmax", np.float32, (-(-blocks // nested_blocksize),))
        scale = QTensor(data=jnp.asarray(codes), scale=jnp.asarray(nested_absmax),
                        zero=jnp.asarray(np.float32(fields["nested_offset"])), fmt="bnb_dynamic8",
                        shape=(blocks,), dtype=jnp.float32, block=(nested_blocksize,))
    else:
        scale = jnp.asarray(_array(tensors, "weight.absmax", np.float32, (blocks,)))
    return QTensor(data=jnp.asarray(data), scale=scale, fmt=fmt, shape=shape,
                   dtype=jnp.dtype(fields["dtype"]), block=(blocksize,), pack_axis=0)


def _is_bnb(tensors: dict) -> bool:
    return "SCB" in tensors or any(k.startswith(_STATE_PREFIX) for k in tensors)


register_layout(LAYOUT, to_bnb, from_bnb, fmts=(*QUANT_TYPES, INT8_FORMAT), detect=_is_bnb)
