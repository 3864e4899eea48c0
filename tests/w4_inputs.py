"""Random inputs of the W4A16 kernel layout (``prepack_nk``) for the kernel tests."""

import ml_dtypes
import numpy as np

_SCALE_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def random_w4_weight(rng: np.random.Generator, k: int, n: int, group: int, *, zeros: str | None = None,
                     scale_dtype="f32"):
    """Random ``prepack_nk`` inputs: codes ``[K, N]``, per-group scales and optional zero points.

    ``scale_dtype``: "f32" / "f16" / "bf16" (or a numpy dtype), "e8m0" or "e4m3" (scaled into e4m3's
    normal range); ``zeros``: None, "int" (uint8 codes) or "float" (fractional fp32 zero points).
    """
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    groups = 1 if group == -1 else -(-k // group)
    s = (rng.random((groups, n)) * 0.02 + 0.005).astype(np.float32)
    if scale_dtype == "e8m0":
        s = s.astype(ml_dtypes.float8_e8m0fnu)
    elif scale_dtype == "e4m3":
        s = (s * 50).astype(ml_dtypes.float8_e4m3fn)
    else:
        s = s.astype(_SCALE_DTYPES.get(scale_dtype, scale_dtype))
    z = None
    if zeros == "int":
        z = rng.integers(0, 16, (groups, n)).astype(np.uint8)
    elif zeros == "float":
        z = (rng.random((groups, n)) * 15).astype(np.float32)
    return q, s, z
