import json
import os
import struct
import stat
import tempfile

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from safetensors.numpy import save as st_save

from jquant.checkpoint.safetensors_file import DTYPES, SUBBYTE_DTYPES, load_file, save_file


def test_round_trip_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    for code, dtype in DTYPES.items():
        raw = rng.integers(0, 256, size=(2, 3, dtype.itemsize), dtype=np.uint8)
        tensors[code] = raw.view(dtype).reshape(2, 3)
    save_file(tensors, tmp_path / "t.safetensors", metadata={"producer": "test"})
    back = load_file(tmp_path / "t.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k].view(np.uint8), v.view(np.uint8))


def test_interoperates_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    ours = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int32)}
    save_file(ours, tmp_path / "ours.safetensors")
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    for k in ours:
        np.testing.assert_array_equal(theirs[k], ours[k])
    st.save_file({"c": np.ones((2, 2), np.float16)}, str(tmp_path / "theirs.safetensors"))
    np.testing.assert_array_equal(load_file(tmp_path / "theirs.safetensors")["c"], np.ones((2, 2), np.float16))


def test_errors(tmp_path):
    with pytest.raises(TypeError, match="complex"):
        save_file({"z": np.zeros(2, np.complex64)}, tmp_path / "z.safetensors")
    (tmp_path / "bad").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors"):
        load_file(tmp_path / "bad")
    (tmp_path / "bad2").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds"):
        load_file(tmp_path / "bad2")
    assert ml_dtypes.float8_e8m0fnu in [d.type for d in DTYPES.values()]


# ---- malformed files: every one is a ValueError naming the file (and the tensor when one is at fault)


