"""gptqmodel 7.6.0 GPTQ on one linear layer: its ``GPTQ`` class (``add_batch`` then ``quantize``).

One weight ``W`` [256, 512] (float16 values: small Gaussian weights with a few outlier input columns
and a few large single entries) and one calibration batch ``X`` [2048, 512] (float16 values:
Student-t rows with a shared low-rank part, per-channel log-normal magnitudes and a few "massive
activation" channels tens of times larger than the rest, as in real LLM activations) are quantized
by gptqmodel's own GPTQ loop for each case of ``CASES`` with ``damp_percent=0.01`` and block size
128. ``act_group_aware`` (GAR, on by default for GPTQ in 7.x) is switched off so the column order is
the plain one or ``desc_act``'s.

Stored: ``W`` and ``X`` (float16), and per case ``<case>_*``: ``config`` (int32 [bits, group_size
(-1: per channel), sym, desc_act, static_groups]), ``codes`` (uint8 [N, K]), ``scales`` (float32
[N, G], the float32 scales gptqmodel quantized with), ``zeros`` (float32 [N, G]), ``g_idx`` (int32
[K]) and ``mse`` (float64: ``mean((X Wᵀ − X Qᵀ)²)`` in float64). The dequantized weight gptqmodel
returned is exactly ``scales[:, g_idx] · (codes − zeros[:, g_idx])`` in float32 (checked here bit for
bit), so it is stored as codes to keep the file small. ``avg_loss`` is gptqmodel's reported loss.
"""

from __future__ import annotations

import numpy as np

from goldens import _common

VENV = "gptq"

N, K, ROWS = 256, 512, 2048
DAMP, BLOCK = 0.01, 128

# name: (bits, group_size, sym, desc_act, static_groups)
CASES = {
    "sym4_g128": (4, 128, True, False, False),
    "sym4_g128_act": (4, 128, True, True, False),
    "asym4_g32": (4, 32, False, False, False),
    "sym3_ch": (3, -1, True, False, False),
    "sym4_g128_act_static": (4, 128, True, True, True),
}


def inputs(seed=20250610):
    """``(W, X)`` as float16 arrays."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)) * 0.02
    outlier_cols = rng.choice(K, 6, replace=False)
    w[:, outlier_cols] *= rng.uniform(4.0, 10.0, 6)
    rows, cols = rng.integers(0, N, 24), rng.integers(0, K, 24)
    w[rows, cols] = rng.choice([-1.0, 1.0], 24) * rng.uniform(0.15, 0.4, 24)

    channel = np.exp(rng.normal(0.0, 0.6, K))  # log-normal per-channel magnitude
    x = rng.standard_t(4, (ROWS, K)) * channel
    x += 0.5 * rng.standard_normal((ROWS, 16)) @ rng.standard_normal((16, K)) * channel
    massive = rng.choice(K, 5, replace=False)
    x[:, massive] *= rng.uniform(20.0, 60.0, 5)
    x[:, massive] += rng.uniform(10.0, 40.0, 5)  # an offset too: those channels are rarely near 0
    return w.astype(np.float16), x.astype(np.float16)


def make(out_dir):
    import torch
    from gptqmodel.quantization import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ

    torch.manual_seed(0)
    w16, x16 = inputs()
    w, x = w16.astype(np.float32), x16.astype(np.float32)
    arrays = {"W": w16, "X": x16}
    for name, (bits, group, sym, desc_act, static) in CASES.items():
        linear = torch.nn.Linear(K, N, bias=False)
        linear.weight.data = torch.from_numpy(w.copy())
        cfg = QuantizeConfig(bits=bits, group_size=group, sym=sym, desc_act=desc_act, static_groups=static,
                             act_group_aware=False, damp_percent=DAMP)
        task = GPTQ(linear, cfg)
        task.quantizer.configure(perchannel=True)  # as gptqmodel's GPTQ processor does
        task.add_batch(torch.from_numpy(x), None)
        q, scale, zero, g_idx, _, avg_loss, damp, nsamples = task.quantize(blocksize=BLOCK)
        assert damp == DAMP and nsamples == ROWS and isinstance(avg_loss, float), (damp, nsamples, avg_loss)
        q, scale, zero, g_idx = (t.detach().cpu().numpy() for t in (q, scale, zero, g_idx))
        s, z = scale[:, g_idx], zero[:, g_idx]
        codes = np.rint(q / s) + z
        assert codes.min() >= 0 and codes.max() <= 2 ** bits - 1
        assert np.array_equal((s * (codes - z).astype(np.float32)).astype(np.float32), q), name
        diff = x.astype(np.float64) @ (w.astype(np.float64) - q.astype(np.float64)).T
        arrays.update({
            f"{name}_config": np.array([bits, group, sym, desc_act, static], np.int32),
            f"{name}_codes": codes.astype(np.uint8), f"{name}_scales": scale.astype(np.float32),
            f"{name}_zeros": zero.astype(np.float32), f"{name}_g_idx": g_idx.astype(np.int32),
            f"{name}_mse": np.float64(np.mean(diff ** 2)), f"{name}_avg_loss": np.float64(avg_loss),
        })
    return [_common.save(out_dir, "gptqmodel_gptq_layer", ("gptqmodel", "torch"), **arrays)]
