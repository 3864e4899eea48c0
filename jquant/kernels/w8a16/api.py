"""``w8a16_matmul``: ``x @ W`` for an 8-bit weight (int8 or FP8 e4m3) laid out by ``prepack_w8``,
dispatched by M and device (``jquant.schemes.dispatch.w8a16_impl``).

Implementations (``impl``): ``"mgpu"`` (the Mosaic GPU kernel: the W4A16 kernel's pipeline with 8-bit
tiles, Hopper), ``"pallas"`` (the kernel, nothing else), ``"triton"`` (the 8-bit GEMV,
``jquant.kernels.gemv8``: up to ``MAX_ROWS`` rows, CUDA GPUs of capability 8.0 and up), ``"xla"``
(dequantize to x's dtype, then ``jnp.dot`` with fp32 accumulation), ``"reference"`` (fp32 dequantize and
dot), ``"auto"``. With ``interpret=True`` the kernel runs on any device in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jquant.kernels.gemv8.config import GemvConfig, kernel_for_config, resolve_gemv_impl
from jquant.kernels.w4a16.api import check_matmul_args, resolve_kernel_impl
from jquant.kernels.w4a16.config import MgpuConfig, default_mgpu_config, group_acc_fits
from jquant.kernels.w4a16.layout import gather_pad
from jquant.kernels.w8a16.layout import PackedW8NK, reference_w8
from jquant.qtensor import QTensor
from jquant.schemes import dispatch as device_lib


def resolve_w8_impl(impl: str, m: int, interpret: bool = False, group_size: int | None = None) -> str:
    """The implementation ``w8a16_matmul`` runs for ``impl`` at ``m`` rows on the default device, for a
    weight with groups of ``group_size`` codes along K (None: no group scales).

    Examples:
      >>> import jax
      >>> from jquant.kernels.w8a16 import resolve_w8_impl
      >>> resolve_w8_impl("xla", 1), resolve_w8_impl("auto", 1, interpret=True)
      ('xla', 'mgpu')
      >>> jax.default_backend() != "cpu" or resolve_w8_impl("auto", 1) == "reference"
      True
    """
    if impl == "triton":
        return resolve_gemv_impl(m, interpret, "w8a16")
    return resolve_kernel_impl(impl, interpret, lambda cc: device_lib.w8a16_impl(m, cc, group_size), "w8a16")


def default_w8_config(m: int, packed: PackedW8NK) -> MgpuConfig:
    """The W4A16 kernel's launch for ``m`` rows (``default_mgpu_config``) with the same bytes per
    weight row and step: 8-bit codes take half the codes per step at M ≤ 16 (128 codes, one
    128-byte swizzle row) and 64-code steps from M = 72 with one warpgroup (shared memory);
    weights without group scales take no per-group accumulator. From M = 256 on wide weights (the
    two-warpgroup launch) a CTA takes 256 x rows over 128 weight rows, 4 deep (3 with zero points),
    so each code is decoded once per 256 rows: at 28672 × 8192 on the H100 240 / 194 µs (int8 / FP8)
    at M = 256 against 265 / 210 with 128 rows, 867 / 688 against 952 / 767 at M = 1024
    (bench/results/h100/gemm8_w8_sweep.md).

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w8a16 import default_w8_config, prepack_w8
      >>> packed = prepack_w8(np.ones((1024, 256), np.int8), channel_scale=np.ones(256, np.float32))
      >>> cfg = default_w8_config(1, packed)
      >>> cfg.block_k, cfg.group_acc, cfg.final_output
      (128, False, True)
      >>> wide = prepack_w8(np.ones((256, 28672), np.int8), channel_scale=np.ones(28672, np.float32))
      >>> cfg = default_w8_config(256, wide)
      >>> cfg.block_n, cfg.block_m, cfg.compute_wgs, cfg.max_concurrent_steps
      (128, 256, 2, 4)
    """
    cfg = default_mgpu_config(m, packed)
    if cfg.compute_wgs == 2 and m >= 256:
        # zero points take 3 deep: 4 overflowed sm_90's 227 KB of shared memory by 64 bytes
        return dataclasses.replace(cfg, block_n=128, block_k=64, block_m=256,
                                   max_concurrent_steps=4 if packed.zero is None else 3)
    bk = cfg.block_k
    if cfg.compute_wgs == 1 and cfg.block_m <= 16 and bk > 128:
        bk //= 2
    elif cfg.compute_wgs == 1 and cfg.block_m > 64:
        # 3 stages of 128 × 128 x and weight tiles plus the epilogue's take 242 KB of shared
        # memory with 8-bit codes, past sm_90's 227 KB (Mosaic GPU's lowering, checked on CPU).
        bk = min(bk, 64)
    group_acc = (cfg.block_m <= 16 and not packed.unit_scales
                 and group_acc_fits(packed.group_size, bk, cfg.compute_wgs))
    return dataclasses.replace(cfg, block_k=bk, group_acc=group_acc)


def w8a16_matmul(x, packed: PackedW8NK | QTensor, *, bias=None, impl: str = "auto",
                 config: MgpuConfig | GemvConfig | None = None, interpret: bool = False):
    """``x`` ``[..., K]`` (bf16 / fp16 / fp32) contracted with an 8-bit weight's K axis; fp32
    accumulation, result ``[..., N]`` in ``x``'s dtype. ``packed``: a ``PackedW8NK`` (``x @ W``
    for the ``[K, N]`` codes it was packed from) or an 8-bit ``[N, K]`` QTensor (int8, uint8 with
    zero points, fp8_e4m3 per tensor, channel or 128×128 block: ``x @ W.T``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jquant
      >>> from jquant.kernels.w8a16 import w8a16_matmul
      >>> rng = np.random.default_rng(0)
      >>> w = jquant.quantize(rng.standard_normal((8, 64)).astype(np.float32), "int8")  # per channel
      >>> x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
      >>> y = w8a16_matmul(x, w, impl="xla")
      >>> y.shape, bool(jnp.allclose(y, x @ w.dequantize().T, atol=1e-4))
      ((3, 8), True)
      >>> y = w8a16_matmul(x.astype(jnp.bfloat16), w, interpret=True)  # the kernel, interpreted
      >>> bool(jnp.allclose(y.astype(jnp.float32), x @ w.dequantize().T, atol=0.1))
      True
    """
    if isinstance(packed, QTensor):
        from jquant.kernels.w8a16.from_qtensor import pack_w8_qtensor
        packed = pack_w8_qtensor(packed)
    if not isinstance(packed, PackedW8NK):
        raise TypeError("packed must be a PackedW8NK (prepack_w8) or an 8-bit QTensor, got "
                        f"{type(packed).__name__}")
    x, bias = check_matmul_args(x, packed.k, packed.n, bias, config, (MgpuConfig, GemvConfig))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    group_size = None if packed.unit_scales else packed.group_size
    kind = kernel_for_config(resolve_w8_impl(impl, x2.shape[0], interpret, group_size), impl, config, x2.shape[0],
                             MgpuConfig)
    if kind == "mgpu" and x2.dtype == jnp.float32:
        if impl != "auto" and not interpret:
            raise TypeError(f"impl={impl!r} runs the Mosaic GPU kernel, which takes bf16 or fp16 x; "
                            f"got float32 x of shape {tuple(x2.shape)}")
        kind = device_lib.w4a16_fallback(device_lib.compute_capability())
    if kind == "reference":
        out = reference_w8(x2, packed, bias)
    elif kind == "xla":
        dtype = jnp.float32 if device_lib.is_cpu() else x2.dtype
        out = reference_w8(x2, packed, bias, dtype)
    elif kind == "triton":
        out = gemv_w8(x2, packed, bias, config=config, interpret=interpret)
    else:
        # Imported here: Mosaic GPU's Pallas backend loads only where a kernel runs.
        from jquant.kernels.w4a16.mosaic_gpu import w4a16_mgpu_matmul

        cfg = config or default_w8_config(x2.shape[0], packed)
        out = w4a16_mgpu_matmul(x2, packed, bias, config=cfg, interpret=interpret)
    return out.reshape(*lead, packed.n)


def gemv_w8(x2, packed: PackedW8NK, bias=None, *, config: GemvConfig | None = None,
            interpret: bool = False):
    """``x2 @ W`` (``[M, K]``, M ≤ ``MAX_ROWS``) with the 8-bit GEMV: group scales and zero points per
    group in fp32, channel and global scales and the bias on the fp32 sums."""
    from jquant.kernels.gemv8.triton import gemv8   # Pallas loads only where the kernel runs

    if bias is not None:
        bias = jnp.pad(bias.astype(jnp.float32), (0, packed.n_pad - packed.n))
    grouped = not packed.unit_scales
    out = gemv8(gather_pad(x2, packed, x2.shape[0]), packed.data, group_size=packed.group_size,
                group_scale=packed.scale if grouped else None, zero=packed.zero,
                col_scale=packed.channel_scale, global_scale=packed.global_scale, bias=bias,
                config=config, interpret=interpret)
    return out[:, :packed.n]
