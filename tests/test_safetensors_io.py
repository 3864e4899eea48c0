import ml_dtypes
import numpy as np
import pytest

from jquant.safetensors_io import DTYPES, load_file, save_file


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
