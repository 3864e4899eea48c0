"""Reading and writing safetensors files with the ml_dtypes types (fp8, e8m0, fp4, bf16) numpy lacks.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
``dtype``, ``shape`` and ``data_offsets`` within the byte buffer that follows (plus optional
``__metadata__`` strings), then the tensors' bytes, little-endian and C-ordered, with no holes.

The official ``safetensors`` package parses and validates every header (its rules, its errors, which
become ``ValueError`` s naming the file and, where one is at fault, the tensor); this module only maps
its dtype codes to numpy/ml_dtypes types and moves the bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import safetensors

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz), "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# Stored two per byte, element 2i in the low nibble (the little-endian bitstream of jquant.formats.packing);
# in memory one value per byte, as ml_dtypes keeps them. The header's shape counts values, not bytes.
SUBBYTE_DTYPES = {"F4": np.dtype(ml_dtypes.float4_e2m1fn)}
_NAMES = {v: k for k, v in (DTYPES | SUBBYTE_DTYPES).items()}
# Bits per element of every code the package knows, for naming the tensor at fault in a rejected file
# (C64 and the F6 codes are valid files this module does not read).
_BITS = {k: v.itemsize * 8 for k, v in DTYPES.items()} | {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
_MAX_HEADER = 100_000_000  # the package refuses longer headers


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` (numpy or ml_dtypes arrays) and the optional str → str ``metadata`` to ``path``."""
    where = os.fspath(path)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata for {where!r} must map str to str; entry {key!r}: {value!r} "
                            "is not (convert it with str() or json.dumps)")
    keep = []  # the buffers the specs point at, alive until the file is written
    specs = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"{where!r}: tensor name {name!r} is not allowed (names are str, not '__metadata__')")
        arr = np.asarray(tensor)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if arr.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        kind = arr.dtype.name
        if _NAMES[arr.dtype] == "F4":
            arr, kind = _pack_f4(arr, name, where), "float4_e2m1fn_x2"
        arr = np.asarray(arr, order="C")  # not ascontiguousarray, which turns a scalar into shape (1,)
        keep.append(arr)
        specs[name] = safetensors.TensorSpec(dtype=kind, shape=arr.shape, data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    try:
        safetensors.serialize_file(specs, where, metadata=dict(metadata) if metadata else None)
    except safetensors.SafetensorError as e:
        raise ValueError(f"cannot write safetensors file {where!r}: {e}") from e
    # The package (0.8.0) writes a temporary file of mode 0600 and renames it into place, so the
    # checkpoint would be readable by its owner only; give it the mode open() would have.
    os.chmod(where, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, without changing it where Linux reports it (os.umask can only swap it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _layout(where: str, names=None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype code, shape) of the tensors of ``names`` (None: all) the file holds, in file order,
    each of a dtype this module reads; the package validates the header."""
    try:
        with safetensors.safe_open(where, "numpy") as f:
            keys = [k for k in f.offset_keys() if names is None or k in names]
            slices = [(name, f.get_slice(name)) for name in keys]
            layout = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in slices]
    except safetensors.SafetensorError as e:
        raise ValueError(_rejection(where, e)) from e
    for name, code, _ in layout:
        if code not in _NAMES.values():
            raise ValueError(f"{where!r}: tensor {name!r} has dtype {code!r}, which jquant does not read "
                             f"(it reads {', '.join(_NAMES.values())})")
    return layout


def _read_into(f, where: str, name: str, code: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor at ``f``'s position, read straight into the array returned."""
    sub = code in SUBBYTE_DTYPES
    nbytes = math.prod(shape) * _BITS[code] // 8
    arr = np.empty(nbytes if sub else shape, np.uint8 if sub else DTYPES[code])
    if f.readinto(arr.reshape(-1).view(np.uint8)) != nbytes:
        raise ValueError(f"{where!r} changed while it was read (tensor {name!r} cut short); read it again")
    return _unpack_f4(arr, shape) if sub else arr


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor in the safetensors file ``path``, as writable numpy arrays.

    Raises ValueError naming the file (and the tensor, where one is at fault) for a malformed file or a
    dtype this module does not read.
    """
    where = os.fspath(path)
    layout = _layout(where)
    # The package checked that the tensors tile the data without holes in this order, so each one's bytes
    # follow the previous one's; readinto copies them once, straight into the arrays returned. A 512 MiB
    # bf16 file: 0.42 s, against 1.07 s for safetensors.numpy.load_file (2-core CPU, warm page cache).
    with open(where, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        total = sum(math.prod(shape) * _BITS[code] // 8 for _, code, shape in layout)
        if os.fstat(f.fileno()).st_size != 8 + n + total:
            raise ValueError(f"{where!r} changed while it was read; read it again")
        f.seek(8 + n)
        return {name: _read_into(f, where, name, code, shape) for name, code, shape in layout}


def load_tensors(path: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The tensors of ``names`` that the safetensors file ``path`` holds, read alone (a checkpoint's
    scalar KV-cache scales without its weights); ValueErrors as ``load_file``'s."""
    where = os.fspath(path)
    layout = _layout(where, set(names))
    if not layout:
        return {}
    with open(where, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        offsets = json.loads(f.read(n))
        out = {}
        for name, code, shape in layout:
            f.seek(8 + n + offsets[name]["data_offsets"][0])
            out[name] = _read_into(f, where, name, code, shape)
    return out


def _pack_f4(arr: np.ndarray, name: str, where: str) -> np.ndarray:
    if arr.ndim == 0 or arr.shape[-1] % 2:
        raise ValueError(f"{where!r}: float4_e2m1fn tensor {name!r} of shape {arr.shape} cannot be stored: F4 packs "
                         "two values per byte along the last axis, which must have even length (pad it)")
    codes = np.ascontiguousarray(arr).view(np.uint8) & 0xF
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_f4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2], codes[1::2] = packed & 0xF, packed >> 4
    return codes.view(SUBBYTE_DTYPES["F4"]).reshape(shape)


def _rejection(where: str, error: Exception) -> str:
    found = _diagnosis(where)
    return f"{where!r} is not a safetensors file: {found + '; ' if found else ''}{error} (re-export or re-download it)"


def _diagnosis(where: str) -> str:
    """What is wrong with the file the package refused, in particular which tensor's header entry, where
    the header is readable JSON; only for the error message."""
    with open(where, "rb") as f:
        head, size = f.read(8), os.fstat(f.fileno()).st_size
        if len(head) < 8:
            return f"only {size} bytes, fewer than the 8 of the header length"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"header length {n} exceeds the file size {size}"
        raw = f.read(min(n, _MAX_HEADER))
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(header, dict):
        return ""
    body, spans = size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            return f"tensor {name!r} needs 'dtype', 'shape' and 'data_offsets'"
        code, shape, span = info["dtype"], info["shape"], info["data_offsets"]
        if code not in _BITS:
            return f"tensor {name!r} has unknown dtype {code!r}"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers"
        if not (isinstance(span, list) and len(span) == 2 and all(type(o) is int for o in span)
                and 0 <= span[0] <= span[1]):
            return f"tensor {name!r} has data_offsets {span!r}, not [start, end] with 0 <= start <= end"
        if span[1] > body:
            return f"tensor {name!r} has data_offsets {span} past the end of the {body}-byte data"
        bits = math.prod(shape) * _BITS[code]
        if (span[1] - span[0]) * 8 != bits:
            return (f"tensor {name!r} has shape {shape} of {code} ({bits} bits) but data_offsets {span} "
                    f"({span[1] - span[0]} bytes)")
        spans.append((span, name))
    end = 0
    for span, name in sorted(spans):
        if span[0] != end:
            how = "overlap" if span[0] < end else "leave a hole after"
            return f"tensor {name!r} has data_offsets {span}, which {how} the tensor before (ending at {end})"
        end = span[1]
    return ""
