"""The grouped FP8 W8A8 GEMM for MoE on Hopper: the Mosaic GPU FP8 GEMM (``jquant.kernels.fp8_gemm``)
over expert slots, as ``grouped_w4a16`` runs the W4A16 kernel (``slot_table``).

Activations are quantized as the experts' scheme says (``quantize_activation``: DeepSeek's per-token
1 × 128 groups for block FP8), so the result is the scheme's W8A8 numerics; the quantized rows and
their scales are gathered into slots of 64 or 128 rows (x is the wgmma A operand;
``grouped_fp8_config``), each slot's tile multiplies by its expert's e4m3 weight with the block
scales promoted per K block, and each row's result is gathered back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jquant.kernels.fp8_gemm.config import Fp8GemmConfig
from jquant.kernels.fp8_gemm.from_qtensor import pack_fp8_qtensor
from jquant.kernels.fp8_gemm.layout import PackedFp8, activation_operands
from jquant.kernels.moe.grouped_w4a16 import pack_each_expert, slot_table
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Scheme


def prepack_fp8_experts(experts: QTensor) -> PackedFp8:
    """A stacked e4m3 expert QTensor ``[E, N, K]`` (128 × 128 blocks, per channel or per tensor, each
    expert its own scales) as the FP8 GEMM's weight, stacked: ``data`` ``[E, N_pad, K_pad]``, ``scale``
    ``[E, blocks, N_pad]``.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_fp8 import prepack_fp8_experts
      >>> stack = quantize_expert_weights(np.ones((2, 256, 384), np.float32), "fp8_e4m3_block128x128")
      >>> packed = prepack_fp8_experts(stack)
      >>> packed.data.shape, packed.scale.shape
      ((2, 256, 384), (2, 3, 256))
    """
    return pack_each_expert(experts, pack_fp8_qtensor, "prepack_fp8_experts",
                            "FP8 GEMM layout (e4m3 per tensor, channel or 128 × 128 blocks)")


def grouped_fp8_config(rows: int, num_experts: int) -> Fp8GemmConfig:
    """The launch for ``rows`` sorted rows over ``num_experts``: slots of 64 rows on one warpgroup
    (decode, and prefill up to 127 rows an expert under even routing), else slots of 128 rows on two
    warpgroups of 64 sharing each weight tile, so one promotes its block-scaled sum while the other's
    wgmmas run (the dense block-FP8 launch from M = 256, ``default_fp8_config``).

    Examples:
      >>> from jquant.kernels.moe.grouped_fp8 import grouped_fp8_config
      >>> grouped_fp8_config(64 * 8, 128).compute_wgs, grouped_fp8_config(4096 * 8, 128).compute_wgs
      (1, 2)
    """
    two = -(-rows // max(num_experts, 1)) >= 128
    return Fp8GemmConfig(swap_ab=False, block_a=64, block_b=128, compute_wgs=2 if two else 1)


def grouped_fp8(x: jax.Array, packed: PackedFp8, group_sizes: jax.Array, scheme: Scheme, *,
                config: Fp8GemmConfig | None = None, interpret: bool = False) -> jax.Array:
    """``y [T, N]``: the rows of x (sorted by expert) quantized as ``scheme``'s activations say, times
    each expert's e4m3 weight (fp32 accumulation, block scales promoted per K block), in x's dtype;
    rows past the groups are 0. ``config``: the FP8 GEMM's launch (x as A; a slot is ``block_a ·
    compute_wgs`` rows), by default ``grouped_fp8_config``'s.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import QExperts, quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_fp8 import grouped_fp8, prepack_fp8_experts
      >>> from jquant.schemes.scheme import get_scheme
      >>> scheme = get_scheme("fp8_e4m3_block128x128")
      >>> rng = np.random.default_rng(0)
      >>> q = QExperts(quantize_expert_weights(rng.standard_normal((2, 256, 128)).astype(np.float32), scheme), scheme)
      >>> x, sizes = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16), jnp.array([3, 2], jnp.int32)
      >>> y = grouped_fp8(x, prepack_fp8_experts(q.weight), sizes, scheme, interpret=True)
      >>> ref = q.apply(x, sizes)
      >>> y.shape, bool(jnp.allclose(y.astype(jnp.float32), ref.astype(jnp.float32), rtol=2e-2, atol=0.1))
      ((5, 256), True)
    """
    from jquant.kernels.fp8_gemm.mosaic_gpu import fp8_gemm_mgpu   # Mosaic GPU loads only where it runs
    from jquant.kernels.act_quant import quantize_scheme_activation

    if scheme.weight_only or scheme.activation.format != "fp8_e4m3":
        raise ValueError(f"grouped_fp8 runs W8A8 FP8 schemes (e4m3 activations), not {scheme.name!r}")
    if x.ndim != 2 or x.shape[1] != packed.k:
        raise ValueError(f"grouped_fp8: x must be rows [T, K={packed.k}], got {tuple(x.shape)}")
    rows = x.shape[0]
    xq = quantize_scheme_activation(scheme, x, interpret=interpret)
    scale = xq.scale.dequantize(jnp.float32) if isinstance(xq.scale, QTensor) else xq.scale
    scale = jnp.broadcast_to(scale.astype(jnp.float32), (rows, scale.shape[-1]))
    cfg = config or grouped_fp8_config(rows, jnp.shape(group_sizes)[0])
    block_a = cfg.block_a * cfg.compute_wgs   # rows a slot
    ids, counts, first, where = slot_table(group_sizes, rows, block_a)
    take = jnp.clip(first[:, None] + jnp.arange(block_a, dtype=jnp.int32)[None, :], 0, rows - 1).reshape(-1)
    live = (jnp.arange(block_a)[None, :] < counts[:, None]).reshape(-1, 1)
    codes = jnp.where(live, xq.data[take], jnp.zeros((), xq.data.dtype))
    scales = jnp.where(live, scale[take], 0.0)
    a, a_scale = activation_operands(codes, scales, packed, codes.shape[0])
    y_slots = fp8_gemm_mgpu(a, a_scale, packed.data, packed.scale, None, out_dtype=x.dtype, config=cfg,
                            interpret=interpret, slots=(ids, counts))
    y = y_slots[jnp.maximum(where, 0), :packed.n]
    return jnp.where((where >= 0)[:, None], y, jnp.zeros((), y.dtype))


@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """e4m3 experts laid out for the grouped FP8 GEMM (``prepack_fp8_experts``) under a W8A8 FP8
    scheme, run by ``MoE`` as it runs ``QExperts``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import QExperts, quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_fp8 import Fp8Experts
      >>> from jquant.schemes.scheme import get_scheme
      >>> scheme = get_scheme("fp8_e4m3_block128x128")
      >>> q = QExperts(quantize_expert_weights(np.ones((2, 128, 128), np.float32), scheme), scheme)
      >>> Fp8Experts.from_qexperts(q, interpret=True).apply(jnp.ones((3, 128), jnp.bfloat16), jnp.array([1, 2])).shape
      (3, 128)
    """

    packed: PackedFp8
    scheme: Scheme
    shape: tuple[int, int, int]
    interpret: bool = False

    @classmethod
    def from_qexperts(cls, experts, interpret: bool = False) -> "Fp8Experts":
        return cls(prepack_fp8_experts(experts.weight), experts.scheme, tuple(experts.shape), interpret)

    def apply(self, x: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
        del impl
        return grouped_fp8(x, self.packed, group_sizes, self.scheme, interpret=self.interpret)


jax.tree_util.register_dataclass(Fp8Experts, data_fields=["packed"], meta_fields=["scheme", "shape", "interpret"])
