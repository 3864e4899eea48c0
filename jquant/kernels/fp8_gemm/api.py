"""``fp8_gemm``: ``y = (xq · sx) @ (wq · sw)ᵀ + bias`` for e4m3 activations and weights, per-token ×
per-channel (or per-tensor) scales or DeepSeek's 1 × 128 / 128 × 128 block scales, dispatched by
device (``jquant.schemes.dispatch.fp8_gemm_impl``).

Implementations (``impl``): ``"mgpu"`` (the Mosaic GPU kernel, Hopper), ``"pallas"`` (the kernel, nothing
else), ``"triton"`` (the 8-bit GEMV, ``jquant.kernels.gemv8``, up to ``MAX_ROWS`` rows: the codes widened
to fp32, exact, and the scales in the reference's order), ``"xla"`` (on a GPU XLA's FP8 dot, one per K
group for block scales while their fp32 partials fit, else as ``"reference"``), ``"reference"``
(``reference_fp8``: per K block an fp32 dot of the codes, scaled and summed), ``"auto"``.
``interpret=True`` runs the kernel on any device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jquant.kernels.fp8_gemm.config import Fp8GemmConfig, default_fp8_config
from jquant.kernels.fp8_gemm.layout import PackedFp8, activation_operands, reference_fp8
from jquant.kernels.gemv8.config import GemvConfig, kernel_for_config, resolve_gemv_impl
from jquant.kernels.w4a16.api import resolve_kernel_impl
from jquant.schemes import dispatch as device_lib
from jquant.schemes.xla import blockwise_fp8_dot, blockwise_fp8_fits


def resolve_fp8_impl(impl: str, m: int, interpret: bool = False, blocked: bool = False,
                     per_token: bool = False) -> str:
    """What ``fp8_gemm`` runs for ``impl`` at ``m`` rows (``blocked``: block scales; ``per_token``: one
    activation scale a row) on the default device.

    Examples:
      >>> from jquant.kernels.fp8_gemm import resolve_fp8_impl
      >>> resolve_fp8_impl("reference", 1), resolve_fp8_impl("auto", 1, interpret=True)
      ('reference', 'mgpu')
    """
    if impl == "triton":
        return resolve_gemv_impl(m, interpret, "fp8_gemm")
    return resolve_kernel_impl(impl, interpret, lambda cc: device_lib.fp8_gemm_impl(m, cc, blocked, per_token),
                               "fp8_gemm")


def fp8_gemm(xq, x_scale, packed: PackedFp8, *, bias=None, out_dtype=jnp.bfloat16, impl: str = "auto",
             config: Fp8GemmConfig | GemvConfig | None = None, interpret: bool = False):
    """``xq`` ``[M, K]`` float8_e4m3fn with ``x_scale`` (a scalar, ``[M]`` / ``[M, 1]`` per token, or
    ``[M, K / 128]`` per 1 × 128 group for a block-scaled weight) times the packed weight; fp32
    accumulation, ``[M, N]`` in ``out_dtype``. ``bias``: optional ``[N]``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, ml_dtypes
      >>> from jquant.kernels.fp8_gemm import fp8_gemm, prepack_fp8
      >>> rng = np.random.default_rng(0)
      >>> w = rng.standard_normal((128, 256)).astype(ml_dtypes.float8_e4m3fn)
      >>> packed = prepack_fp8(w, np.full(128, 0.5, np.float32))
      >>> xq = jnp.asarray(rng.standard_normal((4, 256)), jnp.float8_e4m3fn)
      >>> y = fp8_gemm(xq, jnp.full((4, 1), 2.0), packed, interpret=True)  # the kernel, interpreted
      >>> ref = xq.astype(jnp.float32) @ w.astype(np.float32).T  # 2.0 · 0.5 = 1
      >>> y.shape, bool(jnp.allclose(y.astype(jnp.float32), ref, rtol=1e-2, atol=0.1))
      ((4, 128), True)
    """
    if not isinstance(packed, PackedFp8):
        raise TypeError(f"packed must be a PackedFp8 (prepack_fp8), got {type(packed).__name__}")
    xq = jnp.asarray(xq)
    if xq.ndim != 2 or xq.shape[0] == 0:
        raise ValueError(f"xq must be [M, K] with M ≥ 1, got shape {tuple(xq.shape)}")
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32)
        if bias.shape != (packed.n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({packed.n},)")
    if config is not None and not isinstance(config, (Fp8GemmConfig, GemvConfig)):
        raise TypeError(f"config must be an Fp8GemmConfig or GemvConfig, got {type(config).__name__}")
    m = xq.shape[0]
    per_token = not packed.blocked and jnp.size(x_scale) > 1
    kind = kernel_for_config(resolve_fp8_impl(impl, m, interpret, packed.blocked, per_token), impl, config, m,
                             Fp8GemmConfig)
    if kind == "triton":
        return _gemv(xq, x_scale, packed, bias, out_dtype, config, interpret)
    if kind == "xla" and device_lib.native_fp8_dot():
        if not packed.blocked:
            return _xla_fp8_dot(xq, x_scale, packed, bias, out_dtype)
        if blockwise_fp8_fits(packed.scale.shape[0], m, packed.n_pad):   # the W8A8 schemes' XLA path
            codes, cols = activation_operands(xq, x_scale, packed, m)
            out = blockwise_fp8_dot(codes, packed.data, cols, packed.scale)[:, :packed.n]
            return (out if bias is None else out + bias).astype(out_dtype)
        if impl == "auto" and device_lib.has_wgmma(device_lib.compute_capability()):
            kind = "mgpu"   # partials too large for XLA's per-group dot: the kernel beats an fp32 dequantize
    if kind != "mgpu":
        return reference_fp8(xq, x_scale, packed, bias, out_dtype)
    config = config or default_fp8_config(m, packed.n_pad, packed.blocked, jnp.dtype(out_dtype).itemsize,
                                          num_sms=0 if interpret else device_lib.sm_count())
    return run_kernel(xq, x_scale, packed, bias, out_dtype, config, interpret)


def _xla_fp8_dot(xq, x_scale, packed: PackedFp8, bias, out_dtype):
    """One K block on a GPU: XLA's FP8 dot (cuBLASLt) of the codes, then both sides' scales in fp32, as
    the W8A8 schemes' XLA path runs it; not the fp32 twin."""
    codes, cols = activation_operands(xq, x_scale, packed, xq.shape[0])
    acc = jax.lax.dot_general(codes, packed.data, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    # CUTLASS's epilogue order, s_a · (s_b · acc), as the schemes' XLA path: fp32 products are not associative.
    out = (cols[0][:, None] * (packed.scale[0][None, :] * acc))[:, :packed.n]
    if bias is not None:
        out = out + bias
    return out.astype(out_dtype)


def _gemv(xq, x_scale, packed: PackedFp8, bias, out_dtype, config, interpret: bool):
    """The 8-bit GEMV on the codes: per-token × per-channel (or per-tensor) scales on the fp32 sums,
    block scales on each 128-wide K block's sum, as ``reference_fp8`` orders them."""
    from jquant.kernels.gemv8.triton import gemv8   # Pallas loads only where the kernel runs

    codes, cols = activation_operands(xq, x_scale, packed, xq.shape[0])
    if bias is not None:
        bias = jnp.pad(bias, (0, packed.n_pad - packed.n))
    if packed.blocked:
        scales = dict(group_size=packed.k_pad // packed.scale.shape[0], group_scale=packed.scale,
                      x_group_scale=cols.T)
    else:
        scales = dict(col_scale=packed.scale[0], row_scale=cols[0])
    out = gemv8(codes, packed.data, **scales, bias=bias, out_dtype=out_dtype, config=config,
                interpret=interpret)
    return out[:, :packed.n]


def run_kernel(xq, x_scale, packed: PackedFp8, bias, out_dtype, cfg: Fp8GemmConfig, interpret: bool):
    """The Mosaic GPU kernel on ``fp8_gemm``'s checked arguments: x padded to the x tile's rows,
    under swap AB the weight as A."""
    from jquant.kernels.fp8_gemm.mosaic_gpu import fp8_gemm_mgpu   # Mosaic GPU loads only where it runs

    m = xq.shape[0]
    rows = -(-m // cfg.x_rows) * cfg.x_rows
    codes, cols = activation_operands(xq, x_scale, packed, rows)
    if bias is not None:
        bias = jnp.pad(bias, (0, packed.n_pad - packed.n))
    if cfg.swap_ab:
        out = fp8_gemm_mgpu(packed.data, packed.scale, codes, cols, bias, out_dtype=out_dtype, config=cfg,
                            interpret=interpret)
    else:
        out = fp8_gemm_mgpu(codes, cols, packed.data, packed.scale, bias, out_dtype=out_dtype, config=cfg,
                            interpret=interpret)
    return out[:m, :packed.n]
