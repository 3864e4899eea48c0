"""Mixture-of-experts ops: stacked expert QTensors, routing, and the grouped GEMM (XLA reference; the
Hopper kernels are still to come)."""

from jquant.kernels.moe.api import IMPLS, choose_impl, grouped_matmul
from jquant.kernels.moe.experts import (QExperts, concat_rows, expert, quantize_expert_weights, split_rows,
                                        stack_experts, unstack_experts)
from jquant.kernels.moe.routing import (Dispatch, Routing, check_router_logits, combine, gather_rows, route,
                                        route_checked, sort_by_expert)

__all__ = ["Dispatch", "IMPLS", "QExperts", "Routing", "check_router_logits", "choose_impl", "combine",
           "concat_rows", "expert", "gather_rows", "grouped_matmul", "quantize_expert_weights", "route",
           "route_checked", "sort_by_expert", "split_rows", "stack_experts", "unstack_experts"]
