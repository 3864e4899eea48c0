"""What the current accelerator can do, as the scheme dispatch needs it."""

from __future__ import annotations

import functools

import jax


@functools.cache
def compute_capability(device: jax.Device | None = None) -> int:
    """CUDA compute capability as an int (90 for sm_90), or 0 for CPU and other platforms."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return 0
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return 0
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


def platform(device: jax.Device | None = None) -> str:
    return (device or jax.devices()[0]).platform


def has_wgmma(capability: int) -> bool:
    """Whether a device of this capability runs the Mosaic GPU wgmma kernels: sm_90 (Hopper) only.

    wgmma is an sm_90a instruction; Blackwell (sm_100, sm_120) has none, so those run the XLA path.
    """
    return capability // 10 == 9
