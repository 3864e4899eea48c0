"""float16 goldens: compressed-tensors 0.20.1 int, FP8 and NVFP4 (weights, and activations under a static
input global scale) on float16 inputs.

float16's range is where float32 arithmetic rounded to the input's dtype meets the edge of the format:
float16 subnormals (below 2^-14) are normal float32 numbers, a group range or an ``amax / 6`` that small
must stay a subnormal, and ``1 / amax`` for amax above 16384 is one. Rows (float16 [R, 64], one class a
row, ``row_names``): random, groups whose range is below 2^-14, float16 subnormals, quotients that are
float16 subnormals under a normal scale, amax above 16384 and near float16's max, a 16-block far below
its row's amax, integer rounding midpoints, -0.0, all zeros, ±Inf, NaN.

Cases (``config_<case>``: library, jquant format, strategy): int4 / int8, symmetric and asymmetric, per
channel and in groups of 32; FP8 per tensor (each row alone), channel, group 32, block 32; NVFP4 per
row as its own tensor with and without a global scale (``ct_nvfp4_{global,none}``); NVFP4 activations,
all rows one tensor of tokens under the input global scale of a calibrated amax of 10
(``ct_nvfp4_act``). Codes as uint8 bits (FP8, packed FP4) or signed int8, scales as uint16 bits
(float16) or uint8 (E4M3 block scales), global scales float32.
"""

from __future__ import annotations

import numpy as np

from goldens import _common
from goldens.adversarial_fp4 import _ct_nvfp4
from goldens.adversarial_int_fp8 import _ct, _ct_args

VENV = "ref"
COLS = 64
ACT_AMAX = 10.0  # the calibrated activation amax behind the static input global scale


def rows() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261205)
    f16 = np.float16
    base = np.linspace(-1, 1, COLS, dtype=np.float32)
    out = {"normal": rng.standard_normal(COLS), "normal_1e-3": rng.standard_normal(COLS) * 1e-3}
    tiny_group = rng.standard_normal(COLS) * 1e-2
    tiny_group[:32] = np.linspace(-1e-6, 2e-6, 32)       # a group whose range is a float16 subnormal
    out["tiny_range_group"] = tiny_group
    out["tiny_range_row"] = np.linspace(-3e-6, 5e-6, COLS)
    out["f16_subnormals"] = rng.integers(-1023, 1024, COLS) * 2.0 ** -24
    sub_quotients = rng.integers(-60, 60, COLS) * 2.0 ** -24  # x / 1.0: float16-subnormal quotients
    sub_quotients[0] = 448.0
    out["subnormal_quotients"] = sub_quotients
    out["amax_20000"] = 20000.0 * base
    out["near_f16_max"] = rng.uniform(-1, 1, COLS) * 65000.0
    out["near_f16_max"][3] = 65504.0
    small_block = rng.standard_normal(COLS) * 0.05
    small_block[:16] = 0.05 * base[:16] / np.abs(base[:16]).max()
    small_block[16:32] = 3e-4 * base[16:32] / np.abs(base[16:32]).max()  # amax / 6 a float16 subnormal
    out["small_block"] = small_block
    out["activation_blocks"] = np.concatenate([8.0 * base[:32], 2e-4 * base[32:]])
    midpoints = rng.integers(-8, 7, COLS) + 0.5
    midpoints[:2] = -7.5, 7.5
    out["mid_int"] = midpoints
    neg_zero = rng.standard_normal(COLS)
    neg_zero[::2] = -0.0
    out["neg_zero"] = neg_zero
    out["all_zero"] = np.zeros(COLS)
    inf = rng.standard_normal(COLS)
    inf[3], inf[40] = np.inf, -np.inf
    out["inf"] = inf
    nan = rng.standard_normal(COLS)
    nan[7] = np.nan
    out["nan"] = nan
    return {name: np.asarray(row).astype(f16) for name, row in out.items()}


def _bits(t):
    import torch

    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _nvfp4_activations(x):
    """compressed-tensors' NVFP4 activation path: per-token blocks of 16 under a static input global
    scale (``generate_gparam`` of the calibrated amax), dynamic block scales, FP4 values packed."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    args = QuantizationScheme(targets=["Linear"], **NVFP4).input_activations
    amax = torch.tensor(ACT_AMAX, dtype=torch.float16)
    global_scale = generate_gparam(-amax, amax)
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=global_scale)
    values = quantize(x, scale, zero_point, args, global_scale=global_scale)
    return {"packed": pack_fp4_to_uint8(values.float()).numpy(),
            "scale": scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy(),
            "global": global_scale.float().reshape(1).numpy()}


def make(out_dir):
    import torch

    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    named = rows()
    x = np.stack(list(named.values()))
    x_t = torch.from_numpy(x)
    arrays = {"x": x, "row_names": np.array(list(named))}
    cases = {}
    for strategy, group in (("tensor", None), ("channel", None), ("group", 32), ("block", 32)):
        cases[f"ct_fp8_{strategy}"] = (("compressed-tensors", "fp8_e4m3", strategy),
                                       _ct(x_t, _ct_args("float", strategy, group=group), strategy, group))
    for bits in (4, 8):
        for symmetric in (True, False):
            for strategy, group in (("channel", None), ("group", 32)):
                fmt = f"{'int' if symmetric else 'uint'}{bits}"
                cases[f"ct_{fmt}_{strategy}"] = (("compressed-tensors", fmt, strategy),
                                                 _ct(x_t, _ct_args("int", strategy, bits, symmetric, group), strategy,
                                                     group))
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    for with_global in (True, False):
        per_row = [_ct_nvfp4(row[None], scheme, with_global) for row in x]
        cases[f"ct_nvfp4_{'global' if with_global else 'none'}"] = (
            ("compressed-tensors", "nvfp4", "row"), {k: np.stack([r[k] for r in per_row]) for k in per_row[0]})
    cases["ct_nvfp4_act"] = (("compressed-tensors", "nvfp4", "activation"), _nvfp4_activations(x_t))
    for case, (config, result) in cases.items():
        arrays[f"config_{case}"] = np.array(config)
        arrays.update({f"{case}_{key}": (value.view(np.uint16) if value.dtype == np.float16 else value)
                       for key, value in result.items()})
    return [_common.save(out_dir, "float16_inputs", ("torch", "compressed-tensors"), **arrays)]
