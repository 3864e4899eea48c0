# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # From `quantization_config` to the kernel that runs
#
# vLLM turns a checkpoint's `quantization_config` into a quantization method, loads the stored tensors
# into the layer, re-lays them once after loading, and at every forward calls `apply`, which runs the
# kernel chosen for the device. jquant keeps the same lifecycle, without the class hierarchy:
#
# 1. `scheme_from_config(quantization_config)` → a `Scheme` (`jquant.checkpoint.hf_config`);
# 2. quantize a float weight (`scheme.quantize_weight`, or `quantize_params` over a model) or load a
#    checkpoint's tensors (`from_checkpoint`, `load_hf_checkpoint`) → a `QTensor`;
# 3. `scheme.process_weights_after_loading(qtensor)` → a `Prepared` weight, laid out for the best
#    implementation the device has (`candidate_impls`);
# 4. `scheme.apply(x, prepared)` → `x @ W.T`, the implementation picking its path by the rows M of x
#    (`jquant.schemes.dispatch`, the one module that reads the accelerator).
#
# Below, two configs take that path on a tiny random Llama (2 layers, hidden 128): a GPTQ W4A16
# checkpoint and a compressed-tensors FP8 W8A8 one. Everything runs on this machine; the dispatch
# decisions for GPUs are asked of the same policy functions with a described device, which is all
# they read (platform, device kind, compute capability), so no GPU is needed to see them.

# %%
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import warnings

ROOT = next(p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents)
            if (p / "pyproject.toml").is_file() and (p / "jquant").is_dir())
os.chdir(ROOT)

import jax
import jax.numpy as jnp
from IPython.display import Markdown, display

import jquant
from jquant.checkpoint.hf_checkpoint import PROJECTIONS, load_hf_checkpoint, save_hf_checkpoint
from jquant.checkpoint.safetensors_file import load_file
from jquant.flax import quantize_params, quantized_apply
from jquant.models.llama import LlamaConfig, LlamaForCausalLM
from jquant.schemes import dispatch
from jquant.schemes.scheme import candidate_impls
from jquant.schemes.xla import quantize_activation

device = jax.devices()[0]
print(f"this device: {dispatch.device_name()} (compute capability {dispatch.compute_capability()}, 0 = not a CUDA GPU)")


def show_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


def fields(spec):
    """The fields a spec sets (None: not applicable to its format)."""
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(spec).items() if v is not None) or "-"


def describe(scheme):
    return {"name": scheme.name, "weight (WeightSpec)": fields(scheme.weight),
            "activations (ActivationSpec)": fields(scheme.activation),
            "checkpoint layout (LayoutSpec)": f"{scheme.checkpoint_layout}; {fields(scheme.layout)}",
            "fast path needs capability": scheme.min_capability or "-", "description": scheme.description}


# %% [markdown]
# ## 1. GPTQ: the config → the scheme
#
# The `quantization_config` entry of a GPTQ model's `config.json` (as GPTQModel / AutoGPTQ write it):

# %%
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq"}
gptq = jquant.scheme_from_config(GPTQ_CONFIG)
show_table(["field", "value"], list(describe(gptq).items()))
print("same as the registered scheme 'int4_g128':", gptq.weight == jquant.get_scheme("int4_g128").weight)

# %% [markdown]
# ## 2. A checkpoint: quantize, save, load
#
# A GPTQ checkpoint comes out of calibration (`jquant calibrate` writes one); quantizing to the nearest
# grid value (RTN) with the same scheme gives a checkpoint of the same layout, which is all this
# walkthrough needs. `quantize_params` replaces the seven projections of every layer (the rule is
# `PROJECTIONS`, the paths vLLM quantizes), `save_hf_checkpoint` writes HF Llama tensor names in the
# scheme's layout and the `quantization_config` into `config.json`.

# %%
CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=32)
model = LlamaForCausalLM(CONFIG)
tokens = jax.random.randint(jax.random.key(0), (1, 8), 0, CONFIG.vocab_size)
params = model.init(jax.random.key(1), tokens)["params"]

qparams, report = quantize_params(params, [(PROJECTIONS, gptq)], prepare=False)
print(f"quantized {len(report.quantized)} projections with {gptq.name}; kept in float: {report.kept}")

