"""GPTQ (Frantar et al., 2022) as pure, jittable float32 functions: streaming Hessian accumulation and
column-by-column quantization with error feedback through the upper Cholesky factor of ``H⁻¹``.

The loop follows the reference implementations (GPTQ, AutoGPTQ, gptqmodel) step for step, quirks
included, so codes agree with theirs wherever float32 rounding does:

* group scales/zeros come from the weights as they stand when the group's first column is reached,
  but only with the updates of earlier blocks: updates made inside the current block (lazy batch)
  are not yet written back, so a group starting mid-block sees the block-start weights;
* per-channel scales come from the original weights, before dead columns are zeroed;
* the quantizer's range always holds 0; a symmetric group with no negative value keeps ``min = 0``
  (the reference's ``xmin[xmin < 0] = -xmax`` leaves it), so its scale is ``max / maxq``;
  an all-zero group gets the range ``[-1, 1]``.

One deliberate difference: scales are rounded to ``scale_dtype`` (float16 for GPTQ checkpoints)
*before* they quantize, so the loop's error feedback sees the weight the checkpoint will hold and
the exported QTensor dequantizes to exactly ``GPTQResult.weight`` (the reference quantizes with
float32 scales and re-rounds codes against float16 ones when packing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jquant.formats.exact import exact_divide
from jquant.formats.mx import e2m1_codes, e2m1_values

_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class GPTQResult:
    """What ``gptq_quantize`` returns (a pytree).

    Attributes:
      weight: ``[N, K]`` float32, the quantized-dequantized weight in the original column order.
      scale: ``[N, G]`` float32 group scales (values of ``scale_dtype``); ``G = 1`` per channel.
      zero: ``[N, G]`` float32 integer zero points (asymmetric), None (symmetric: ``2**(b-1)``).
      g_idx: ``[K]`` int32 group of each original column (act-order permutes it).
      loss: ``[K]`` float32 per-column loss ``Σ_rows (w - q)² / (2·d²)``, original column order.
    """

    weight: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    g_idx: jax.Array
    loss: jax.Array


jax.tree_util.register_dataclass(GPTQResult, data_fields=["weight", "scale", "zero", "g_idx", "loss"],
                                 meta_fields=[])


@jax.jit
def hessian_update(h: jax.Array, n: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One calibration batch into the running ``H = 2/n · Σ xᵀx``.

    Args:
      h: ``[K, K]`` float32, the Hessian over the ``n`` rows seen so far (zeros to start).
      n: int32 scalar, the rows seen so far.
      x: ``[..., K]`` activations; every leading index is one row (token).

    Returns:
      ``(h, n)`` after the batch. Rescaling the running sum (rather than dividing at the end) keeps
      its magnitude that of one row, as the reference does.
    """
    k = h.shape[0]
    n = jnp.asarray(n, jnp.int32)
    x = jnp.asarray(x, jnp.float32).reshape(-1, k)
    if x.shape[0] == 0:
        return h, n
    total = n + x.shape[0]
    h = h * (n.astype(jnp.float32) / total.astype(jnp.float32))
    x = x * jnp.sqrt(2.0 / total.astype(jnp.float32))
    return h + jnp.matmul(x.T, x, precision=_HIGHEST), total


def _max_code(bits) -> jax.Array:
    return (jnp.left_shift(1, jnp.asarray(bits, jnp.int32)) - 1).astype(jnp.float32)


def group_params(w: jax.Array, *, bits, symmetric, scale_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """GPTQ's min/max quantizer over the last axis of ``w``: ``(scale, zero)`` float32.

    ``bits`` and ``symmetric`` may be traced. Scales are rounded to ``scale_dtype``; zero points are
    computed from the rounded scale (``2**(b-1)`` when symmetric).
    """
    maxq = _max_code(bits)
    lo = jnp.minimum(w.min(axis=-1), 0.0)
    hi = jnp.maximum(w.max(axis=-1), 0.0)
    amax = jnp.maximum(-lo, hi)
    lo = jnp.where(symmetric & (lo < 0), -amax, lo)
    hi = jnp.where(symmetric, amax, hi)
    empty = (lo == 0) & (hi == 0)
    lo = jnp.where(empty, -1.0, lo)
    hi = jnp.where(empty, 1.0, hi)
    scale = exact_divide(hi - lo, maxq).astype(scale_dtype).astype(jnp.float32)
    # A float16-rounded scale can push -lo/scale a hair past maxq; a zero scale (float16 underflow)
    # quantizes everything to the zero point, so any zero point will do.
    zero = jnp.clip(jnp.round(exact_divide(-lo, jnp.where(scale == 0, 1.0, scale))), 0, maxq)
    zero = jnp.where(scale == 0, 0.0, zero)
    return scale, jnp.where(symmetric, (maxq + 1) / 2, zero)


def fake_quantize(w: jax.Array, scale: jax.Array, zero: jax.Array, bits) -> jax.Array:
    """``scale · (clamp(round(w / scale) + zero, 0, 2**b-1) - zero)``; 0 where the scale is 0.

    The same codes ``quantize_int_with_params`` computes from these scales and zero points.
    """
    safe = jnp.where(scale == 0, 1.0, scale)
    r = jnp.where(scale == 0, 0.0, jnp.round(exact_divide(w, safe)))
    q = jnp.clip(r + zero, 0, _max_code(bits))
    return scale * (q - zero)


def inverse_cholesky_upper(h: jax.Array) -> jax.Array:
    """Upper ``U`` with ``UᵀU = H⁻¹`` (``H`` symmetric positive definite)."""
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(h.shape[0], dtype=h.dtype))
    return jnp.linalg.cholesky(h_inv).T


