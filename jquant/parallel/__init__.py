"""Tensor-parallel decoding: a Llama split over a ``("tp",)`` mesh (Megatron's column / row split, KV heads
and their cache pages per device, the kernels run per device under ``jax.shard_map``), with its
row-parallel sums in the activations' dtype or FP8; and a MoE layer split by experts or by their
intermediate features (``moe.py``). Design: ``docs/design/tensor_parallel.md``."""

from jquant.parallel.collectives import Collectives, fp8_pack, fp8_unpack
from jquant.parallel.llama import TensorParallel, decode_step, generate, tensor_parallel
from jquant.parallel.moe import MoEParallel, moe_parallel, shard_moe_params
from jquant.parallel.placement import Sharded, cache_specs, local_params, param_specs, shard_cache, shard_params

__all__ = ["Collectives", "MoEParallel", "Sharded", "TensorParallel", "cache_specs", "decode_step", "fp8_pack",
           "fp8_unpack", "generate", "local_params", "moe_parallel", "param_specs", "shard_cache",
           "shard_moe_params", "shard_params", "tensor_parallel"]