workdir = pathlib.Path(tempfile.mkdtemp(prefix="jquant-walkthrough-"))
save_hf_checkpoint(qparams, workdir / "gptq", quantization_config=GPTQ_CONFIG)
tensors = load_file(workdir / "gptq" / "model.safetensors")
show_table(["tensor (layer 0, q_proj)", "dtype", "shape"],
           [[name, t.dtype, t.shape] for name, t in sorted(tensors.items()) if "layers.0.self_attn.q_proj" in name])
print("config.json:", json.loads((workdir / "gptq" / "config.json").read_text())["quantization_config"])

# %% [markdown]
# Loading reads `config.json`, builds the scheme with `scheme_from_config` and reads each projection's
# tensors with `from_checkpoint(tensors, "gptq", ...)`. With `prepare=False` the projections stay plain
# QTensors; they are the saved ones, bit for bit:

# %%
loaded = load_hf_checkpoint(workdir / "gptq", params, prepare=False)
leaf = loaded["layers_0"]["q_proj"]["kernel"]
print(type(leaf).__name__, leaf.scheme.name, "→", leaf.qtensor.fmt, leaf.qtensor.shape, "block", leaf.qtensor.block,
      f"{leaf.qtensor.bits_per_weight:.3f} bits/weight")
same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), loaded, qparams))
print("loaded == saved, every leaf:", same)

# %% [markdown]
# ## 3. `process_weights_after_loading`: the layout for this device's best implementation
#
# Implementations register with the scheme registry; `candidate_impls(scheme, device)` lists those that
# support the scheme on the device, best first. The first whose `prepare` accepts the weight lays it
# out. The device is a described one where it is not this machine: `dispatch` reads only `platform`,
# `device_kind` and `compute_capability`, and laying a weight out needs no GPU (only running the kernel
# would).

# %%
@dataclasses.dataclass(frozen=True)  # hashable: dispatch caches per device
class DescribedDevice:
    platform: str
    device_kind: str
    compute_capability: str | None = None


DEVICES = {"this machine": device,
           "H200 (sm_90)": DescribedDevice("gpu", "NVIDIA H200", "9.0"),
           "L40S (sm_89)": DescribedDevice("gpu", "NVIDIA L40S", "8.9"),
           "A100 (sm_80)": DescribedDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0"),
           "B200 (sm_100)": DescribedDevice("gpu", "NVIDIA B200", "10.0")}
qw = leaf.qtensor
rows = []
for label, dev in DEVICES.items():
    prepared = gptq.process_weights_after_loading(qw, dev)
    data = prepared.data
    layout = (f"QTensor {data.fmt} {data.shape}" if isinstance(data, jquant.QTensor) else
              f"{type(data).__name__}: data {data.data.dtype} {tuple(data.data.shape)}, scale "
              f"{tuple(data.scale.shape)}, lut {data.lut}, word_order {data.word_order}")
    rows.append([label, dispatch.compute_capability(dev), [i.name for i in candidate_impls(gptq, dev)],
                 prepared.impl, layout])
show_table(["device", "capability", "candidate impls (best first)", "prepared for", "layout"], rows)

# %% [markdown]
# ## 4. `apply`, and which path runs at which M
#
# `scheme.apply(x, prepared)` computes `x @ W.T`. On the XLA implementation (this machine) that is
# dequantize + dot; with the Hopper layout it calls `w4a16_matmul(..., impl="auto")`, which asks
# `dispatch.w4a16_impl(M, capability, N·K)`: the Mosaic GPU kernel up to M = 1024 (up to 128 for
# weights under 8192×8192), XLA's dequantize + dot above; off CUDA GPUs the fp32 reference.

# %%
prepared = gptq.process_weights_after_loading(qw)
x = jax.random.normal(jax.random.key(2), (4, qw.shape[1]), jnp.float32).astype(jnp.bfloat16)
y = gptq.apply(x, prepared)
reference = x.astype(jnp.float32) @ qw.dequantize(jnp.float32).T
print(f"apply on {prepared.impl}: y {y.dtype} {tuple(y.shape)}; max |y - x·dequantize(W)ᵀ| = "
      f"{float(jnp.abs(y.astype(jnp.float32) - reference).max()):.3g} "
      "(the XLA path dequantizes W to x's bf16 and returns y in bf16)")

