"""jquant's GPTQ against gptqmodel 7.6.0's own GPTQ loop on one layer (tests/goldens/gptqmodel_gptq_layer.npz).

The golden (tools/goldens/gptqmodel_gptq_layer.py) holds a weight W [256, 512] with outlier input
columns, heavy-tailed calibration activations X [2048, 512] with a few massive channels, and for each
configuration the codes, float32 scales, zero points and g_idx gptqmodel produced, and its layer
output MSE ``mean((X Wᵀ − X Qᵀ)²)``.

Two comparisons per configuration:

* float32 scales (``gptq_core.gptq_quantize(scale_dtype=float32)``), the arithmetic gptqmodel's loop
  uses: the codes, g_idx, zero points and (up to float32 rounding of the updated weights) scales
  must be gptqmodel's.
* the scheme as shipped (``gptq_quantize_weight``, float16 scales rounded *before* they quantize,
  see gptq_core's docstring): the first rounding differences feed back into later columns, so the
  codes drift apart a little along the processing order, but the layer output MSE stays gptqmodel's.

The floors below sit a little under what was measured (noted next to each); the measured values
are printed (``pytest -s``).
"""

import functools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jquant.algorithms.gptq import accumulate_hessian, gptq_quantize_weight
from jquant.algorithms.gptq_core import gptq_quantize
from jquant.schemes.spec import WeightSpec

GOLDEN = np.load(pathlib.Path(__file__).parent / "goldens" / "gptqmodel_gptq_layer.npz")
CASES = sorted(k[: -len("_config")] for k in GOLDEN.files if k.endswith("_config"))
W = GOLDEN["W"].astype(np.float32)
X = GOLDEN["X"].astype(np.float32)
DAMP, BLOCK = 0.01, 128

# Shipped float16 scales: fraction of codes equal to gptqmodel's (measured: asym4_g32 98.62 %,
# sym3_ch 99.81 %, sym4_g128 99.13 %, sym4_g128_act 99.25 %, sym4_g128_act_static 99.17 %).
CODE_FLOOR_FP16 = {"asym4_g32": 0.98, "sym3_ch": 0.995, "sym4_g128": 0.985, "sym4_g128_act": 0.985,
                   "sym4_g128_act_static": 0.985}


def _config(case):
    bits, group, sym, desc_act, static = (int(v) for v in GOLDEN[f"{case}_config"])
    return dict(bits=bits, group_size=None if group == -1 else group, symmetric=bool(sym),
                act_order=bool(desc_act), static_groups=bool(static))


def _reference(case):
    """gptqmodel's codes, scales, zero points, g_idx and dequantized weight."""
    codes, scales, zeros, g_idx = (GOLDEN[f"{case}_{k}"] for k in ("codes", "scales", "zeros", "g_idx"))
    weight = scales[:, g_idx] * (codes.astype(np.float32) - zeros[:, g_idx])
    return codes.astype(np.int32), scales, zeros, g_idx, weight


def _mse(q):
    diff = X.astype(np.float64) @ (W.astype(np.float64) - np.asarray(q, np.float64)).T
    return float(np.mean(diff ** 2))


def _codes(weight, scale, zero, g_idx):
    """Codes in gptqmodel's unsigned convention from a dequantized weight and its [N, G] params."""
    s, z = np.asarray(scale, np.float32)[:, g_idx], np.asarray(zero, np.float32)[:, g_idx]
    return (np.rint(np.asarray(weight) / np.where(s == 0, 1.0, s)) + z).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _hessian():
    return accumulate_hessian(jnp.asarray(X), W.shape[1]).h


@functools.lru_cache(maxsize=None)
def _float32_run(case):
    return gptq_quantize(jnp.asarray(W), _hessian(), damp_percent=DAMP, block_size=BLOCK,
                         scale_dtype=jnp.float32, **_config(case))


@functools.lru_cache(maxsize=None)
def _shipped_run(case):
    cfg = _config(case)
    spec = WeightSpec.integer(cfg["bits"], cfg["group_size"], symmetric=cfg["symmetric"], scale_dtype="float16")
    return gptq_quantize_weight(W, X, scheme=spec, damp_percent=DAMP, block_size=BLOCK,
                                act_order=cfg["act_order"], static_groups=cfg["static_groups"])


