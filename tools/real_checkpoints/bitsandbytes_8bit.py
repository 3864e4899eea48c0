"""A bitsandbytes LLM.int8() checkpoint of the tiny Llama, quantized by transformers'
``BitsAndBytesConfig(load_in_8bit=True)`` on CPU and saved by ``save_pretrained``. transformers' bnb
quantizer needs accelerate: ``/tmp/ref/bin/pip install accelerate``, then
``/tmp/ref/bin/python tools/real_checkpoints/bitsandbytes_8bit.py``.

Reference: each projection's output on fixed bfloat16 inputs (``<module>.input`` → ``<module>.output``,
both stored as float32, which holds bfloat16 exactly), from the loaded model's own ``Linear8bitLt``
(``bitsandbytes.matmul`` with the config's threshold of 6.0). The inputs hold outliers (|x| ≥ 6) in
some columns, a token of zeros and a token of large values, so both halves of the decomposition run.
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _common  # noqa: E402

NAME = "bnb_int8"


def _layer_outputs(model) -> dict[str, np.ndarray]:
    import torch

    modules = dict(model.named_modules())
    rng = np.random.default_rng(8)
    arrays = {}
    for name in _common.module_names():
        layer = modules[name]
        x = rng.standard_normal((2, 4, layer.in_features)).astype(np.float32)
        x[0, 0, 7] = 9.5            # outlier columns
        x[1, 3, 30] = -6.0          # exactly at the threshold: an outlier too
        x[0, 1] = 0.0
        x[1, 0] *= 2.5              # a token with values near, not past, the threshold
        xb = torch.from_numpy(x).to(torch.bfloat16)
        with torch.no_grad():
            y = layer(xb)
        assert y.dtype == torch.bfloat16, y.dtype
        arrays[f"{name}.input"] = xb.float().numpy()
        arrays[f"{name}.output"] = y.float().numpy()
    return arrays


def make() -> str:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(_common.BASE, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16)
    arrays = _layer_outputs(model)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return _common.write(NAME, tmp, ("bitsandbytes", "transformers", "torch"), **arrays)


if __name__ == "__main__":
    print("wrote", make())