MS = [1, 16, 128, 129, 256, 1024, 1025, 4096]
WEIGHTS = {"q_proj here (128×128)": qw.shape[0] * qw.shape[1], "4096×4096": 4096 * 4096,
           "28672×8192": 28672 * 8192}
show_table(["device", "weight N×K"] + [f"M={m}" for m in MS],
           [[label, wname] + [dispatch.w4a16_impl(m, dispatch.compute_capability(dev), elems) for m in MS]
            for label, dev in DEVICES.items() for wname, elems in WEIGHTS.items()
            if label in ("this machine", "H200 (sm_90)") or wname == "28672×8192"])

# %% [markdown]
# `reference` (off CUDA GPUs) is what `w4a16_matmul(x, w, impl="auto")` would run if called directly; a
# scheme never gets there on such a device, since its weight was prepared for the `xla` implementation
# (the table of step 3). On GPUs without wgmma the scheme also stays on `xla`: the Mosaic GPU kernel
# is the only Pallas implementation of the 4-bit GEMM, and it is an sm_90a program.

# %% [markdown]
# The rest of the device policy, per device: decode attention (`decode_attention_impl`: the
# Triton-backend Pallas kernel needs capability ≥ 8.0), the Mosaic GPU wgmma kernels (sm_90 only), and
# whether W8A8 FP8 schemes feed FP8 codes to XLA's dot (`native_fp8_dot`, any GPU):

# %%
show_table(["device", "Mosaic GPU (wgmma)", "Triton-backend Pallas", "decode attention", "native FP8 dot"],
           [[label, dispatch.runs_mosaic_gpu(dev), dispatch.runs_triton_pallas(dev),
             dispatch.decode_attention_impl(dev), dispatch.native_fp8_dot(dev)] for label, dev in DEVICES.items()])

# %% [markdown]
# The whole model: `load_hf_checkpoint` prepares every projection by default (`prepare=True`), and
# `quantized_apply` runs the unchanged linen model with each quantized Dense layer calling its scheme.

# %%
ready = load_hf_checkpoint(workdir / "gptq", params)
print("layers_0/q_proj prepared for:", ready["layers_0"]["q_proj"]["kernel"].weight.impl)
float_logits = model.apply({"params": params}, tokens)[0]
gptq_logits = quantized_apply(model, {"params": ready}, tokens)[0]
agree = float((float_logits.argmax(-1) == gptq_logits.argmax(-1)).mean())
print(f"logits {tuple(gptq_logits.shape)}: "
      f"max |Δ| against float {float(jnp.abs(gptq_logits - float_logits).max()):.3g}, "
      f"top-1 agreement {agree:.0%} (random weights, RTN int4)")

# %% [markdown]
# ## 5. compressed-tensors FP8: weights and activations
#
# An llm-compressor `FP8_DYNAMIC` checkpoint: FP8 weights with a scale per output channel, FP8
# activations quantized per token at run time. The scheme is W8A8, so `apply` quantizes x first.

# %%
CT_FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                       "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}}},
    "ignore": ["lm_head"]}
fp8 = jquant.scheme_from_config(CT_FP8_CONFIG)
show_table(["field", "value"], list(describe(fp8).items()))

fp8_params, _ = quantize_params(params, [(PROJECTIONS, fp8)], prepare=False)
save_hf_checkpoint(fp8_params, workdir / "fp8", quantization_config=CT_FP8_CONFIG)
tensors = load_file(workdir / "fp8" / "model.safetensors")
show_table(["tensor (layer 0, q_proj)", "dtype", "shape"],
           [[name, t.dtype, t.shape] for name, t in sorted(tensors.items()) if "layers.0.self_attn.q_proj" in name])
fp8_loaded = load_hf_checkpoint(workdir / "fp8", params)
fleaf = fp8_loaded["layers_0"]["q_proj"]["kernel"]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rows = [[label, [i.name for i in candidate_impls(fp8, dev)],
             fp8.process_weights_after_loading(fleaf.qtensor, dev).impl, dispatch.native_fp8_dot(dev)]
            for label, dev in DEVICES.items()]
show_table(["device", "candidate impls", "prepared for", "native FP8 dot in apply"], rows)
for w in caught:  # below the scheme's min_capability (FP8 tensor cores: sm_89) the registry says so, once
    print("warning:", w.message)

