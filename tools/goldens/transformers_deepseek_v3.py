"""transformers DeepSeek-V3 MoE block golden: ``DeepseekV3MoE`` (sigmoid router with
``e_score_correction_bias`` and group-limited top-k, routed experts, one shared expert) of a tiny
``DeepseekV3Config``, float32, on seeded random weights and hidden states.

The npz holds:

- ``config_json``: the config values the block was built with;
- ``hidden_states`` float32 [2, 7, H], the input, and ``output`` float32 [2, 7, H], the block's output;
- ``router_weight`` [E, H], ``e_score_correction_bias`` float32 [E], ``gate_up_proj`` [E, 2I, H]
  (transformers' layout: rows ``[0, I)`` gate, ``[I, 2I)`` up), ``down_proj`` [E, H, I] and the shared
  expert's ``shared_gate_proj`` / ``shared_up_proj`` [Is, H], ``shared_down_proj`` [H, Is]
  (``nn.Linear`` weights, [out, in]). Weights are drawn on the float16 grid and stored as float16: the
  model runs them in float32, where they are exact, and the npz stays under 1 MB;
- ``router_logits`` float32 [T, E], ``topk_indices`` int32 [T, k] and ``topk_weights`` float32 [T, k]:
  the router's own outputs (``topk(sorted=False)``: the order within a token is not meaningful).

The correction bias is nonnegative, so every biased score is positive and the golden does not depend
on what fills the dropped groups (docs/design/moe.md reference fact 5).
"""

from __future__ import annotations

import json

import numpy as np

from goldens._common import save

VENV = "ref"

CONFIG = dict(hidden_size=128, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
              topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu")
SHAPE = (2, 7)


def make(out_dir):
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(**CONFIG, experts_implementation="eager")
    block = DeepseekV3MoE(config).eval()
    e, h, i = CONFIG["n_routed_experts"], CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    shared_i = i * CONFIG["n_shared_experts"]

    rng = np.random.default_rng(3071)
    half = lambda *shape, scale: (rng.standard_normal(shape) * scale).astype(np.float16)
    weights = {
        "router_weight": half(e, h, scale=h ** -0.5),
        "gate_up_proj": half(e, 2 * i, h, scale=h ** -0.5),
        "down_proj": half(e, h, i, scale=i ** -0.5),
        "shared_gate_proj": half(shared_i, h, scale=h ** -0.5),
        "shared_up_proj": half(shared_i, h, scale=h ** -0.5),
        "shared_down_proj": half(h, shared_i, scale=i ** -0.5),
    }
    correction = rng.uniform(0.0, 0.2, e).astype(np.float32)
    hidden_states = rng.standard_normal(SHAPE + (h,)).astype(np.float32)

    as_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32))
    with torch.no_grad():
        block.gate.weight.copy_(as_torch(weights["router_weight"]))
        block.gate.e_score_correction_bias.copy_(as_torch(correction))
        block.experts.gate_up_proj.copy_(as_torch(weights["gate_up_proj"]))
        block.experts.down_proj.copy_(as_torch(weights["down_proj"]))
        block.shared_experts.gate_proj.weight.copy_(as_torch(weights["shared_gate_proj"]))
        block.shared_experts.up_proj.weight.copy_(as_torch(weights["shared_up_proj"]))
        block.shared_experts.down_proj.weight.copy_(as_torch(weights["shared_down_proj"]))
        x = torch.from_numpy(hidden_states)
        router_logits, topk_weights, topk_indices = block.gate(x)
        output = block(x)
    assert output.dtype == torch.float32 and output.shape == x.shape
    assert float((router_logits.sigmoid() + block.gate.e_score_correction_bias).min()) > 0
    return [save(out_dir, "transformers_deepseek_v3", ("transformers", "torch"),
                 config_json=np.array(json.dumps(CONFIG)), hidden_states=hidden_states,
                 e_score_correction_bias=correction, **weights,
                 router_logits=router_logits.numpy(), topk_indices=topk_indices.numpy().astype(np.int32),
                 topk_weights=topk_weights.numpy(), output=output.numpy())]
