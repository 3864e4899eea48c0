"""The named schemes jquant ships, and the constructors ``scheme_from_config`` builds schemes with."""

from __future__ import annotations

from jquant.formats.bnb_int8 import DEFAULT_THRESHOLD
from jquant.schemes.scheme import Scheme, register_scheme
from jquant.schemes.spec import ActivationSpec, LayoutSpec, WeightSpec

FP8_CAPABILITY = 89  # FP8 tensor cores: Ada and Hopper
INT8_CAPABILITY = 75  # INT8 tensor cores (IMMA) that cuBLASLt runs int8 GEMMs on: Turing and up


def int_weight_only(bits: int, group_size: int | None, *, symmetric: bool = True, layout: str | None = None,
                    layout_spec: LayoutSpec = LayoutSpec()) -> Scheme:
    """W{bits}A16 integer weights, groups of ``group_size`` along K (None: per output channel)."""
    gname = f"g{group_size}" if group_size else "ch"
    return Scheme(
        name=f"int{bits}_{gname}{'' if symmetric else '_asym'}",
        # GPTQ and AWQ checkpoints store fp16 scales: quantize with them so export is lossless.
        weight=WeightSpec.integer(bits, group_size, symmetric=symmetric,
                                  scale_dtype="float16" if layout in ("gptq", "awq") else None),
        checkpoint_layout=layout,
        layout=layout_spec,
        description=f"INT{bits} weight-only, {'per-channel' if group_size is None else f'group {group_size}'}, "
                    f"{'symmetric' if symmetric else 'asymmetric (zero points)'}; bf16 activations",
    )


def fp8_tensor(*, static_activations: bool = False, weight_only: bool = False, element: str = "fp8_e4m3",
               layout: str | None = "fp8", input_scale: float | None = None,
               per_token_activations: bool = False) -> Scheme:
    """FP8 W8A8 with a per-tensor weight scale; dynamic per-tensor (or static) activation scale, or with
    ``per_token_activations`` one dynamic scale per token (what vLLM runs for dynamic checkpoints on GPUs
    with CUTLASS FP8, sm_89 and up)."""
    dynamic = "dynamic_per_token" if per_token_activations else "dynamic_per_tensor"
    activation = "none" if weight_only else ("static" if static_activations else dynamic)
    return Scheme(
        name=f"{element}_tensor" + ("_static" if static_activations else "") + ("_w_only" if weight_only else "")
        + ("_per_token" if activation == "dynamic_per_token" else ""),
        weight=WeightSpec(element, 8, granularity="tensor"),
        activation=ActivationSpec() if weight_only else ActivationSpec(activation, element, input_scale=input_scale),
        min_capability=FP8_CAPABILITY, checkpoint_layout=layout,
        description="FP8 weights, per-tensor scale; " + ("bf16 activations" if weight_only else
                                                         f"{activation.replace('_', ' ')} FP8 activations"),
    )


def fp8_channel(*, weight_only: bool = False, static_activations: bool = False, element: str = "fp8_e4m3",
                layout: str | None = "fp8") -> Scheme:
    """FP8 weights with a scale per output channel; activations FP8 with a scale per token (or one static,
    calibrated per-tensor scale: compressed-tensors W8A8 with static input activations)."""
    activation = "none" if weight_only else ("static" if static_activations else "dynamic_per_token")
    return Scheme(
        name=f"{element}_channel" + ("_static" if static_activations else "") + ("_w_only" if weight_only else ""),
        weight=WeightSpec(element, 8, granularity="channel"),
        activation=ActivationSpec(activation, None if weight_only else element),
        min_capability=FP8_CAPABILITY, checkpoint_layout=layout,
        description="FP8 weights per output channel; " + ("bf16 activations" if weight_only else
                                                          "static per-tensor FP8 activations" if static_activations
                                                          else "dynamic per-token FP8 activations"),
    )


