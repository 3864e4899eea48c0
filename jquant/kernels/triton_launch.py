"""Checks the Triton-backend kernels' launch configs share."""

from __future__ import annotations


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    """A ValueError naming ``name`` unless ``value`` is a power of two ≥ ``minimum``."""
    if value < minimum or value & (value - 1):
        floor = f" ≥ {minimum}" if minimum > 1 else ""
        raise ValueError(f"{name} must be a power of two{floor}, got {value}")


def check_num_warps(num_warps: int) -> None:
    """A ValueError unless ``num_warps`` is one of Triton's 1, 2, 4, 8 or 16."""
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be a power of two ≤ 16, got {num_warps}")
