"""Reading and writing safetensors files with the ml_dtypes types (fp8, e8m0, bf16) numpy lacks.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
``dtype``, ``shape`` and ``data_offsets`` within the byte buffer that follows (plus optional
``__metadata__`` strings), then the tensors' bytes, little-endian and C-ordered.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES = {v: k for k, v in DTYPES.items()}


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        blob = arr.tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the header is padded to an 8-byte boundary
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{str(path)!r} is not a safetensors file (only {len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{str(path)!r}: header length {n} exceeds the file size {len(data)}")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(body[start:end], DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return out
