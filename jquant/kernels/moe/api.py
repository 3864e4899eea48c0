"""The grouped GEMM of a MoE layer: rows of x sorted by expert times each expert's (quantized) weight.

``grouped_matmul(x, experts, group_sizes)`` has ``jax.lax.ragged_dot``'s contract with the weight in
PyTorch orientation (``reference.py``). ``choose_impl`` picks the implementation of a bare stack (the
XLA reference); ``prepare_experts`` lays a model's stacks out once for the grouped kernels that
``jquant.schemes.dispatch.moe_experts_impl`` chooses (``W4A16Experts``, ``Fp8Experts``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jquant.kernels.moe import reference
from jquant.kernels.moe.experts import check_stack
from jquant.qtensor import QTensor

IMPLS = ("auto", "xla", "mgpu")


def choose_impl(experts: QTensor | jax.Array, device: jax.Device | None = None) -> str:
    """The implementation ``impl="auto"`` runs for ``experts`` on ``device``: ``"xla"`` everywhere. A
    bare stack would be laid out for the grouped kernel on every call, costing what the kernel saves;
    ``prepare_experts`` lays a model's stacks out once, and ``MoE`` then runs the kernel.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import IMPLS, choose_impl
      >>> choose_impl(jnp.zeros((2, 4, 8))), IMPLS
      ('xla', ('auto', 'xla', 'mgpu'))
    """
    del experts, device
    return "xla"


def prepare_experts(params, device: jax.Device | None = None):
    """``params`` (any pytree) with every ``QExperts`` laid out for the kernel this device runs it
    with (``jquant.schemes.dispatch.moe_experts_impl``): on Hopper a 4-bit weight-only stack becomes
    ``W4A16Experts`` (the grouped W4A16 kernel) and a W8A8 FP8 stack ``Fp8Experts`` (the grouped FP8
    GEMM, the scheme's activation quantization kept); anything else is returned as it is. ``MoE`` runs
    either the same way. A 4-bit stack named ``gate_up_proj`` (``MoE``'s gate/up pair) whose halves are
    multiples of 64 rows is laid out so the kernel applies the layer's bias and activation in its
    epilogue (``W4A16Experts(gate_up=True)``, ``dispatch.MOE_W4A16_ACTIVATION_IN_EPILOGUE``). Call it
    once after loading, as ``Scheme.process_weights_after_loading``.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.moe import QExperts, prepare_experts, quantize_expert_weights
      >>> from jquant.schemes.scheme import get_scheme
      >>> rng = np.random.default_rng(0)
      >>> q = QExperts(quantize_expert_weights(rng.standard_normal((2, 8, 64)).astype(np.float32), "mxfp4"),
      ...              get_scheme("mxfp4"))
      >>> type(prepare_experts({"w": q})["w"]).__name__  # on a CPU: unchanged
      'QExperts'
    """
    from jquant.kernels.moe.experts import EXPERT_PARAMS, QExperts
    from jquant.kernels.moe.grouped_fp8 import Fp8Experts
    from jquant.kernels.moe.grouped_w4a16 import GATE_UP_TILE, W4A16Experts
    from jquant.kernels.w4a16.from_qtensor import W4_FORMATS
    from jquant.schemes import dispatch

    capability = dispatch.compute_capability(device)

    def lay_out(path, q):
        if not isinstance(q, QExperts) or dispatch.moe_experts_impl(q.scheme, capability) != "mgpu":
            return q
        if q.scheme.weight_only:
            if q.weight.fmt not in W4_FORMATS:
                return q
            gate_up = (dispatch.MOE_W4A16_ACTIVATION_IN_EPILOGUE and q.shape[1] % (2 * GATE_UP_TILE) == 0
                       and getattr(path[-1], "key", None) == EXPERT_PARAMS[0])
            return W4A16Experts.from_qexperts(q, gate_up=gate_up)
        try:
            return Fp8Experts.from_qexperts(q)
        except ValueError:   # scale blocks the FP8 GEMM has no layout for (not tensor, channel, 128 × 128)
            return q

    return jax.tree_util.tree_map_with_path(lay_out, params, is_leaf=lambda q: isinstance(q, QExperts))


def _is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def _check_x(x) -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
        raise TypeError(f"grouped_matmul: x must be bfloat16, float16 or float32 rows [T, K], got dtype {dtype}")
    if x.ndim != 2:
        raise ValueError(f"grouped_matmul: x must be rows [T, K] (2-D), got shape {tuple(x.shape)}")


def _check_experts(experts) -> tuple[int, int, int]:
    if isinstance(experts, QTensor):
        return check_stack(experts, "experts").shape
    dtype = getattr(experts, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"grouped_matmul: experts must be a stacked QTensor or float weights [E, N, K], got "
                        f"{type(experts).__name__} with dtype {dtype}")
    if experts.ndim != 3:
        raise ValueError(f"grouped_matmul: experts must be [E, N, K] (3-D), got shape {tuple(experts.shape)}")
    return tuple(experts.shape)


def check_group_sizes(group_sizes, num_experts: int, rows: int) -> jax.Array:
    """``group_sizes`` as int32 ``[E]``; a ValueError names it when its shape or dtype is wrong, and,
    when its values are known (not traced), when one is negative or they sum past ``rows``."""
    shape = tuple(getattr(group_sizes, "shape", ()))
    dtype = getattr(group_sizes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"grouped_matmul: group_sizes must be integers [E], got dtype {dtype}")
    if shape != (num_experts,):
        raise ValueError(f"grouped_matmul: group_sizes must have shape ({num_experts},) (one size per expert), "
                         f"got {shape}")
    if not _is_traced(group_sizes):
        sizes = np.asarray(group_sizes).astype(np.int64)
        if np.any(sizes < 0):
            raise ValueError(f"grouped_matmul: group_sizes must be >= 0, got {sizes.tolist()} (negative at "
                             f"expert {int(np.argmax(sizes < 0))})")
        if sizes.sum() > rows:
            raise ValueError(f"grouped_matmul: group_sizes sum to {int(sizes.sum())}, more than the {rows} rows "
                             "of x")
    return jnp.asarray(group_sizes, jnp.int32)


def grouped_matmul(x: jax.Array, experts: QTensor | jax.Array, group_sizes: jax.Array, *,
                   impl: str = "auto", interpret: bool = False) -> jax.Array:
    """``y [T, N]`` with ``y[t] = W[e] @ x[t]`` for the rows of expert ``e``.

    Args:
      x: rows ``[T, K]`` sorted by expert (bfloat16, float16 or float32).
      experts: stacked weights ``[E, N, K]``: a QTensor (``quantize_expert_weights``, a checkpoint
        loader) or a float array.
      group_sizes: int ``[E]``, rows per expert in order, each ``>= 0``, summing to at most T (rows past
        the sum come out as zeros). Values are checked when known; under jit only shape and dtype.
      impl: ``"auto"`` (``choose_impl``), ``"xla"`` (dequantize + ``jax.lax.ragged_dot``) or ``"mgpu"``
        (a 4-bit weight-only stack through the grouped W4A16 Mosaic GPU kernel, ``grouped_w4a16``, laid
        out on every call: lay it out once with ``W4A16Experts`` in a model; Hopper, or ``interpret``).
      interpret: run the kernel in Pallas interpret mode (any device).

    Returns:
      ``[T, N]`` in x's dtype, accumulated in float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe import grouped_matmul
      >>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])  # expert 0 keeps a row, expert 1 doubles it
      >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
      >>> grouped_matmul(x, w, jnp.array([1, 2], jnp.int32)).tolist()
      [[1.0, 2.0], [6.0, 8.0], [10.0, 12.0]]
      >>> grouped_matmul(x, w, jnp.array([1, 1], jnp.int32)).tolist()  # past the groups: zeros
      [[1.0, 2.0], [6.0, 8.0], [0.0, 0.0]]

      Quantized experts give ``jax.lax.ragged_dot`` on the dequantized ``[E, K, N]`` weights:

      >>> import jax, numpy as np
      >>> from jquant.kernels.moe import quantize_expert_weights
      >>> rng = np.random.default_rng(0)
      >>> experts = quantize_expert_weights(rng.standard_normal((3, 8, 32)).astype(np.float32), "int4_g32")
      >>> x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
      >>> sizes = jnp.array([2, 0, 3], jnp.int32)  # rows 0-1 to expert 0, rows 2-4 to expert 2
      >>> y = grouped_matmul(x, experts, sizes)
      >>> ref = jax.lax.ragged_dot(x, jnp.swapaxes(experts.dequantize(), 1, 2), sizes)
      >>> y.shape, bool(jnp.allclose(y, ref, atol=1e-5))
      ((5, 8), True)
    """
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: impl must be one of {IMPLS}, got {impl!r}")
    _check_x(x)
    num_experts, n, k = _check_experts(experts)
    if x.shape[1] != k:
        raise ValueError(f"grouped_matmul: x has K={x.shape[1]} (shape {tuple(x.shape)}) but experts "
                         f"[E, N, K] = {(num_experts, n, k)} expect K={k}")
    group_sizes = check_group_sizes(group_sizes, num_experts, x.shape[0])
    impl = choose_impl(experts) if impl == "auto" else impl
    if impl == "xla":
        return reference.grouped_matmul_xla(x, experts, group_sizes)
    from jquant.kernels.moe.grouped_w4a16 import grouped_w4a16, prepack_experts
    from jquant.kernels.w4a16.api import resolve_kernel_impl
    from jquant.kernels.w4a16.from_qtensor import W4_FORMATS

    if not isinstance(experts, QTensor) or experts.fmt not in W4_FORMATS:
        raise ValueError(f"grouped_matmul: impl='mgpu' runs 4-bit expert stacks (int4, MXFP4, NVFP4, NF4), got "
                         f"{getattr(experts, 'fmt', type(experts).__name__)}")
    if resolve_kernel_impl("mgpu", interpret, None, "grouped_w4a16") != "mgpu":
        return reference.grouped_matmul_xla(x, experts, group_sizes)
    y = grouped_w4a16(x if x.dtype in (jnp.bfloat16, jnp.float16) else x.astype(jnp.bfloat16),
                      prepack_experts(experts), group_sizes, interpret=interpret)
    return y.astype(x.dtype)
