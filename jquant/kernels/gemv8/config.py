"""The launch of the 8-bit GEMV (``GemvConfig``) and the default one for a weight (``default_gemv_config``).
Plain Python: choosing a launch needs no GPU."""

from __future__ import annotations

import dataclasses

from jquant.schemes import dispatch as device_lib

# Rows of x the GEMV takes: each row keeps its own [block_n, block_k] fp32 partial sums in registers.
MAX_ROWS = 4


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch of the Triton-backend 8-bit GEMV.

    block_n: weight rows per program (a power of 2).
    block_k: codes per row and loop step (a power of 2 ≥ 16; the launch takes the largest power of 2
      up to it that divides K_pad and the scale groups, ``step_k``).
    num_warps, num_stages: Triton's.

    Examples:
      >>> from jquant.kernels.gemv8 import GemvConfig
      >>> GemvConfig(block_n=8, block_k=1024).block_k
      1024
      >>> GemvConfig(block_n=12)
      Traceback (most recent call last):
          ...
      ValueError: GemvConfig.block_n must be a power of 2, got 12
    """

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemvConfig.{f.name} must be a positive int, got {v!r}")
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of 2, got {v}")
        if self.block_k < 16:
            raise ValueError(f"GemvConfig.block_k must be at least 16, got {self.block_k}")


def step_k(config: GemvConfig, k_pad: int, group_size: int) -> int:
    """K per loop step: the largest power of 2 up to ``config.block_k`` dividing ``k_pad`` and the
    scale groups (``group_size`` rows; K_pad for per-channel scales), so a step meets one group.

    Examples:
      >>> from jquant.kernels.gemv8.config import GemvConfig, step_k
      >>> step_k(GemvConfig(block_k=512), 8192, 8192), step_k(GemvConfig(block_k=512), 576, 576)
      (512, 64)
      >>> step_k(GemvConfig(block_k=512), 8192, 128), step_k(GemvConfig(block_k=512), 4096, 32)
      (128, 32)
    """
    bk = config.block_k
    while bk > 16 and (k_pad % bk or group_size % bk):
        bk //= 2
    if k_pad % bk or group_size % bk:
        raise ValueError(f"the GEMV needs K_pad ({k_pad}) and the group size ({group_size}) to be "
                         "multiples of 16")
    return bk


def default_gemv_config() -> GemvConfig:
    """The launch for every weight: 4 rows a program, 1024 codes a step, 4 warps. On the
    H100 at M = 1 (bench/results/h100/gemm8_gemv_sweep.md) it was the fastest or within 1 µs of it on
    int8 at 28672×8192 (93.8 µs; 16 rows a program 108.6), 8192² (33.3; 8 rows × 512 codes 41.3) and
    6144×4096 (20.6); more rows or warps a program never won by more than the timing spread.

    Examples:
      >>> from jquant.kernels.gemv8 import default_gemv_config
      >>> default_gemv_config()
      GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=1)
    """
    return GemvConfig(block_n=4, block_k=1024)


def resolve_gemv_impl(m: int, interpret: bool, kernel: str) -> str:
    """What ``impl="triton"`` runs for ``kernel`` (the op asking) at ``m`` rows: the GEMV in interpret
    mode or where Triton-backend kernels run, else the op's XLA path with a warning once (the fp32
    reference on CPU); more than ``MAX_ROWS`` rows are refused.

    Examples:
      >>> from jquant.kernels.gemv8.config import resolve_gemv_impl
      >>> resolve_gemv_impl(1, True, "w8a16")
      'triton'
      >>> resolve_gemv_impl(8, True, "w8a16")
      Traceback (most recent call last):
          ...
      ValueError: impl='triton' (w8a16) takes 1 to 4 rows of x, got 8
    """
    from jquant.kernels.w4a16.api import warn_once

    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"impl='triton' ({kernel}) takes 1 to {MAX_ROWS} rows of x, got {m}")
    if interpret or device_lib.runs_triton_pallas():
        return "triton"
    cc = device_lib.compute_capability()
    where = device_lib.platform() if cc == 0 else f"compute capability {cc}"
    warn_once(f"{kernel}:triton:{cc}", f"impl='triton' ({kernel}) cannot run on {where}; using the XLA path")
    return device_lib.w4a16_fallback(cc)


def kernel_for_config(kind: str, impl: str, config, m: int, kernel_config: type) -> str:
    """The kernel an op runs where the dispatch chose ``kind`` for ``impl`` at ``m`` rows and the caller
    gave ``config``: with ``impl="auto"`` the kernel the launch's type names (a ``GemvConfig`` the GEMV,
    up to ``MAX_ROWS`` rows; a ``kernel_config`` the op's Mosaic GPU kernel), else ``kind``, refusing a
    launch of the other kernel.

    Examples:
      >>> from jquant.kernels.gemv8.config import GemvConfig, kernel_for_config
      >>> kernel_for_config("mgpu", "auto", GemvConfig(), 1, object), kernel_for_config("xla", "xla", None, 1, object)
      ('triton', 'xla')
    """
    if config is None or kind not in ("mgpu", "triton"):
        return kind
    wanted = "triton" if isinstance(config, GemvConfig) else "mgpu"
    if impl == "auto" and (wanted == "mgpu" or m <= MAX_ROWS):
        return wanted
    if wanted != kind:
        takes = "GemvConfig" if kind == "triton" else kernel_config.__name__
        raise TypeError(f"impl={impl!r} at M = {m} runs {kind!r}, whose launch is a {takes}, not a "
                        f"{type(config).__name__}")
    return kind