def gptq_quantize(w: jax.Array, h: jax.Array, *, bits: int, group_size: int | None = None,
                  symmetric: bool = True, damp_percent: float = 0.01, block_size: int = 128,
                  act_order: bool = False, static_groups: bool = False, scale_dtype=jnp.float32) -> GPTQResult:
    """Quantizes ``w [N, K]`` against the Hessian ``h [K, K]`` of its inputs with GPTQ.

    Args:
      w: ``[N, K]`` weight (out_features, in_features); computed in float32.
      h: ``[K, K]`` Hessian (``hessian_update``); zero diagonal entries mark dead inputs, whose
        columns quantize to exact 0.
      bits: code width, 2..8.
      group_size: values per scale along K (must divide K); None: one scale per output channel.
      symmetric: GPTQ's ``sym``: zero point ``2**(b-1)`` and scale ``2·amax / (2**b-1)``.
      damp_percent: ``damp_percent · mean(diag H)`` is added to the diagonal before inverting.
      block_size: columns per lazy batch update (clipped to K; K need not be a multiple).
      act_order: quantize columns by descending ``diag(H)``; ``g_idx`` maps them back.
      static_groups: compute every group's scale/zero from the (dead-zeroed) weights up front,
        in original column order, so act-order keeps ``g_idx = i // group_size``.
      scale_dtype: dtype the scales are rounded to before use (see the module docstring).
    """
    if w.ndim != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"w must be [N, K] and h [K, K]; got w {tuple(w.shape)}, h {tuple(h.shape)}")
    k = w.shape[1]
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in [2, 8], got {bits!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size <= 0 or k % group_size):
        raise ValueError(f"group_size must be None or a positive int dividing K={k}, got {group_size!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not 0 <= damp_percent:
        raise ValueError(f"damp_percent must be >= 0, got {damp_percent!r}")
    # Flags and numbers are traced, so one compilation serves every variant of a shape and grouping.
    flags = (jnp.int32(bits), jnp.bool_(symmetric), jnp.float32(damp_percent), jnp.bool_(act_order),
             jnp.bool_(static_groups))
    result = _gptq(jnp.asarray(w, jnp.float32), jnp.asarray(h, jnp.float32), *flags, group_size=group_size,
                   block_size=min(block_size, k), scale_dtype=jnp.dtype(scale_dtype))
    return result if not symmetric else dataclasses.replace(result, zero=None)


def e2m1_fake_quantize(w: jax.Array, scale: jax.Array) -> jax.Array:
    """``scale · E2M1(w / scale)`` (round half to even, saturating at ±6); 0 where the scale is 0."""
    safe = jnp.where(scale == 0, 1.0, scale)
    q = e2m1_values(e2m1_codes(exact_divide(w, safe)) & 7) * jnp.sign(w)
    return jnp.where(scale == 0, 0.0, q * scale)


def gptq_quantize_e2m1(w: jax.Array, h: jax.Array, scales: jax.Array, *, damp_percent: float = 0.01,
                       block_size: int = 128, act_order: bool = False) -> GPTQResult:
    """GPTQ onto the E2M1 (FP4) grid with fixed per-block multipliers (MXFP4, NVFP4).

    Args:
      w: ``[N, K]`` weight.
      h: ``[K, K]`` Hessian.
      scales: ``[N, K / block]`` float32 multiplier of each block of ``block`` values along K, as the
        format's round-to-nearest chose them from ``w`` (its E8M0 or FP8 × global scales): the
        blocks are GPTQ's static groups, so the codes GPTQ picks re-encode under the format's scales.
      damp_percent, block_size, act_order: as ``gptq_quantize``.
    """
    if w.ndim != 2 or h.shape != (w.shape[1], w.shape[1]) or scales.ndim != 2 or scales.shape[0] != w.shape[0] \
            or scales.shape[1] == 0 or w.shape[1] % scales.shape[1]:
        raise ValueError(f"w must be [N, K], h [K, K] and scales [N, K / block]; got w {tuple(w.shape)}, "
                         f"h {tuple(h.shape)}, scales {tuple(scales.shape)}")
    k = w.shape[1]
    flags = (jnp.int32(4), jnp.bool_(True), jnp.float32(damp_percent), jnp.bool_(act_order), jnp.bool_(True))
    result = _gptq(jnp.asarray(w, jnp.float32), jnp.asarray(h, jnp.float32), *flags,
                   jnp.asarray(scales, jnp.float32), group_size=k // scales.shape[1],
                   block_size=min(block_size, k), scale_dtype=jnp.dtype(jnp.float32))
    return dataclasses.replace(result, zero=None)


@functools.partial(jax.jit, static_argnames=("group_size", "block_size", "scale_dtype"))
def _gptq(w, h, bits, symmetric, damp_percent, act_order, static_groups, fixed_scales=None, *, group_size,
          block_size, scale_dtype):
    n, k = w.shape
    gs = k if group_size is None else group_size
    groups = k // gs
    params = functools.partial(group_params, bits=bits, symmetric=symmetric, scale_dtype=scale_dtype)
    static_groups = static_groups & (group_size is not None)
    e2m1 = fixed_scales is not None

    dead = jnp.diagonal(h) == 0
    h = h + jnp.diag(dead.astype(h.dtype))
    if group_size is None:  # from the weights before dead columns are zeroed (the reference's order)
        scale_tab, zero_tab = params(w[:, None, :])
    w = jnp.where(dead[None, :], 0.0, w)
    if group_size is not None:  # static groups keep these; dynamic ones replace each as it starts
        scale_tab, zero_tab = params(w.reshape(n, groups, gs))
    if e2m1:
        scale_tab, zero_tab = fixed_scales, jnp.zeros_like(fixed_scales)

    perm = jnp.where(act_order, jnp.argsort(-jnp.diagonal(h), stable=True), jnp.arange(k))
    w = w[:, perm]
    h = h[perm[:, None], perm[None, :]]
    h = h + damp_percent * jnp.mean(jnp.diagonal(h)) * jnp.eye(k, dtype=h.dtype)
    u = inverse_cholesky_upper(h)
    group_of = jnp.where(static_groups, perm, jnp.arange(k)) // gs  # group of each permuted column

    # Pad K to whole blocks with inert columns: zero weight, identity rows of U, no coupling.
    bs = block_size
    kp = -(-k // bs) * bs
    w = jnp.pad(w, ((0, 0), (0, kp - k)))
    u = jnp.pad(u, ((0, kp - k), (0, kp - k))) + jnp.diag((jnp.arange(kp) >= k).astype(u.dtype))
    group_of = jnp.pad(group_of, (0, kp - k))
    starts = jnp.arange(groups) * gs

    def block(b, carry):
        w, q, loss, scale_tab, zero_tab = carry
        i1 = b * bs
        if group_size is not None:  # dynamic groups starting in this block take the block-start weights
            s_now, z_now = params(w[:, :k].reshape(n, groups, gs))
            new = ~static_groups & (starts >= i1) & (starts < i1 + bs)
            scale_tab = jnp.where(new, s_now, scale_tab)
            zero_tab = jnp.where(new, z_now, zero_tab)
        cols = lax.dynamic_slice(group_of, (i1,), (bs,))
        s_blk, z_blk = scale_tab[:, cols], zero_tab[:, cols]
        u1 = lax.dynamic_slice(u, (i1, i1), (bs, bs))

        def column(i, c):
            w1, q1, e1, l1 = c
            wi = lax.dynamic_index_in_dim(w1, i, 1, keepdims=False)
            d = u1[i, i]
            si = lax.dynamic_index_in_dim(s_blk, i, 1, keepdims=False)
            qi = e2m1_fake_quantize(wi, si) if e2m1 else fake_quantize(
                wi, si, lax.dynamic_index_in_dim(z_blk, i, 1, keepdims=False), bits)
            err = exact_divide(wi - qi, d)
            # u1 is upper triangular: columns before i get exact zeros.
            w1 = w1 - err[:, None] * u1[i][None, :]
            l1 = l1.at[:, i].set((wi - qi) ** 2 / d ** 2)
            return w1, q1.at[:, i].set(qi), e1.at[:, i].set(err), l1

        zeros = jnp.zeros((n, bs), jnp.float32)
        _, q1, e1, l1 = lax.fori_loop(0, bs, column, (lax.dynamic_slice(w, (0, i1), (n, bs)), zeros, zeros, zeros))
        q = lax.dynamic_update_slice(q, q1, (0, i1))
        loss = lax.dynamic_update_slice(loss, l1 / 2, (0, i1))
        # Lazy batch update: the block's errors reach the later columns in one matmul.
        rows = lax.dynamic_slice(u, (i1, 0), (bs, kp))
        rows = jnp.where(jnp.arange(kp)[None, :] >= i1 + bs, rows, 0.0)
        w = w - jnp.matmul(e1, rows, precision=_HIGHEST)
        return w, q, loss, scale_tab, zero_tab

    init = (w, jnp.zeros_like(w), jnp.zeros_like(w), scale_tab, zero_tab)
    _, q, loss, scale_tab, zero_tab = lax.fori_loop(0, kp // bs, block, init)
    inverse = jnp.argsort(perm)
    return GPTQResult(weight=q[:, :k][:, inverse], scale=scale_tab, zero=zero_tab,
                      g_idx=group_of[:k][inverse].astype(jnp.int32), loss=loss[:, :k].sum(axis=0)[inverse])
