"""FP8 / INT8 codes with a per-tensor or per-(token, head) float32 scale.

Per-tensor calibration follows vLLM's attention layer: k_scale = amax|k| / 200, v_scale = amax|v| / 100
(K_SCALE_CONSTANT / V_SCALE_CONSTANT in vllm/envs.py); an all-zero or non-finite amax gives 1.0.
Per-(token, head), as vLLM's _reshape_cache_per_token_head: scale = max(amax / 448 (fp8) or 127
(int8), 1e-6); int8 codes add +-0.5, clamp to [-128, 127] and truncate (ties away from zero).
Casts saturate (satfinite): +-Inf -> +-max; NaN stays NaN (per-(token, head): the scale becomes NaN).
"""

from __future__ import annotations

import jax.numpy as jnp

from jquant.formats.exact import exact_abs_max, exact_divide
from jquant.kv.dtypes import storage_dtype

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
TOKEN_HEAD_MIN_SCALE = 1e-6   # vLLM's per-(token, head) scale floor, int8 and fp8 alike


def fmt_max(fmt: str) -> float:
    return {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}[fmt]


def calibrate_scale(x, divisor: float):
    amax = exact_abs_max(x.astype(jnp.float32), axis=None)   # a NaN anywhere (XLA's max may drop it)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, amax / divisor, 1.0).astype(jnp.float32)


def calibrate_kv_scales(k, v):
    """(k_scale, v_scale) from amax as vLLM's calc_kv_scales does.

    Examples:
      ``amax(|k|) / 200`` and ``amax(|v|) / 100``:

      >>> import jax.numpy as jnp
      >>> from jquant.kv import calibrate_kv_scales
      >>> k_scale, v_scale = calibrate_kv_scales(jnp.array([[-400.0, 3.0]]), jnp.array([50.0, -2.0]))
      >>> float(k_scale), float(v_scale)
      (2.0, 0.5)
      >>> float(calibrate_kv_scales(jnp.zeros(4), jnp.zeros(4))[0])  # nothing seen yet: 1.0
      1.0
    """
    return calibrate_scale(k, K_SCALE_CONSTANT), calibrate_scale(v, V_SCALE_CONSTANT)


def encode(x, scale, fmt: str):
    """Codes of x / scale in fmt (scale broadcasts against x; the division correctly rounded, so the
    XLA path, the Triton kernel's ``div.rn`` and the CPU write the same codes)."""
    y = exact_divide(x.astype(jnp.float32), scale)
    if fmt == "int8":   # vLLM: +-0.5, clamp, then the int8 store truncates (not ties-to-even)
        y = jnp.where(y >= 0, y + 0.5, y - 0.5)
        return jnp.clip(y, -128.0, 127.0).astype(jnp.int8)
    m = fmt_max(fmt)
    return jnp.clip(y, -m, m).astype(storage_dtype(fmt))


def decode(codes, scale):
    return codes.astype(jnp.float32) * scale


def token_head_scale(x, fmt: str):
    """One float32 scale per leading index: x [..., D] -> [...]."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax / fmt_max(fmt), TOKEN_HEAD_MIN_SCALE)
    # A NaN amax gives the NaN 0x7FC00000 on every backend (and in the insert kernel): XLA's GPU max
    # wrote 0xFFFFFFFF where its CPU max keeps the input's NaN (H100, tests/kernels/kv_insert).
    return jnp.where(jnp.isnan(amax), jnp.float32(jnp.nan), scale)
