"""FP8 / INT8 codes with a per-tensor or per-(token, head) float32 scale.

Per-tensor calibration follows vLLM's attention layer: k_scale = amax|k| / 200, v_scale = amax|v| / 100
(K_SCALE_CONSTANT / V_SCALE_CONSTANT in vllm/envs.py); an all-zero or non-finite amax gives 1.0.
Per-(token, head) fp8: scale = max(amax / 448, 1 / (448 * 512)); int8: amax / 127 (1.0 for zeros).
Casts saturate (satfinite): +-Inf -> +-max; NaN stays NaN (int8: the scale becomes NaN).
"""

from __future__ import annotations

import jax.numpy as jnp

from jquant.kv.dtypes import storage_dtype

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def fmt_max(fmt: str) -> float:
    return {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}[fmt]


def calibrate_scale(x, divisor: float):
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
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
    """Codes of x / scale in fmt (scale broadcasts against x)."""
    y = x.astype(jnp.float32) / scale
    m = fmt_max(fmt)
    y = jnp.clip(y, -m, m)
    if fmt == "int8":
        return jnp.round(y).astype(jnp.int8)
    return y.astype(storage_dtype(fmt))


def decode(codes, scale):
    return codes.astype(jnp.float32) * scale


def token_head_scale(x, fmt: str):
    """One float32 scale per leading index: x [..., D] -> [...]."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    if fmt == "int8":
        return jnp.where(amax > 0, amax / 127.0, jnp.where(jnp.isnan(amax), amax, 1.0))
    return jnp.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