def fp8_block(block: tuple[int, int] = (128, 128), *, ue8m0: bool = False, element: str = "fp8_e4m3",
              layout: str | None = "fp8-block") -> Scheme:
    """DeepSeek-style block FP8: weight blocks of ``block``, activations per token per ``block[1]`` group."""
    return Scheme(
        name=f"{element}_block{block[0]}x{block[1]}" + ("_ue8m0" if ue8m0 else ""),
        weight=WeightSpec(element, 8, granularity="block", block_size=tuple(block), ue8m0=ue8m0),
        activation=ActivationSpec("dynamic_per_token_group", element, group_size=block[1], ue8m0=ue8m0),
        min_capability=FP8_CAPABILITY, checkpoint_layout=layout,
        description=f"FP8 {block[0]}x{block[1]} weight blocks, per-token-group FP8 activations"
                    + (", UE8M0 (power-of-two) scales" if ue8m0 else ""),
    )


def int8_w8a8(*, static_activations: bool = False, input_scale: float | None = None,
              layout: str | None = "compressed-tensors/int-quantized") -> Scheme:
    """INT8 W8A8 (vLLM's compressed-tensors ``W8A8Int8``): symmetric int8 weights per output channel,
    symmetric int8 activations per token (or one static, calibrated scale), int32 accumulation."""
    mode = "static" if static_activations else "dynamic_per_token"
    return Scheme(
        name="int8_w8a8" + ("_static" if static_activations else ""),
        weight=WeightSpec.integer(8, None, symmetric=True),
        activation=ActivationSpec(mode, "int8", input_scale=input_scale),
        min_capability=INT8_CAPABILITY, checkpoint_layout=layout,
        description="INT8 weights per output channel; " + ("static per-tensor" if static_activations
                                                           else "dynamic per-token") + " INT8 activations",
    )


def mxfp4(scale_mode: str = "floor") -> Scheme:
    return Scheme(name="mxfp4", weight=WeightSpec("mxfp4", 4, scale_mode=scale_mode),
                  checkpoint_layout="gpt-oss",
                  description="MXFP4 weights (E2M1, block 32, E8M0 scale); bf16 activations (Hopper has no FP4 MMA)")


def mxfp4_compressed_tensors() -> Scheme:
    """MXFP4 as compressed-tensors quantizes it (llm-compressor's MXFP4A16; vLLM runs dense layers of
    ``mxfp4-pack-quantized`` checkpoints weight-only, ``CompressedTensorsW4A16Mxfp4``)."""
    return Scheme(name="mxfp4_ct",
                  weight=WeightSpec("mxfp4", 4, scale_mode="even", element_rounding="compressed-tensors"),
                  checkpoint_layout="compressed-tensors/mxfp4-pack-quantized",
                  description="MXFP4 weights as compressed-tensors rounds them (scale from the group amax "
                              "rounded to a power of two, E2M1 half to even); bf16 activations")


def mxfp8(scale_mode: str = "floor") -> Scheme:
    return Scheme(name="mxfp8", weight=WeightSpec("mxfp8_e4m3", 8, scale_mode=scale_mode),
                  checkpoint_layout="compressed-tensors/mxfp8-quantized",
                  description="MXFP8 weights (E4M3, block 32, E8M0 scale); bf16 activations (Hopper has no MX MMA)")


def mxfp8_compressed_tensors() -> Scheme:
    """MXFP8 as compressed-tensors quantizes it (llm-compressor's MXFP8A16 and MXFP8). vLLM reads
    ``mxfp8-quantized`` checkpoints with ``CompressedTensorsW8A8Mxfp8``, which on Hopper runs them
    weight-only (Marlin, or its emulation's bfloat16 dequantization): so does this scheme."""
    return Scheme(name="mxfp8_ct",
                  weight=WeightSpec("mxfp8_e4m3", 8, scale_mode="even_e2m1", element_rounding="compressed-tensors"),
                  checkpoint_layout="compressed-tensors/mxfp8-quantized",
                  description="MXFP8 weights as compressed-tensors rounds them (scale from the group amax "
                              "rounded to one mantissa bit); bf16 activations")


