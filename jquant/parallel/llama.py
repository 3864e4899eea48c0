"""A Llama decoded tensor-parallel: Megatron's split of every layer, run per device under ``jax.shard_map``.

Each of ``tp`` devices holds 1/tp of the query and KV heads (q/k/v column parallel), of the MLP's
intermediate features (gate/up column parallel) and the matching input slices of o/down (row
parallel), and the pages of its KV heads in the paged cache. The whole step runs as one ``shard_map``
body: the model's own linen code on a config of the local sizes (heads / tp, intermediate / tp), so
RoPE, the KV insert kernel and the paged decode-attention kernel run per device on its heads as they
run on one device. Interceptors add the exchanges the local code does not know about:

- o_proj / down_proj: their partial outputs are summed over devices (``Collectives.all_reduce``: a
  psum in the activations' dtype, or FP8, see ``jquant.parallel.collectives``);
- the embedding (vocab parallel, the default): each device looks up the ids in its rows of the table,
  zeros elsewhere, and a psum assembles the rows; the tied lm_head (or a separate one, column
  parallel) gives each device its slice of the vocabulary, all-gathered into the logits.

Everything else (norms, residuals) is replicated and computed identically on every device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jquant.flax.linen import _dense_interceptor
from jquant.models import llama
from jquant.models.llama import LlamaForCausalLM
from jquant.parallel.collectives import COLLECTIVES, Collectives
from jquant.parallel.placement import cache_specs, local_params, param_specs

ROW_PARALLEL = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How ``model`` runs over the one axis ``axis`` of ``mesh``: the checks that its sizes split, the
    per-device model, and the step (``apply``). ``collectives``: how row-parallel outputs are summed
    (``"psum"``, ``"fp8"``, ``"fp8_rs"``: ``jquant.parallel.collectives``). ``vocab_parallel``: split the
    embedding and lm_head along the vocabulary (else every device holds them whole).
    ``local_collectives``: replace every exchange by a stand-in that moves nothing (timing only: the
    numbers are wrong). ``tensor_parallel(model, tp)`` builds one over the first ``tp`` devices.

    Examples:
      >>> import jax
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> from jquant.parallel import tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
      ...                      num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> plan = tensor_parallel(LlamaForCausalLM(config), 1)
      >>> c = plan.local_model.config  # what one device computes
      >>> c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size
      (4, 2, 96, 64)
      >>> tensor_parallel(LlamaForCausalLM(config), 4)
      Traceback (most recent call last):
          ...
      ValueError: tensor parallelism 4 needs num_kv_heads (2) divisible by 4
    """

    model: LlamaForCausalLM
    mesh: Mesh
    collectives: str = "psum"
    axis: str = "tp"
    vocab_parallel: bool = True
    local_collectives: bool = False

    def __post_init__(self):
        if self.mesh.axis_names != (self.axis,):
            raise ValueError(f"the mesh must have the one axis {self.axis!r}, got {self.mesh.axis_names}")
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        if not issubclass(self.model.dense_cls, nn.Dense):
            raise ValueError(f"the model's projections must be nn.Dense (their outputs are summed across "
                             f"devices by name), got {self.model.dense_cls}")
        c, tp = self.model.config, self.tp
        sizes = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                 "intermediate_size": c.intermediate_size}
        if self.vocab_parallel:
            sizes["vocab_size"] = c.vocab_size
        if self.collectives == "fp8_rs":
            sizes["hidden_size"] = c.hidden_size
        for name, size in sizes.items():
            if size % tp:
                raise ValueError(f"tensor parallelism {tp} needs {name} ({size}) divisible by {tp}"
                                 + (" (or vocab_parallel=False)" if name == "vocab_size" else ""))

    @property
    def tp(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def local_model(self) -> LlamaForCausalLM:
        """The model one device runs: its heads, intermediate features and vocabulary slice."""
        c, tp = self.model.config, self.tp
        local = dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=c.num_kv_heads // tp,
                                    intermediate_size=c.intermediate_size // tp,
                                    vocab_size=c.vocab_size // tp if self.vocab_parallel else c.vocab_size)
        return self.model.clone(config=local)

    @property
    def comm(self) -> Collectives:
        return Collectives(self.collectives, self.axis, self.tp, self.local_collectives)

    def apply(self, variables: Any, token_ids: jax.Array, cache: Any = None):
        """``model.apply(variables, token_ids, cache)`` run on the mesh: ``variables`` from
        ``shard_params``, ``cache`` a ``PagedCache`` / ``KVCache`` of the whole model (split on its KV
        heads; ``shard_cache`` places it so) or None. Returns ``(logits, cache)`` as ``model.apply`` does,
        logits replicated. Jit it (``decode_step`` does, donating the cache)."""
        comm, body_model, vocab_parallel = self.comm, self.local_model, self.vocab_parallel

        def body(variables, token_ids, *cache):
            with nn.intercept_methods(functools.partial(_intercept, comm, vocab_parallel)):
                logits, new = body_model.apply(local_params(variables), token_ids, *cache)
            return (logits, new) if cache else logits

        specs = (param_specs(variables, self.axis), P())
        cspec = () if cache is None else (cache_specs(cache, self.axis),)
        # check_vma off: the all-gathers' results are the same on every device by construction (each
        # device reduces the same gathered values in the same order), which the checker cannot see.
        run = jax.shard_map(body, mesh=self.mesh, in_specs=specs + cspec,
                            out_specs=(P(), cspec[0]) if cache is not None else P(), check_vma=False)
        out = run(variables, token_ids, *(() if cache is None else (cache,)))
        return out if cache is not None else (out, None)


def _intercept(comm: Collectives, vocab_parallel: bool, next_fun, args, kwargs, context):
    """Runs quantized kernels as ``intercept_quantized`` does, and adds the exchanges (module docstring)."""
    module, method = context.module, context.method_name
    if vocab_parallel and isinstance(module, nn.Embed):
        if method == "__call__":
            (ids,) = args
            rows = module.num_embeddings  # this device's slice of the vocabulary
            local = ids - jax.lax.axis_index(comm.axis) * rows
            mine = (local >= 0) & (local < rows)
            x = next_fun(jnp.where(mine, local, 0), **kwargs)
            return comm.sum_exact(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)))
        if method == "attend":
            return comm.gather(next_fun(*args, **kwargs), -1)
    out = _dense_interceptor(next_fun, args, kwargs, context)
    if isinstance(module, nn.Dense) and method == "__call__":
        if module.name in ROW_PARALLEL:
            return comm.all_reduce(out)
        if module.name == "lm_head" and vocab_parallel:
            return comm.gather(out, -1)
    return out


