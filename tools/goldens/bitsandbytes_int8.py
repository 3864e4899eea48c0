"""bitsandbytes 0.50.2 (CPU) goldens for LLM.int8(): ``Int8Params`` weight quantization (through
``Linear8bitLt``'s saved ``weight`` / ``SCB`` / ``weight_format``), ``int8_vectorwise_dequant``, and
``bitsandbytes.matmul`` with a ``MatmulLtState`` set up as vLLM's ``_apply_8bit_weight`` sets it.

Weights (``weight__<name>``, bfloat16 as uint16 bits): a float32 [40, 72] one holding a zero row, NaN,
+Inf, 70000 (past float16), -0.0 and float16 subnormals, and a row of ties (absmax 127, values k + 0.5);
a bfloat16 [64, 96] and a float16 [33, 65] one. ``<name>__codes``, ``<name>__SCB``,
``<name>__weight_format`` and ``<name>__dequant`` are what bitsandbytes gives for each.

Matmuls against the [48, 96] ``matmul`` weight: ``x__<case>`` inputs (bfloat16 / float16 as their
bits), ``out__<case>`` outputs, ``cases`` (JSON) the dtype and threshold of each.
"""

from __future__ import annotations

import json

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F

from goldens import _common

VENV = "ref"


def _bits(x):
    return x.view(torch.uint16).numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()


def _weights():
    gen = torch.Generator().manual_seed(8)
    special = torch.randn(40, 72, generator=gen) * 0.05
    special[3] = 0.0
    special[5, 7] = float("nan")
    special[7, 1] = float("inf")
    special[9, 30] = 70000.0                       # float16 overflow: the row's absmax becomes Inf
    special[11, :8] = -0.0
    special[11, 8:16] = 3e-6                        # float16 subnormals
    special[13, :] = torch.arange(72) - 36 + 0.5    # ties at k + 0.5 ...
    special[13, 0] = 127.0                          # ... with absmax 127 (scale 1)
    return {"special": special,
            "bf16": (torch.randn(64, 96, generator=gen) * 0.02).to(torch.bfloat16),
            "f16": (torch.randn(33, 65, generator=gen) * 0.1).to(torch.float16),
            "matmul": torch.randn(48, 96, generator=gen) * 0.05}


def _inputs():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 96, generator=gen)
    x[2, 10], x[5, 40], x[0, 10], x[3, 90] = 8.0, -7.0, 6.0, 5.99
    x[6] = 0.0
    calm = torch.randn(5, 96, generator=gen).clamp(-5, 5)
    one = torch.randn(1, 96, generator=gen)
    one[0, 17] = 12.5
    near = torch.randn(3, 96, generator=gen)
    near[1, 4] = 6.1015625                           # float16(6.102): an outlier only compared in float16
    special = torch.randn(3, 96, generator=gen)
    special[1, 3] = float("nan")
    special[2, 50] = float("inf")
    wide = torch.randn(64, 96, generator=gen) * 2.0
    return {
        "bf16_t6": (x.to(torch.bfloat16), 6.0),
        "bf16_t0": (x.to(torch.bfloat16), 0.0),
        "bf16_calm_t6": (calm.to(torch.bfloat16), 6.0),
        "f16_one_row_t6": (one.to(torch.float16), 6.0),
        "f16_t6102": (near.to(torch.float16), 6.102),
        "f32_t6": (x, 6.0),
        "bf16_special_t6": (special.to(torch.bfloat16), 6.0),
        "bf16_wide_t3": (wide.to(torch.bfloat16), 3.0),
    }


def _state(codes, scb, threshold):
    # vLLM's _apply_8bit_weight: a fresh state holding the int8 weight, inference only.
    state = bnb.MatmulLtState()
    state.CB, state.SCB, state.threshold = codes, scb, threshold
    state.has_fp16_weights, state.is_training = False, False
    state.use_pool = threshold > 0.0
    return state


def make(out_dir):
    arrays, cases = {}, {}
    weights = _weights()
    for name, w in weights.items():
        layer = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
        state = layer.to("cpu").state_dict()
        arrays[f"weight__{name}"] = _bits(w)
        arrays[f"{name}__codes"] = state["weight"].numpy()
        arrays[f"{name}__SCB"] = state["SCB"].numpy()
        arrays[f"{name}__weight_format"] = state["weight_format"].numpy()
        arrays[f"{name}__dequant"] = F.int8_vectorwise_dequant(state["weight"], state["SCB"]).numpy()
    codes, scb = arrays["matmul__codes"], arrays["matmul__SCB"]
    with torch.no_grad():
        for case, (x, threshold) in _inputs().items():
            out = bnb.matmul(x, torch.from_numpy(codes), state=_state(torch.from_numpy(codes),
                                                                       torch.from_numpy(scb), threshold))
            arrays[f"x__{case}"], arrays[f"out__{case}"] = _bits(x), _bits(out)
            cases[case] = {"dtype": str(x.dtype).removeprefix("torch."), "threshold": threshold}
    return [_common.save(out_dir, "bitsandbytes_int8", ("bitsandbytes", "torch"), cases=json.dumps(cases),
                         **arrays)]
