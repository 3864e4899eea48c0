"""bitsandbytes 4-bit checkpoints of the tiny Llama, quantized by transformers' ``BitsAndBytesConfig``
on CPU and saved by ``save_pretrained``: NF4, NF4 with double quantization, FP4 (block 64, bfloat16
quant_state dtype). transformers' bnb quantizer needs accelerate, which the ref venv lacks, so this
runs in the llmcompressor venv with bitsandbytes added::

    /tmp/llmc/bin/pip install bitsandbytes
    /tmp/llmc/bin/python tools/real_checkpoints/bitsandbytes_4bit.py

Reference: logits of the float32 forward on ``bitsandbytes.functional.dequantize_4bit`` of each
weight, asked for float32 output (its quant_state otherwise rounds the result to bfloat16).
"""

from __future__ import annotations

import copy
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _common  # noqa: E402

CASES = {  # checkpoint name: (bnb_4bit_quant_type, bnb_4bit_use_double_quant)
    "bnb_nf4": ("nf4", False),
    "bnb_nf4_dq": ("nf4", True),
    "bnb_fp4": ("fp4", False),
}


def make(name: str, quant_type: str, double_quant: bool):
    import bitsandbytes.functional as bnbf
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(_common.BASE, quantization_config=config, device_map="cpu")
    modules = dict(model.named_modules())
    dequantized = {}
    for mname in _common.module_names():
        weight = modules[mname].weight
        state = copy.copy(weight.quant_state)
        state.dtype = torch.float32
        dequantized[mname] = bnbf.dequantize_4bit(weight.data, state).float().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return _common.write(name, tmp, ("bitsandbytes", "transformers", "torch"),
                             logits=_common.reference_logits(dequantized, tmp))


if __name__ == "__main__":
    for case, args in CASES.items():
        print("wrote", make(case, *args))
