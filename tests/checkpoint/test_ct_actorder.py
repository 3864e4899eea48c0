"""compressed-tensors act-order (``actorder: "group"``) W4A16: ``weight_g_idx`` ⇄ ``QTensor.group_index``."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jquant import scheme_from_config
from jquant.checkpoint import from_checkpoint, to_checkpoint
from jquant.formats.integer import quantize_int_with_params
from qtensor_checks import assert_same_qtensor

GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "goldens" / "compressed_tensors_actorder.npz")
CASES = sorted({k[: -len("_config")] for k in GOLDEN.files if k.endswith("_config")})
NAMES = ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx", "weight_zero_point")


def _case(case):
    bits, group, symmetric = (int(v) for v in GOLDEN[f"{case}_config"])
    tensors = {name: GOLDEN[f"{case}_{name}"] for name in NAMES if f"{case}_{name}" in GOLDEN.files}
    tensors["weight_scale"] = GOLDEN[f"{case}_scale"]
    return bits, group, bool(symmetric), tensors


def _golden_qtensor(case):
    """The QTensor of the golden's qparams: compressed-tensors' signed zero points + 2**(b-1)."""
    bits, _, symmetric, _ = _case(case)
    zero = None if symmetric else GOLDEN[f"{case}_zero_point"].astype(np.int32) + 2 ** (bits - 1)
    return quantize_int_with_params(GOLDEN[f"{case}_weight"], bits, GOLDEN[f"{case}_scale"], zero,
                                    GOLDEN[f"{case}_weight_g_idx"], axis=1)


def test_golden_permutation_is_act_order():
    for case in CASES:
        _, group, _, tensors = _case(case)
        g_idx = tensors["weight_g_idx"]
        assert not np.array_equal(g_idx, np.arange(g_idx.size) // group)
        assert np.all(np.bincount(g_idx) == group)


@pytest.mark.parametrize("case", CASES)
def test_load_matches_compressed_tensors_dequantize(case):
    bits, group, symmetric, tensors = _case(case)
    qt = from_checkpoint(tensors, "compressed-tensors")
    assert qt.fmt == f"{'int' if symmetric else 'uint'}{bits}" and qt.block == (1, group)
    np.testing.assert_array_equal(np.asarray(qt.group_index), tensors["weight_g_idx"])
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), GOLDEN[f"{case}_dequant"])


@pytest.mark.parametrize("case", CASES)
def test_export_bytes_match_compressed_tensors(case):
    *_, tensors = _case(case)
    out = to_checkpoint(_golden_qtensor(case), "compressed-tensors")
    assert set(out) == set(tensors)
    for name, expected in tensors.items():
        assert out[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(out[name], expected, err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bit_identical(case):
    qt = _golden_qtensor(case)
    assert_same_qtensor(from_checkpoint(to_checkpoint(qt, "compressed-tensors"), "compressed-tensors"), qt)


def test_bad_g_idx_is_refused():
    *_, tensors = _case("int4_g32_asym")
    with pytest.raises(ValueError, match=r"'weight_g_idx' has shape \(255,\), expected \(256,\)"):
        from_checkpoint({**tensors, "weight_g_idx": tensors["weight_g_idx"][:-1]}, "compressed-tensors")
    with pytest.raises(ValueError, match=r"weight_g_idx values must lie in \[0, 8\)"):
        from_checkpoint({**tensors, "weight_g_idx": tensors["weight_g_idx"] + 1}, "compressed-tensors")


def test_trivial_g_idx_loads_without_group_index():
    *_, tensors = _case("int4_g32_sym")
    qt = from_checkpoint({**tensors, "weight_g_idx": (np.arange(256) // 32).astype(np.int32)}, "compressed-tensors")
    assert qt.group_index is None


def test_load_hf_checkpoint_honours_weight_g_idx(tmp_path):
    from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint
    from jquant.checkpoint.safetensors_file import save_file

    n, k, group = 32, 64, 32
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                           "group_size": group, "actorder": "group"}}}}
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    g_idx = (np.argsort(rng.permutation(k)) // group).astype(np.int32)
    qt = quantize_int_with_params(w, 4, np.full((n, k // group), 0.25, np.float32),
                                  rng.integers(0, 16, (n, k // group)), g_idx, axis=1)
    tensors = {f"lm_head.{name}": value for name, value in to_checkpoint(qt, "compressed-tensors").items()}
    assert "lm_head.weight_g_idx" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"))
    like = {"lm_head": {"kernel": jax.ShapeDtypeStruct((k, n), jnp.float32)}}
    loaded = load_hf_checkpoint(tmp_path, like, quantization_config=config, prepare=False)
    back = loaded["lm_head"]["kernel"].qtensor
    np.testing.assert_array_equal(np.asarray(back.group_index), g_idx)
    np.testing.assert_array_equal(np.asarray(back.dequantize(jnp.float32)), np.asarray(qt.dequantize(jnp.float32)))
    assert loaded["lm_head"]["kernel"].scheme == scheme_from_config(config)
