"""The grouped FP8 W8A8 GEMM for MoE on Hopper: the Mosaic GPU FP8 GEMM (``jquant.kernels.fp8_gemm``)
over expert slots (``jquant.kernels.moe.slots``), as ``grouped_w4a16`` runs the W4A16 kernel.

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
from jquant.kernels.moe.grouped_w4a16 import pack_each_expert
from jquant.kernels.moe.slots import Slots
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
    rows past the groups are 0. ``config``: the FP8 GEMM's launch (x as A; a slot is ``x_rows``
    rows), by default ``grouped_fp8_config``'s.

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
    _check_scheme(scheme)
    if x.ndim != 2 or x.shape[1] != packed.k:
        raise ValueError(f"grouped_fp8: x must be rows [T, K={packed.k}], got {tuple(x.shape)}")
    cfg = config or grouped_fp8_config(x.shape[0], jnp.shape(group_sizes)[0])
    slots = Slots.plan(group_sizes, x.shape[0], cfg.x_rows)
    # Quantized before the gather: at decode the slots hold many more rows than x.
    codes, scales = _quantize(scheme, x, interpret)
    return slots.rows(_slot_gemm(slots.take(codes), slots.take(scales), packed, slots, cfg, x.dtype, interpret))


def grouped_fp8_slots(xs: jax.Array, packed: PackedFp8, slots: Slots, scheme: Scheme, *,
                      config: Fp8GemmConfig | None = None, interpret: bool = False) -> jax.Array:
    """``grouped_fp8`` in the slot layout: ``xs [S · block, K]`` (``slots.take`` of the sorted rows, a
    slot ``config.x_rows`` rows) → ``[S · block, N]``. The slot rows are quantized
    as they stand, so a scheme whose activation scale spans all rows (dynamic per tensor) would count
    the slots' zero rows; ``Fp8Experts.rows_independent`` keeps such schemes off this path.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.moe import QExperts, quantize_expert_weights
      >>> from jquant.kernels.moe.grouped_fp8 import grouped_fp8, grouped_fp8_config, grouped_fp8_slots
      >>> from jquant.kernels.moe.grouped_fp8 import prepack_fp8_experts
      >>> from jquant.kernels.moe.slots import Slots
      >>> from jquant.schemes.scheme import get_scheme
      >>> scheme = get_scheme("fp8_e4m3_block128x128")
      >>> rng = np.random.default_rng(0)
      >>> packed = prepack_fp8_experts(quantize_expert_weights(rng.standard_normal((2, 256, 128)).astype(np.float32),
      ...                                                      scheme))
      >>> x, sizes = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16), jnp.array([3, 2], jnp.int32)
      >>> slots = Slots.plan(sizes, rows=5, block_m=grouped_fp8_config(5, 2).x_rows)
      >>> ys = grouped_fp8_slots(slots.take(x), packed, slots, scheme, interpret=True)
      >>> ys.shape, bool((slots.rows(ys) == grouped_fp8(x, packed, sizes, scheme, interpret=True)).all())
      ((128, 256), True)
    """
    _check_scheme(scheme)
    cfg = config or grouped_fp8_config(slots.num_rows, packed.data.shape[0])
    if xs.shape != (slots.size, packed.k):
        raise ValueError(f"grouped_fp8_slots: xs must be slot rows [{slots.size}, K={packed.k}], got "
                         f"{tuple(xs.shape)}")
    codes, scales = _quantize(scheme, xs, interpret)
    return _slot_gemm(codes, scales, packed, slots, cfg, xs.dtype, interpret)


def _check_scheme(scheme: Scheme) -> None:
    if scheme.weight_only or scheme.activation.format != "fp8_e4m3":
        raise ValueError(f"grouped_fp8 runs W8A8 FP8 schemes (e4m3 activations), not {scheme.name!r}")


def _quantize(scheme: Scheme, x: jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """e4m3 codes ``[rows, K]`` and float32 scales ``[rows, K blocks]`` of x under ``scheme``."""
    from jquant.kernels.act_quant import quantize_scheme_activation

    xq = quantize_scheme_activation(scheme, x, interpret=interpret)
    scale = xq.scale.dequantize(jnp.float32) if isinstance(xq.scale, QTensor) else xq.scale
    return xq.data, jnp.broadcast_to(scale.astype(jnp.float32), (x.shape[0], scale.shape[-1]))


def _slot_gemm(codes, scales, packed: PackedFp8, slots: Slots, cfg: Fp8GemmConfig, out_dtype, interpret: bool):
    from jquant.kernels.fp8_gemm.mosaic_gpu import fp8_gemm_mgpu   # Mosaic GPU loads only where it runs

    if cfg.x_rows != slots.block_m:
        raise ValueError(f"grouped_fp8: the launch's slot of {cfg.x_rows} rows is not the "
                         f"slots' {slots.block_m}")
    a, a_scale = activation_operands(codes, scales, packed, codes.shape[0])
    y = fp8_gemm_mgpu(a, a_scale, packed.data, packed.scale, None, out_dtype=out_dtype, config=cfg,
                      interpret=interpret, slots=(slots.ids, slots.counts))
    return y[:, :packed.n]


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

    @property
    def rows_independent(self) -> bool:
        """Whether a row's quantized activations depend on that row alone (not a dynamic per-tensor scale)."""
        return self.scheme.activation.mode != "dynamic_per_tensor"

    def slot_rows(self, rows: int) -> int:
        """The slot height ``apply`` takes for ``rows`` sorted rows."""
        return grouped_fp8_config(rows, self.shape[0]).x_rows

    def apply_slots(self, xs: jax.Array, slots: Slots) -> jax.Array:
        """``apply`` in the slot layout (``grouped_fp8_slots``)."""
        return grouped_fp8_slots(xs, self.packed, slots, self.scheme, interpret=self.interpret)


jax.tree_util.register_dataclass(Fp8Experts, data_fields=["packed"], meta_fields=["scheme", "shape", "interpret"])