def _raw_file(path, header, body=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return path


def _f32(shape, offsets):
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


def _assert_rejected(path, *tensors):
    """load_file raises a ValueError naming ``path`` and, if given, one of ``tensors``."""
    with pytest.raises(ValueError) as e:
        load_file(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    assert not tensors or any(repr(t) in msg for t in tensors), msg


MALFORMED = {  # name: (header, body, the tensors the message may name)
    "offsets_past_the_end": ({"w": _f32([2], [0, 8])}, b"\0" * 4, ("w",)),
    "negative_offsets": ({"w": _f32([1], [-4, 0])}, b"\0" * 4, ("w",)),
    "overlapping_offsets": ({"a": _f32([1], [0, 4]), "b": _f32([1], [0, 4])}, b"\0" * 4, ("a", "b")),
    "shape_disagrees_with_bytes": ({"w": _f32([2], [0, 4])}, b"\0" * 4, ("w",)),
    "missing_field": ({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, ("w",)),
    "unknown_dtype": ({"w": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, b"\0", ("w",)),
    "offsets_not_a_pair": ({"w": _f32([1], [0, 4, 8])}, b"\0" * 4, ("w",)),
    "hole_before_a_tensor": ({"w": _f32([1], [4, 8])}, b"\0" * 8, ("w",)),
    "bytes_after_the_last_tensor": ({"w": _f32([1], [0, 4])}, b"\0" * 8, ()),
    "non_utf8_header": (b'{"\xff\xfe": 1}', b"", ()),
    "header_not_an_object": ([1, 2], b"", ()),
    "header_not_json": (b"{'w': 1}", b"", ()),
    "nul_padded_header": (b"{}\0\0\0\0\0\0", b"", ()),
    "deeply_nested_header": (b"[" * 100_000 + b"]" * 100_000, b"", ()),
    "deeply_nested_tensor": (b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", ()),
    "non_string_metadata": ({"__metadata__": {"n": 1}}, b"", ()),
    "metadata_not_an_object": ({"__metadata__": "text"}, b"", ()),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_a_value_error_naming_file_and_tensor(tmp_path, case):
    header, body, tensors = MALFORMED[case]
    _assert_rejected(_raw_file(tmp_path / f"{case}.safetensors", header, body), *tensors)


def test_truncated_body_names_the_cut_tensor(tmp_path):
    data = st_save({"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int16)})
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[:-3])
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    last = max(("a", "b"), key=lambda n: header[n]["data_offsets"])
    _assert_rejected(path, last)
    path.write_bytes(data[:5])
    _assert_rejected(path)


def test_header_length_past_the_end_and_short_file(tmp_path):
    assert load_file(_raw_file(tmp_path / "empty.safetensors", b"{}")) == {}
    (tmp_path / "long").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    _assert_rejected(tmp_path / "long")
    (tmp_path / "short").write_bytes(b"\0" * 7)
    _assert_rejected(tmp_path / "short")


def test_save_rejects_non_string_metadata(tmp_path):
    with pytest.raises((TypeError, ValueError), match="'n'"):
        save_file({"w": np.zeros(2, np.float32)}, tmp_path / "m.safetensors", metadata={"n": 1})
    with pytest.raises((TypeError, ValueError), match="metadata"):
        save_file({"w": np.zeros(2, np.float32)}, tmp_path / "m.safetensors", metadata={1: "x"})
    with pytest.raises((TypeError, ValueError), match="__metadata__"):
        save_file({"__metadata__": np.zeros(2, np.float32)}, tmp_path / "m.safetensors")


def _every_dtype(seed=0):
    """One small tensor per dtype with random bytes (every bit pattern, NaN/Inf/-0.0 included), plus a
    scalar, an empty tensor and a square matrix."""
    rng = np.random.default_rng(seed)
    out = {code: rng.integers(0, 256, size=(3, 4 * dt.itemsize), dtype=np.uint8).view(dt).reshape(3, 4)
           for code, dt in DTYPES.items()}
    out["BOOL"] = rng.integers(0, 2, size=(3, 4)).astype(np.bool_)  # numpy bools are 0 or 1 bytes
    out["scalar"] = np.array(-0.0, np.float32)
    out["empty"] = np.zeros((0, 5), ml_dtypes.bfloat16)
    out["square"] = rng.standard_normal((16, 16)).astype(ml_dtypes.float8_e4m3fn)
    return out


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    np.testing.assert_array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                  np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def _official(data):
    """The official package's reading of ``data``: {name: (dtype code, shape, bytes)}."""
    return {name: (v["dtype"], tuple(v["shape"]), bytes(v["data"])) for name, v in safetensors.deserialize(data)}


def _as_official(arr):
    code = [k for k, v in (DTYPES | SUBBYTE_DTYPES).items() if v == arr.dtype][0]
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if code == "F4":
        raw = raw[0::2] | (raw[1::2] << 4)
    return code, arr.shape, raw.tobytes()


def test_files_of_the_official_package_read_back_bit_exactly(tmp_path):
    tensors = _every_dtype(1)
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "np"})
    back = load_file(path)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        _same_bits(back[k], v)
        assert back[k].flags.writeable and back[k].flags.c_contiguous


def test_our_files_read_by_the_official_package(tmp_path):
    tensors = _every_dtype(2) | {"fp4": np.arange(16, dtype=np.uint8).reshape(2, 8).view(ml_dtypes.float4_e2m1fn)}
    path = tmp_path / "ours.safetensors"
    save_file(tensors, path, metadata={"n": "1"})
    data = path.read_bytes()
    assert _official(data) == {k: _as_official(v) for k, v in tensors.items()}
    with safetensors.safe_open(str(path), "numpy") as f:
        assert f.metadata() == {"n": "1"}


def test_fp4_is_two_per_byte_low_nibble_first(tmp_path):
    values = np.array([[0.5, -6.0, 0.0, -0.0], [1.0, 1.5, 4.0, -3.0]], ml_dtypes.float4_e2m1fn)
    path = tmp_path / "fp4.safetensors"
    save_file({"w": values}, path)
    (name, info), = safetensors.deserialize(path.read_bytes())
    assert info["dtype"] == "F4" and info["shape"] == [2, 4]
    assert bytes(info["data"]) == bytes([0x1 | 0xF << 4, 0x0 | 0x8 << 4, 0x2 | 0x3 << 4, 0x6 | 0xD << 4])
    _same_bits(load_file(path)["w"], values)
    with pytest.raises(ValueError, match="'odd'.*even"):
        save_file({"odd": values[:, :3]}, path)


def test_scalars_keep_their_empty_shape(tmp_path):
    save_file({"s": np.array(-0.0, np.float32), "e": np.array(1, np.int8)},
              tmp_path / "s.safetensors")
    back = load_file(tmp_path / "s.safetensors")
    assert back["s"].shape == () and back["e"].shape == ()
    assert np.signbit(back["s"]) and back["e"] == 1


def test_big_endian_and_strided_arrays_are_written_little_endian(tmp_path):
    x = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    save_file({"x": x}, tmp_path / "be.safetensors")
    back = load_file(tmp_path / "be.safetensors")["x"]
    assert back.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(back, x)


def _write_tmp(data):
    fd, name = tempfile.mkstemp(suffix=".safetensors")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return name


_BASE = st_save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.uint8),
                 "c": np.full((2, 2), 1.5, ml_dtypes.bfloat16)}, metadata={"k": "v"})
_CODES = sorted(DTYPES) + ["F4", "C64", "F6_E2M3", "Q8", ""]


def _header(draw):
    entry = hst.one_of(
        hst.fixed_dictionaries({"dtype": hst.sampled_from(_CODES), "shape": hst.lists(hst.integers(-1, 4), max_size=3),
                               "data_offsets": hst.lists(hst.integers(-2, 40), min_size=1, max_size=3)}),
        hst.integers(), hst.text(max_size=3), hst.lists(hst.integers(0, 8), max_size=2))
    header = draw(hst.dictionaries(hst.sampled_from(["a", "b", "__metadata__", "é"]), entry, max_size=3))
    return json.dumps(header).encode() + b" " * draw(hst.integers(0, 3))


@hst.composite
def _mutated_files(draw):
    kind = draw(hst.sampled_from(["flip", "truncate", "header"]))
    if kind == "flip":
        data = bytearray(_BASE)
        for _ in range(draw(hst.integers(1, 3))):
            data[draw(hst.integers(0, len(data) - 1))] = draw(hst.integers(0, 255))
        return bytes(data)
    if kind == "truncate":
        return _BASE[:draw(hst.integers(0, len(_BASE) - 1))]
    raw = _header(draw)
    return struct.pack("<Q", len(raw)) + raw + draw(hst.binary(max_size=48))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_files())
def test_fuzz_a_clear_error_or_what_the_official_package_reads(data):
    path = _write_tmp(data)
    try:
        try:
            ours = load_file(path)
        except ValueError as e:
            assert path in str(e)
            return
        assert {k: _as_official(v) for k, v in ours.items()} == _official(data)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_written_file_has_the_mode_open_gives(tmp_path, umask):
    # the package writes through a temporary file of mode 0600: a checkpoint others could not read
    old = os.umask(umask)
    try:
        path = tmp_path / "model.safetensors"
        save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
        with open(tmp_path / "plain.bin", "wb"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "plain.bin").st_mode)
