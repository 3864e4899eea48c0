"""Writes the base model every real checkpoint starts from: a random Llama, saved by transformers in
bfloat16 to ``_common.BASE``. Run it first, in the ref venv: ``/tmp/ref/bin/python
tools/real_checkpoints/tiny_llama.py``.

2 layers, hidden 256, intermediate 512, 4 heads / 2 KV heads of 64, vocabulary 128 with tied
embeddings (the smallest the tools take; it keeps every committed checkpoint a few hundred KB), and
a word-level tokenizer over its ids (GPTQModel loads one).
"""

from __future__ import annotations

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _common  # noqa: E402


def main():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.05)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # random norm scales, so a loader that drops them is caught
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        layers = model.model.layers
        layers[0].self_attn.q_proj.weight[5] = 0.0  # an all-zero output channel: zero per-channel scale
        layers[1].mlp.down_proj.weight[3, 128:256] = 0.0  # all-zero groups of 64 and 128, bnb blocks of 64
        layers[1].mlp.down_proj.weight[3, 130] = -0.0
        layers[1].mlp.up_proj.weight[7, 11] = 1.0  # an outlier 20x the typical magnitude sets its group's scale
    model.save_pretrained(_common.BASE)
    _common.word_tokenizer().save_pretrained(_common.BASE)
    print("wrote", _common.BASE)


if __name__ == "__main__":
    main()
