"""The expert activations of a MoE layer, shared by the layer (``jquant.models.moe``) and the grouped
W4A16 kernel's epilogue, which applies them to the gate/up product in registers.

``"swiglu"`` = ``silu(gate) · up``; ``"gptoss_swiglu"`` (gpt-oss reference fact 2: transformers'
``GptOssExperts``, alpha 1.702, limit 7.0): gate clamped to ``<= limit``, up to ``[-limit, limit]``,
``(up + 1) · gate · sigmoid(alpha · gate)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "gptoss_swiglu")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def gptoss_swiglu(gate: jax.Array, up: jax.Array, alpha: float = GPT_OSS_ALPHA,
                  limit: float = GPT_OSS_LIMIT) -> jax.Array:
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def activate(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """``name``'s activation of ``gate`` and ``up``, computed in (at least) float32 and rounded once to
    their dtype, as vLLM's ``swigluoai_and_mul`` kernel does (its ``silu_and_mul`` rounds twice): op by
    op in bf16, the rounded ``alpha · gate`` alone moves ``sigmoid`` by several percent for very
    negative gates."""
    fn = activation_fn(name)
    dtype = jnp.result_type(gate, up)
    compute = jnp.promote_types(dtype, jnp.float32)
    return fn(gate.astype(compute), up.astype(compute)).astype(dtype)


def activation_fn(name: str):
    """The float32 function of ``(gate, up)`` that ``name`` stands for (``activate`` without its rounding).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.kernels.moe.activations import activation_fn
      >>> float(activation_fn("gptoss_swiglu")(jnp.float32(9.0), jnp.float32(-9.0)))   # both clamped to 7
      -41.99...
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return swiglu if name == "swiglu" else gptoss_swiglu