xq = quantize_activation(fp8, x)
print(f"activations: x {x.dtype} {tuple(x.shape)} → codes {xq.data.dtype}, "
      f"one scale per token {tuple(xq.scale.shape)}")
y8 = fp8.apply(x, fleaf.weight)
reference = x.astype(jnp.float32) @ params["layers_0"]["q_proj"]["kernel"]
print(f"W8A8 apply on {fleaf.weight.impl}: max |y - x·W| / max|x·W| = "
      f"{float(jnp.abs(y8.astype(jnp.float32) - reference).max() / jnp.abs(reference).max()):.3%}")

# %% [markdown]
# On this machine the XLA implementation dequantizes both operands and multiplies in float32; on any
# GPU the same implementation hands the FP8 codes to XLA's FP8 dot with the per-token and per-channel
# scales applied to its output (cuBLASLt's FP8 GEMM on sm_89+), which is vLLM's `cutlass_scaled_mm`
# path. There is no Pallas FP8 kernel: `candidate_impls` lists `xla` alone for W8A8 schemes.

# %% [markdown]
# ## vLLM name → jquant name
#
# The same steps, as vLLM's quantization package names them (class and function names of vLLM's
# `model_executor/layers/quantization`; jquant has no class per method, so one name on the right
# often covers several on the left):
#
# | step | vLLM | jquant |
# |---|---|---|
# | config → method | `get_quantization_config(quant_method)`, `QuantizationConfig.from_config(hf_quant_cfg)` (`GPTQMarlinConfig`, `Fp8Config`, `CompressedTensorsConfig`, `ModelOptNvFp4Config`, `BitsAndBytesConfig`, …) | `scheme_from_config(quantization_config)` → `Scheme` |
# | per-layer choice, ignore lists | `QuantizationConfig.get_quant_method(layer, prefix)`, `UnquantizedLinearMethod` for ignored layers | `quantize_params(params, rules, skip=...)`, `skipped_modules(config)`, `skip_from_config(config)` |
# | a compressed-tensors scheme | `CompressedTensorsWNA16`, `CompressedTensorsW8A8Fp8`, `CompressedTensorsW4A16Fp4`, … | a `Scheme` (`int4_g128`, `fp8_e4m3_channel`, `nvfp4`, …): `WeightSpec` + `ActivationSpec` + `LayoutSpec` |
# | create and load the weights | `LinearMethodBase.create_weights` + each parameter's `weight_loader` | `from_checkpoint(tensors, layout)`, `load_hf_checkpoint(directory, like)` → `QTensor` / `QParam` |
# | re-layout once | `process_weights_after_loading(layer)` (Marlin / Machete repack, FP8 scale fix-ups) | `Scheme.process_weights_after_loading(qtensor, device)` → `Prepared` (`prepack_nk` for the Mosaic GPU kernel) |
# | forward | `LinearMethodBase.apply(layer, x, bias)` | `Scheme.apply(x, prepared, bias)`, `QParam.apply`, `quantized_apply(model, ...)` |
# | kernel choice by device | `choose_mp_linear_kernel(config, compute_capability)` → `MacheteLinearKernel` (sm_90), `MarlinLinearKernel`, … | `candidate_impls(scheme, device)` → `pallas_w4a16` (sm_90), `xla` |
# | kernel choice by M | inside the chosen kernel | `dispatch.w4a16_impl(M, capability, N·K)` (`mgpu`, `xla`, `reference`) |
# | device query | `current_platform.get_device_capability()` | `dispatch.compute_capability(device)` |
# | W8A8 FP8 GEMM | `Fp8LinearOp` → `cutlass_scaled_mm` / `torch._scaled_mm` | `xla` impl with `dispatch.native_fp8_dot(device)` |
# | KV cache dtype | `--kv-cache-dtype` (`auto`, `fp8`, `fp8_e4m3`, `fp8_e5m2`, …) | the same names in `jquant.kv` (`new_cache(..., kv_cache_dtype=...)`) |

# %%
print("registered schemes:", ", ".join(jquant.schemes()))
print("checkpoint layouts:", ", ".join(jquant.layouts()))
shutil.rmtree(workdir)  # the two tiny checkpoints written above
