"""Sums of row-parallel partial outputs across the tensor-parallel devices, in the activations' dtype or FP8.

A row-parallel projection (o_proj, down_proj) leaves each device a partial ``[..., hidden]`` whose sum
over devices is the output. Three ways to form that sum (``Collectives.mode``):

- ``"psum"``: an all-reduce in the activations' dtype (bf16 in a bf16 model), what XLA would insert.
- ``"fp8"``: every device quantizes its partial to float8_e4m3fn with one float32 scale per row (the
  scale of vLLM's dynamic per-token quantizer), the codes and the scale bytes travel in one uint8
  buffer through one all-gather, and every device dequantizes the ``tp`` partials and sums them in float32.
  One rounding per partial, float32 accumulation, never a sum of codes: partials of different devices
  have different scales, so adding their codes (an FP8 reduce in the network) would be meaningless, and
  an accumulation in FP8 would lose precision at every hop. Each device sums the same gathered bytes in the same
  order, so the result is bit-identical on every device, as the residual stream must be.
- ``"fp8_rs"``: a reduce-scatter built from an all-to-all of FP8 chunks (one scale per row and chunk),
  a float32 sum of the ``tp`` chunks a device owns, and an FP8 all-gather of the sums. Two roundings
  instead of one, but each device receives 2 (tp - 1) / tp FP8 rows per row instead of tp - 1 (a bf16
  ring all-reduce: 2 (tp - 1) / tp bf16 rows), which matters for wide tensor parallelism at large batch.

``local=True`` replaces every exchange by a stand-in that moves nothing (the device's own data in the
shape the exchange would return): the same step without its communication, to time the collectives
by difference. Its numbers are wrong by design.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jquant.formats.exact import exact_abs_max

COLLECTIVES = ("psum", "fp8", "fp8_rs")
FP8_MAX = 448.0                     # float8_e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512)   # vLLM's floor of a dynamic scale: an all-zero row divides by this

_SCALE_BYTES = 4  # one float32 scale per row, bit-cast to 4 uint8 after the codes


def fp8_pack(x: jax.Array) -> jax.Array:
    """``x [..., D]`` as one uint8 buffer ``[..., D + 4]``: float8_e4m3fn codes of each row, then the
    row's float32 scale (``max(amax / 448, 1 / (448·512))``, vLLM's dynamic per-token scale) bit-cast to
    4 bytes, so codes and scale cross the network in one collective.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.parallel import fp8_pack, fp8_unpack
      >>> x = jnp.array([[448.0, -1.0, 0.3], [0.0, 0.0, 0.0]])
      >>> buffer = fp8_pack(x)
      >>> buffer.shape, str(buffer.dtype)   # 3 codes and 4 scale bytes a row
      ((2, 7), 'uint8')
      >>> fp8_unpack(buffer).tolist()       # 0.3 lies between e4m3's 0.28125 and 0.3125
      [[448.0, -1.0, 0.3125], [0.0, 0.0, 0.0]]
    """
    # Plain arithmetic that XLA fuses into the reduction and one elementwise pass: formats.fp8's per-token
    # quantizer divides behind an optimization barrier to match vLLM's kernel bit for bit, which buys
    # nothing here (both ends are ours) and would cost a kernel launch per exchange.
    x32 = x.astype(jnp.float32)
    # From the bits: XLA's CPU max drops NaN from rows of ~4096 and more.
    amax = exact_abs_max(x32, axis=-1)[..., None]
    scale = jnp.maximum(amax / FP8_MAX, MIN_SCALE)  # NaN stays NaN: a poisoned row stays poisoned
    codes = jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint8),
                            jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8)], axis=-1)


def fp8_unpack(buffer: jax.Array) -> jax.Array:
    """The float32 values ``code · scale`` of an ``fp8_pack`` buffer ``[..., D + 4]``: ``[..., D]``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jquant.parallel import fp8_pack, fp8_unpack
      >>> fp8_unpack(fp8_pack(jnp.array([[448.0, -0.5, 1.1]]))).tolist()  # scale 1; e4m3's nearest to 1.1
      [[448.0, -0.5, 1.125]]
    """
    codes = jax.lax.bitcast_convert_type(buffer[..., :-_SCALE_BYTES], jnp.float8_e4m3fn)
    scale = jax.lax.bitcast_convert_type(buffer[..., -_SCALE_BYTES:], jnp.float32)
    return codes.astype(jnp.float32) * scale[..., None]


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The exchanges of a tensor-parallel step over mesh axis ``axis`` of ``size`` devices (call its
    methods inside ``jax.shard_map``): ``all_reduce`` of row-parallel partials in ``mode`` (see the module
    docstring), ``gather`` along a dimension (vocab-parallel logits), ``sum_exact`` in the input's dtype
    (the vocab-parallel embedding lookup, where one device holds each row). ``local``: every exchange
    replaced by a stand-in that moves nothing, to time the step without its communication.

    Examples:
      Four devices each hold a partial of the same rows; the FP8 all-reduce is close to the exact sum
      and the same on every device:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jquant.parallel import Collectives
      >>> tp = min(4, jax.device_count())
      >>> mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
      >>> partials = jax.random.normal(jax.random.key(0), (tp, 3, 64))  # [device, rows, hidden]
      >>> def summed(mode):
      ...     comm = Collectives(mode, size=tp)
      ...     f = jax.shard_map(lambda p: comm.all_reduce(p[0])[None], mesh=mesh, in_specs=P("tp"),
      ...                       out_specs=P("tp"))
      ...     return f(partials)                                   # [device, rows, hidden]
      >>> exact = partials.sum(0)
      >>> fp8 = summed("fp8")
      >>> bool(jnp.all(fp8 == fp8[0])), bool(jnp.allclose(summed("psum")[0], exact, atol=1e-5))
      (True, True)
      >>> bool(jnp.linalg.norm(fp8[0] - exact) / jnp.linalg.norm(exact) < 0.05)
      True
    """

    mode: str = "psum"
    axis: str = "tp"
    size: int = 1
    local: bool = False

    def __post_init__(self):
        if self.mode not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {self.mode!r}")
        if self.size < 1:
            raise ValueError(f"size must be at least 1, got {self.size}")

    # ---- the exchanges (or their local stand-ins) ----------------------------------------------------
    def _psum(self, x):
        return x if self.local else jax.lax.psum(x, self.axis)

    def _all_gather(self, x):
        """``[size, ...]``: every device's ``x`` (the stand-in: this device's, ``size`` times)."""
        if self.local:
            return jnp.broadcast_to(x[None], (self.size, *x.shape))
        return jax.lax.all_gather(x, self.axis)

    def _all_to_all(self, x):
        """``x [size, ...]``: chunk j goes to device j; returns ``[size, ...]``, chunk i from device i."""
        if self.local:
            return x
        return jax.lax.all_to_all(x, self.axis, split_axis=0, concat_axis=0)

    # ---- what the model calls ------------------------------------------------------------------------
    def all_reduce(self, x: jax.Array) -> jax.Array:
        """The sum over devices of the partials ``x [..., D]``, in x's dtype."""
        if self.size == 1:  # nothing to exchange, no precision to lose
            return x
        if self.mode == "psum":
            return self._psum(x)
        if self.mode == "fp8":
            return fp8_unpack(self._all_gather(fp8_pack(x))).sum(axis=0).astype(x.dtype)
        return self._reduce_scatter_all_gather(x)

    def _reduce_scatter_all_gather(self, x):
        d = x.shape[-1]
        if d % self.size:
            raise ValueError(f"fp8_rs splits the last axis ({d}) into {self.size} chunks; it must divide")
        chunks = jnp.moveaxis(x.reshape(*x.shape[:-1], self.size, d // self.size), -2, 0)  # [size, ..., d/size]
        mine = fp8_unpack(self._all_to_all(fp8_pack(chunks))).sum(axis=0)               # my chunk, summed
        gathered = fp8_unpack(self._all_gather(fp8_pack(mine)))                          # [size, ..., d/size]
        return jnp.moveaxis(gathered, 0, -2).reshape(x.shape).astype(x.dtype)

    def gather(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """Every device's ``x`` concatenated along ``axis`` in device order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        axis = axis % x.ndim
        if self.local:
            return jnp.concatenate([x] * self.size, axis=axis)
        return jax.lax.all_gather(x, self.axis, axis=axis, tiled=True)

    def sum_exact(self, x: jax.Array) -> jax.Array:
        """The psum of ``x`` in its own dtype, whatever ``mode`` (exact where one device holds each value)."""
        return x if self.size == 1 else self._psum(x)