def mxfp8_modelopt() -> Scheme:
    """MXFP8 as TensorRT Model Optimizer quantizes it (``quant_algo`` MXFP8; vLLM's
    ``ModelOptMxFp8LinearMethod``, weight-only on Hopper like ``mxfp8_ct``)."""
    return Scheme(name="mxfp8_modelopt",
                  weight=WeightSpec("mxfp8_e4m3", 8, scale_mode="rceil_log2f", element_rounding="modelopt"),
                  checkpoint_layout="modelopt",
                  description="MXFP8 weights as Model Optimizer rounds them (scale 2^ceil(log2(amax / 448))); "
                              "bf16 activations")


def nvfp4(convention: str = "compressed-tensors") -> Scheme:
    layout = "modelopt" if convention == "modelopt" else "compressed-tensors"
    return Scheme(name="nvfp4" + ("_modelopt" if convention == "modelopt" else ""),
                  weight=WeightSpec("nvfp4", 4, convention=convention), checkpoint_layout=layout,
                  description="NVFP4 weights (E2M1, block 16, E4M3 scale, FP32 global scale); bf16 activations "
                              "(on Hopper NVFP4 runs weight-only, as vLLM's Marlin path does)")


def bnb_4bit(quant_type: str = "nf4", *, double_quant: bool = False, blocksize: int = 64) -> Scheme:
    fmt = "nf4" if quant_type == "nf4" else "fp4_bnb"
    return Scheme(name=fmt + ("_dq" if double_quant else ""),
                  weight=WeightSpec(fmt, 4, blocksize=blocksize, double_quant=double_quant), checkpoint_layout="bnb",
                  description=f"bitsandbytes {quant_type.upper()} (block {blocksize}, absmax"
                              + (", double-quantized" if double_quant else "") + "); bf16 activations")


def llm_int8(threshold: float = DEFAULT_THRESHOLD) -> Scheme:
    """bitsandbytes' LLM.int8() (``load_in_8bit``) as vLLM runs it: int8 weights with a float32 absmax per
    output channel; activations int8 per token, except columns holding a value of magnitude ≥
    ``threshold``, which run in bfloat16 (0: none)."""
    # repr: distinct thresholds get distinct names (6.0000001 is not "6").
    suffix = "" if threshold == DEFAULT_THRESHOLD else f"_t{float(threshold)!r}".removesuffix(".0")
    return Scheme(name="llm_int8" + suffix,
                  weight=WeightSpec("int8_bnb", 8),
                  activation=ActivationSpec("llm_int8", "int8", outlier_threshold=threshold),
                  checkpoint_layout="bnb",
                  description="bitsandbytes LLM.int8(): int8 weights per output channel (absmax), int8 "
                              f"activations per token with outlier columns (|x| ≥ {threshold:g}) in bfloat16")


BUILTIN = (
    int_weight_only(8, None, layout="compressed-tensors"),
    int_weight_only(4, 128, layout="gptq"),
    int_weight_only(4, 128, symmetric=False, layout="awq"),
    int_weight_only(4, 64, layout="gptq"),
    int_weight_only(4, 32, layout="gptq"),
    int8_w8a8(),
    fp8_tensor(),
    fp8_channel(),
    fp8_block(),
    fp8_block(ue8m0=True),
    mxfp4(),
    mxfp4_compressed_tensors(),
    mxfp8(),
    mxfp8_compressed_tensors(),
    nvfp4(),
    bnb_4bit("nf4"),
    bnb_4bit("nf4", double_quant=True),
    bnb_4bit("fp4"),
    llm_int8(),
)

for _scheme in BUILTIN:
    register_scheme(_scheme)