def tensor_parallel(model: LlamaForCausalLM, tp: int, *, devices=None, **options) -> TensorParallel:
    """A ``TensorParallel`` of ``model`` over the first ``tp`` of ``devices`` (default ``jax.devices()``),
    on a mesh of the one axis ``"tp"``; ``options``: the other fields of ``TensorParallel``.

    Examples:
      >>> import jax
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> from jquant.parallel import tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
      ...                      num_kv_heads=8, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> plan = tensor_parallel(LlamaForCausalLM(config), 1, collectives="fp8")
      >>> plan.tp, plan.collectives, plan.mesh.axis_names
      (1, 'fp8', ('tp',))
      >>> tensor_parallel(LlamaForCausalLM(config), 2 * jax.device_count())
      Traceback (most recent call last):
          ...
      ValueError: tensor parallelism ... needs ... devices; there are ...
    """
    return TensorParallel(model, tp_mesh(tp, devices), **options)


def tp_mesh(tp: int, devices=None) -> Mesh:
    """A mesh of the one axis ``"tp"`` over the first ``tp`` of ``devices`` (default ``jax.devices()``)."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tensor parallelism {tp} needs {tp} devices; there are {len(devices)} "
                         f"({devices[0].platform})")
    return Mesh(np.array(devices[:tp]), ("tp",))


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("cache",))
def decode_step(plan: TensorParallel, variables: Any, token_ids: jax.Array, cache: Any):
    """``plan.apply(variables, token_ids, cache)`` as one jitted step, the cache donated (its pages are
    updated in place on each device; do not reuse the ``cache`` passed in).

    Examples:
      One decode step over two devices gives the logits of the single-device step:

      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> from jquant.models.llama import new_cache
      >>> from jquant.parallel import decode_step, shard_cache, shard_params, tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      ...                      num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> model = LlamaForCausalLM(config)
      >>> ids = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
      >>> params = model.init(jax.random.key(0), ids)
      >>> plan = tensor_parallel(model, min(2, jax.device_count()))
      >>> cache = shard_cache(plan, new_cache(model, 1, 16, "int8_per_token_head"))
      >>> tp_params = shard_params(plan, params)
      >>> _, cache = decode_step(plan, tp_params, ids[:, :4], cache)     # prefill
      >>> logits, cache = decode_step(plan, tp_params, ids[:, 4:], cache)
      >>> want, _ = model.apply(params, ids[:, 4:], model.apply(params, ids[:, :4],
      ...                                                       new_cache(model, 1, 16, "int8_per_token_head"))[1])
      >>> bool(jnp.allclose(logits, want, atol=1e-4)), int(cache.lengths[0])
      (True, 5)
    """
    return plan.apply(variables, token_ids, cache)


def generate(plan: TensorParallel, variables: Any, prompt_ids, max_new_tokens: int, **options) -> jax.Array:
    """``jquant.models.generate`` of ``plan.model`` with every step run tensor-parallel (``variables``
    from ``shard_params``; ``options``: ``greedy``, ``rng``, ``temperature``, ``eos_id``,
    ``kv_cache_dtype``, ``page_size``). The cache is made inside the jitted loop and split on its KV heads.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM, generate as generate_one
      >>> from jquant.parallel import generate, shard_params, tensor_parallel
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
      ...                      num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> model = LlamaForCausalLM(config)
      >>> prompt = jnp.array([[3, 1, 4, 1]], jnp.int32)
      >>> params = model.init(jax.random.key(0), prompt)
      >>> plan = tensor_parallel(model, min(2, jax.device_count()))
      >>> tokens = generate(plan, shard_params(plan, params), prompt, 4, kv_cache_dtype="bf16")
      >>> tokens.tolist() == generate_one(model, params, prompt, 4, kv_cache_dtype="bf16").tolist()
      True
    """
    return llama.generate(plan.model, variables, prompt_ids, max_new_tokens, forward=plan.apply, **options)