def test_golden_is_what_it_says():
    assert W.shape == (256, 512) and X.shape == (2048, 512)
    assert any(v.startswith("gptqmodel==7.6.0") for v in GOLDEN["meta_versions"])
    for case in CASES:
        *_, weight = _reference(case)
        np.testing.assert_allclose(_mse(weight), float(GOLDEN[f"{case}_mse"]), rtol=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_layer_mse_matches_gptqmodel(case):
    want = float(GOLDEN[f"{case}_mse"])
    got = _mse(_shipped_run(case).dequantize())
    ratio = got / want
    print(f"{case}: layer MSE jquant {got:.6g} / gptqmodel {want:.6g} = {ratio:.5f}")
    assert 0.5 <= ratio <= 2.0
    # Measured 0.9998 .. 1.0004: float16 scales neither help nor hurt beyond noise. (RTN with the
    # same scheme is 2.2x .. 4.7x gptqmodel's MSE here, so this band is the discriminating one.)
    assert abs(ratio - 1.0) <= 0.01


@pytest.mark.parametrize("case", CASES)
def test_float32_scales_reproduce_gptqmodel(case):
    cfg = _config(case)
    codes, scales, zeros, g_idx, weight = _reference(case)
    got = _float32_run(case)
    got_g_idx = np.asarray(got.g_idx)
    np.testing.assert_array_equal(got_g_idx, g_idx)  # act-order: the same argsort of diag(H)
    got_zero = np.full(scales.shape, 2 ** (cfg["bits"] - 1), np.float32) if got.zero is None else got.zero
    got_codes = _codes(got.weight, got.scale, got_zero, got_g_idx)
    agree = np.mean(got_codes == codes)
    same_weight = np.mean(np.asarray(got.weight) == weight)
    print(f"{case}: float32 scales: codes agree {agree:.5%}, dequantized values identical {same_weight:.2%}")
    assert agree >= 0.999  # measured 100 %
    assert np.mean(got_zero == zeros) >= 0.999  # measured: all 4096 asymmetric zero points equal
    same = got_codes == codes
    if cfg["static_groups"] or cfg["group_size"] is None:
        # Scales from the original weights: the same float32 arithmetic, bit for bit.
        np.testing.assert_array_equal(got.scale, scales)
        np.testing.assert_array_equal(np.asarray(got.weight)[same], weight[same])
    else:
        # Dynamic groups take the weights after earlier blocks' updates, which differ from
        # gptqmodel's in the last float32 bits (measured: at most 3.6e-6 relative). A flipped code
        # would move its row's later groups, so rows are compared where all their codes agree.
        rows = same.all(axis=1)
        assert rows.mean() >= 0.99  # measured: every row
        np.testing.assert_allclose(np.asarray(got.scale)[rows], scales[rows], rtol=2e-5)
        np.testing.assert_allclose(np.asarray(got.weight)[same], weight[same], rtol=2e-5, atol=0)
    # Its loss is gptqmodel's avg_loss (sum of per-column losses over the rows seen).
    np.testing.assert_allclose(float(np.asarray(got.loss).sum()) / X.shape[0],
                               float(GOLDEN[f"{case}_avg_loss"]), rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_float16_scales_stay_close_to_gptqmodel(case):
    cfg = _config(case)
    codes, scales, zeros, g_idx, _ = _reference(case)
    qt = _shipped_run(case)
    got_g_idx = np.asarray(g_idx if qt.group_index is None else qt.group_index)
    np.testing.assert_array_equal(got_g_idx, g_idx)
    scale = np.asarray(qt.scale, np.float32)
    zero = (np.full(scale.shape, 2 ** (cfg["bits"] - 1), np.float32) if qt.zero is None
            else np.asarray(qt.zero, np.float32))
    got_codes = _codes(qt.dequantize(), scale, zero, got_g_idx)
    agree = np.mean(got_codes == codes)
    # A checkpoint of gptqmodel's holds its float32 scales rounded to float16.
    want_scale = scales.astype(np.float16).astype(np.float32)
    same_scale = np.mean(scale == want_scale)
    print(f"{case}: float16 scales: codes agree {agree:.4%}, scales equal to float16(gptqmodel's) {same_scale:.2%}")
    assert agree >= CODE_FLOOR_FP16[case]
    # The first group in processing order sees no error feedback yet: its scales are gptqmodel's, rounded.
    first = got_g_idx[np.argsort(-np.diag(np.asarray(_hessian())), kind="stable")[0]] if cfg["act_order"] else 0
    np.testing.assert_array_equal(scale[:, first], want_scale[:, first])
    if cfg["static_groups"] or cfg["group_size"] is None:
        np.testing.assert_array_equal(scale, want_scale)  # measured: all equal
    else:
        assert same_scale >= 0.8  # measured 84.7 % (g32), 87.2 % and 91.0 % (g128)
        # The rest differ where the drifted weights moved a group's extreme: mostly by little.
        rel = np.abs(scale - want_scale) / want_scale
        assert np.median(rel) == 0 and np.percentile(rel, 99) <= 0.03  # measured p99 <= 1.4e-2, max 9.6e-2
    if not cfg["symmetric"]:
        assert np.mean(zero == zeros) >= 0.99  # measured 99.83 %
