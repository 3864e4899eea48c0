"""Mixture-of-experts ops: stacked expert QTensors, routing, and the grouped GEMM (XLA reference, and the
grouped Mosaic GPU kernels: W4A16 for decode, ``grouped_w4a16`` / ``W4A16Experts``; block FP8,
``grouped_fp8`` / ``Fp8Experts``)."""

from jquant.kernels.moe.api import IMPLS, choose_impl, grouped_matmul, prepare_experts
from jquant.kernels.moe.grouped_fp8 import Fp8Experts, grouped_fp8, prepack_fp8_experts
from jquant.kernels.moe.grouped_w4a16 import W4A16Experts, grouped_w4a16, prepack_experts
from jquant.kernels.moe.experts import (QExperts, concat_rows, expert, quantize_expert_weights, split_rows,
                                        stack_experts, unstack_experts)
from jquant.kernels.moe.routing import (Dispatch, Routing, check_router_logits, combine, gather_rows, route,
                                        route_checked, sort_by_expert, sort_local_experts)

__all__ = ["Dispatch", "Fp8Experts", "IMPLS", "QExperts", "Routing", "W4A16Experts", "grouped_fp8", "grouped_w4a16",
           "prepack_experts", "prepack_fp8_experts", "check_router_logits", "choose_impl", "combine",
           "concat_rows", "expert", "gather_rows", "grouped_matmul", "prepare_experts", "quantize_expert_weights", "route",
           "route_checked", "sort_by_expert", "sort_local_experts", "split_rows", "stack_experts", "unstack_experts"]
