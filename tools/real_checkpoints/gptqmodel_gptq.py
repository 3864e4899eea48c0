"""GPTQ checkpoints of the tiny Llama made by GPTQModel on CPU (4-bit, group 64, symmetric), without and
with act-order (``desc_act``), saved by ``model.save`` in its default (v1 "gptq") format::

    python3.11 -m venv /tmp/gptq && /tmp/gptq/bin/pip install torch==2.13.0
    /tmp/gptq/bin/pip install gptqmodel==7.6.0 --no-build-isolation
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptq/bin/python tools/real_checkpoints/gptqmodel_gptq.py [case ...]

Calibration: 8 sequences of 64 random token ids. Reference: the float32 forward on the weights
GPTQModel's own ``dequantize_weight`` gives for each module of the saved checkpoint loaded back
(CPU torch kernel, float16 so the stored float16 scales stay exact), its scales cast to float32 first
(it computes in the scales' dtype).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _common  # noqa: E402

CASES = {"gptqmodel_w4g64": False, "gptqmodel_w4g64_act_order": True}  # name: desc_act
PACKAGES = ("gptqmodel", "transformers", "torch")


def make(case: str) -> pathlib.Path:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import numpy as np
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    torch.manual_seed(0)
    config = QuantizeConfig(bits=4, group_size=64, sym=True, desc_act=CASES[case])
    model = GPTQModel.load(str(_common.BASE), config, dtype=torch.bfloat16)
    ids = _common.calibration_ids()
    model.quantize([{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids], batch_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model.save(str(tmp))
        # float16, the scales' dtype in the file: the config's bfloat16 would change them
        loaded = GPTQModel.load(str(tmp), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
        modules = dict(loaded.model.named_modules())
        dequantized = {}
        for name in _common.module_names():
            module = modules[name]
            assert module.scales.dtype == torch.float16, (name, module.scales.dtype)
            module.scales = module.scales.float()
            dequantized[name] = module.dequantize_weight().T.contiguous().float().numpy()
        assert all(np.isfinite(w).all() for w in dequantized.values())
        return _common.write(case, tmp, PACKAGES, logits=_common.reference_logits(dequantized, tmp))


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        print("wrote", make(name))
