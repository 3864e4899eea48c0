"""bitsandbytes 0.50.2 (CPU) goldens: ``quantize_4bit`` / ``dequantize_4bit`` for NF4 and FP4, with and
without double quantization, plus the 8-bit ``quantize_blockwise`` and torch's float32 ``mean`` that
double quantization rests on.

Inputs are stored once as ``input__<name>`` (bfloat16 as uint16 bits): a float32 [33, 65] weight
(odd size, a short last block; dequantized through bnb's Python path), a bfloat16 [111, 150] one
(261 blocks, so two nested blocks of 256; dequantized through the C++ kernel) and a float32 [4, 70]
one holding NaN, ±Inf, an all-zero block and an all-zero short last block. ``cases`` (a JSON string)
gives each case's input and settings; case ``<case>`` stores the packed ``<case>__weight`` bytes
([ceil(n/2), 1]), every tensor of ``QuantState.as_dict(packed=True)`` (``absmax``, ``quant_map``,
``nested_absmax``, ``nested_quant_map``, and the JSON as ``quant_state``) and ``dequantize_4bit``'s
output as ``<case>__dequant``.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import bitsandbytes.functional as F

from goldens import _common

VENV = "ref"


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _inputs():
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(33, 65, generator=gen) * 0.05
    big = (torch.randn(111, 150, generator=gen) * 0.02).to(torch.bfloat16)
    special = torch.randn(280, generator=gen)
    special[5] = float("nan")            # block 0
    special[70] = float("inf")           # block 1
    special[130] = -float("inf")         # block 2
    special[192:] = 0.0                  # block 3 and the short last block are all zero
    special[193] = -0.0
    special = special.reshape(4, 70)
    # All zero with a short last block: bnb floors that block's absmax at 1e-38 (a subnormal), so the
    # double quantization's mean and differences are subnormals torch keeps. K is odd: bnb's CPU
    # dequantize_4bit reads the block maxima per row where K is even and not a multiple of the block.
    zeros = torch.zeros(4, 71)
    zeros_f16 = torch.zeros(33, 97, dtype=torch.float16)
    # Tiny weights: blocks whose absmax is subnormal (every dequantized value subnormal) and blocks of
    # normal absmax near 2^-126 whose small table entries dequantize to subnormals. K is odd, so
    # bnb dequantizes them with torch (its C++ kernel reads block maxima per row, see above).
    tiny = torch.randn(6, 97, generator=gen)
    tiny[:2] *= 1e-39
    tiny[2:4] *= 3e-38
    tiny[4:] *= 2e-37
    tiny_bf16 = (torch.randn(4, 65, generator=gen) * torch.tensor([1e-39, 5e-39, 4e-38, 1e-36])[:, None])
    return {"small": small, "big": big, "special": special, "zeros": zeros, "zeros_f16": zeros_f16,
            "tiny": tiny, "tiny_bf16": tiny_bf16.to(torch.bfloat16)}


CASES = {
    "nf4_small": ("small", "nf4", 64, False),
    "nf4_small_dq": ("small", "nf4", 64, True),
    "fp4_small": ("small", "fp4", 64, False),
    "fp4_small_dq": ("small", "fp4", 64, True),
    "fp4_small_bs4096": ("small", "fp4", 4096, False),
    "nf4_small_bs32_dq": ("small", "nf4", 32, True),
    "nf4_big_dq": ("big", "nf4", 64, True),
    "nf4_special": ("special", "nf4", 64, False),
    "fp4_special_dq": ("special", "fp4", 64, True),
    "nf4_zeros_dq": ("zeros", "nf4", 64, True),
    "fp4_zeros_f16_bs128_dq": ("zeros_f16", "fp4", 128, True),
    "nf4_tiny": ("tiny", "nf4", 64, False),
    "fp4_tiny_bs32_dq": ("tiny", "fp4", 32, True),
    "fp4_tiny_bf16": ("tiny_bf16", "fp4", 64, False),
    "nf4_tiny_bf16_dq": ("tiny_bf16", "nf4", 32, True),
}

SUM_SIZES = (1, 3, 5, 6, 7, 8, 9, 31, 64, 100, 517, 700, 3000, 8200)


def _four_bit_cases(inputs):
    arrays = {f"input__{name}": _bits(x) for name, x in inputs.items()}
    cases = {}
    for case, (name, quant_type, blocksize, dq) in CASES.items():
        x = inputs[name]
        packed, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=dq, quant_type=quant_type)
        arrays[f"{case}__weight"] = packed.numpy()
        for key, value in state.as_dict(packed=True).items():
            arrays[f"{case}__{key.split('.')[0]}"] = value.numpy()
        arrays[f"{case}__dequant"] = _bits(F.dequantize_4bit(packed, state))
        cases[case] = {"input": name, "quant_type": quant_type, "blocksize": blocksize, "compress_statistics": dq,
                       "dtype": str(x.dtype).removeprefix("torch.")}
    return arrays, cases


def _dynamic8_cases():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(700, generator=gen) * 0.3
    codes, state = F.quantize_blockwise(x, blocksize=256)
    # Every midpoint of the dynamic map and its float32 neighbours, in blocks of 256 led by 1.0 so
    # each value is its own scaled value: pins bnb's 65536-bin lookup rule at every code boundary.
    code = F.create_dynamic_map()
    mids = ((code[:-1] + code[1:]) * 0.5).numpy()
    probes = np.concatenate([mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2))])
    probes = torch.from_numpy(probes[np.abs(probes) <= 1].astype(np.float32))
    probes = torch.cat([torch.cat([torch.ones(1), chunk]) for chunk in probes.split(255)])
    probe_codes, probe_state = F.quantize_blockwise(probes, blocksize=256)
    return {
        "dynamic8__input": x.numpy(), "dynamic8__codes": codes.numpy(),
        "dynamic8__absmax": state.absmax.numpy(), "dynamic8__code": state.code.numpy(),
        "dynamic8__dequant": F.dequantize_blockwise(codes, state).numpy(),
        "dynamic8_probes__input": probes.numpy(), "dynamic8_probes__codes": probe_codes.numpy(),
        "dynamic8_probes__absmax": probe_state.absmax.numpy(),
    }


def _mean_cases():
    # torch's float32 mean (double quantization's offset); bfloat16-valued inputs keep the file small
    # while their float32 sums still round, so the summation order shows.
    gen = torch.Generator().manual_seed(2)
    arrays = {}
    for size in SUM_SIZES:
        x = (torch.rand(size, generator=gen) * 4 + 0.01).to(torch.bfloat16)
        arrays[f"mean_{size}__input"] = _bits(x)
        arrays[f"mean_{size}__mean"] = x.float().mean().numpy()
    return arrays


def make(out_dir):
    torch.set_num_threads(1)  # torch splits float32 sums of >= 32768 elements across threads
    arrays, cases = _four_bit_cases(_inputs())
    arrays.update(_dynamic8_cases())
    arrays.update(_mean_cases())
    arrays["cases"] = np.array(json.dumps(cases))
    arrays["mean_sizes"] = np.array(SUM_SIZES)
    return [_common.save(out_dir, "bitsandbytes_4bit", ("bitsandbytes", "torch"), **arrays)]
