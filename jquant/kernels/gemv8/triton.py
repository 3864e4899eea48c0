"""The 8-bit GEMV as a Triton-backend Pallas kernel: a few rows of x times 8-bit weight codes.

At M ≤ ``MAX_ROWS`` a GEMM is a stream of weight bytes: tensor cores have nothing to do, and what
sets the speed is how many bytes each SM keeps in flight. Here a program owns ``block_n`` weight rows
and walks K in steps of ``block_k`` codes: it loads a ``[block_n, block_k]`` tile of int8 or e4m3
codes (no shared memory, no barriers, so many programs share an SM and their loads overlap), widens
them to fp32 in registers, and multiplies-adds them into one fp32 tile of partial sums per row of x,
reduced over K once per scale group. Per-channel (and per-tensor, per-token) scales multiply the sums
in the epilogue, group or block scales each group's sum in fp32, so no code is rounded after decoding:
int8 and e4m3 codes and their zero-point differences are exact in fp32, as are their products with
e4m3 activation codes.

The layout is the Mosaic GPU kernels' ``[N_pad, K_pad]`` one byte a code (``PackedW8NK``,
``PackedFp8``), so a scheme's weight runs both kernels without a second copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jquant.kernels.gemv8.config import MAX_ROWS, GemvConfig, default_gemv_config, step_k
from jquant.kernels.lowered_once import lowered_once

_CODES = (jnp.int8, jnp.float8_e4m3fn)


def _widen(codes):
    """8-bit codes as fp32, exactly. int8: the byte ``c + 128`` as the low mantissa bits of 2^23, minus
    2^23 + 128 (two ALU ops and a subtraction; the int-to-float conversion issues at a quarter of the
    ALU rate on sm_90, yet timed the same within the spread on the H100: 92.4 against 90.4 µs at
    28672×8192, bench/results/h100/gemm8_gemv_int8_bits.md)."""
    if codes.dtype != jnp.int8:
        return codes.astype(jnp.float32)
    biased = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.uint32) ^ 0x80
    return lax.bitcast_convert_type(biased | 0x4B000000, jnp.float32) - 8388736.0


def _kernel(*refs, rows, groups, steps, block_k, has):
    """``has``: which optional operands follow x and the codes, in ``_OPTIONAL`` order."""
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    opt = {name: next(it) if has[name] else None for name in _OPTIONAL}
    o_ref = next(it)
    bn = w_ref.shape[0]

    def group_sums(g):
        """Row ``r``'s ``[block_n]`` sums over group ``g``'s K range, unscaled."""
        z = None if opt["zero"] is None else opt["zero"][g, :].astype(jnp.float32)[:, None]

        def step(i, parts):
            k0 = (g * steps + i) * block_k
            if not isinstance(k0, int):   # a traced offset: tell Triton its alignment (16-byte loads)
                k0 = pl.multiple_of(k0, block_k)
            w = _widen(w_ref[:, pl.ds(k0, block_k)])
            if z is not None:
                w = w - z
            return tuple(p + w * x_ref[r, pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
                         for r, p in enumerate(parts))

        init = tuple(jnp.zeros((bn, block_k), jnp.float32) for _ in range(rows))
        parts = lax.fori_loop(0, steps, step, init) if steps > 1 else step(0, init)
        return [jnp.sum(p, axis=1) for p in parts]

    if opt["group_scale"] is None:
        accs = group_sums(0)
    else:
        def group(g, accs):
            ws = opt["group_scale"][g, :].astype(jnp.float32)
            sums = group_sums(g)
            if opt["x_group_scale"] is not None:   # the reference's order: (sum · s_x) · s_w
                sums = [s * opt["x_group_scale"][r, g] for r, s in enumerate(sums)]
            return tuple(a + s * ws for a, s in zip(accs, sums))

        accs = lax.fori_loop(0, groups, group, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(rows)))
    for r, acc in enumerate(accs):
        if opt["col_scale"] is not None:
            acc = opt["col_scale"][...] * acc
        if opt["row_scale"] is not None:
            acc = opt["row_scale"][r] * acc
        if opt["global_scale"] is not None:
            acc = acc * opt["global_scale"][0]
        if opt["bias"] is not None:
            acc = acc + opt["bias"][...]
        o_ref[r, :] = acc.astype(o_ref.dtype)


_OPTIONAL = ("group_scale", "zero", "x_group_scale", "col_scale", "row_scale", "global_scale", "bias")


@lowered_once("group_size", "out_dtype", "config", "interpret")
def gemv8(x, codes, *, group_size: int | None = None, group_scale=None, zero=None, x_group_scale=None,
          col_scale=None, row_scale=None, global_scale=None, bias=None, out_dtype=None,
          config: GemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """``y[r, n] = Σ_k x[r, k] · w[n, k]`` for ``x`` ``[M, K_pad]`` (M ≤ ``MAX_ROWS``: bf16, fp16,
    fp32 or e4m3 codes) and 8-bit weight codes ``[N_pad, K_pad]`` (int8 or e4m3), with
    ``w[n, k] = (codes[n, k] − zero[g, n]) · group_scale[g, n]`` over groups ``g = k // group_size``.
    The fp32 sums are then multiplied by ``col_scale[n]`` (fp32 ``[N_pad]``), ``row_scale[r]`` (fp32
    ``[M]``: per-token activation scales) and ``global_scale[0]``, and ``bias[n]`` (fp32 ``[N_pad]``)
    added: ``[M, N_pad]`` in ``out_dtype`` (default x's). ``x_group_scale`` ``[M, K_pad / group_size]``
    multiplies each group's sum of row ``r`` before its weight scale (DeepSeek's 1 × 128 activation
    groups).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.gemv8.triton import gemv8
      >>> codes = jnp.asarray(np.arange(-128, 128).reshape(4, 64), jnp.int8)  # weight rows of -128..-65, ...
      >>> cs = jnp.array([1.0, 1.0, 0.5, 0.25])
      >>> gemv8(jnp.ones((1, 64), jnp.float32), codes, col_scale=cs, interpret=True).tolist()  # row sums × cs
      [[-6176.0, -2080.0, 1008.0, 1528.0]]
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if x.ndim != 2:
        raise ValueError(f"x must be [M, K_pad], got shape {tuple(x.shape)}")
    m, k_pad = x.shape
    if codes.ndim != 2 or codes.shape[1] != k_pad or codes.dtype not in _CODES:
        raise ValueError(f"codes must be int8 or float8_e4m3fn [N_pad, K_pad={k_pad}], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    n_pad = codes.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the GEMV takes 1 to {MAX_ROWS} rows of x, got {m}")
    cfg = config or default_gemv_config()
    if n_pad % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} must divide the weight's {n_pad} rows")
    g = k_pad if group_scale is None else group_size
    if group_scale is not None and (not g or k_pad % g or group_scale.shape != (k_pad // g, n_pad)):
        raise ValueError(f"group_scale has shape {tuple(group_scale.shape)}; expected [K_pad / group_size, "
                         f"N_pad] for K_pad = {k_pad}, group_size = {group_size}, N_pad = {n_pad}")
    bk = step_k(cfg, k_pad, g)
    args = dict(group_scale=group_scale, zero=zero, x_group_scale=x_group_scale, col_scale=col_scale,
                row_scale=row_scale, global_scale=global_scale, bias=bias)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, nd=a.ndim: (0,) * nd)
    cols = lambda a: pl.BlockSpec((a.shape[0], cfg.block_n), lambda j: (0, j))
    specs = dict(group_scale=cols, zero=cols, x_group_scale=whole,
                 col_scale=lambda a: pl.BlockSpec((cfg.block_n,), lambda j: (j,)), row_scale=whole,
                 global_scale=whole, bias=lambda a: pl.BlockSpec((cfg.block_n,), lambda j: (j,)))
    present = [name for name in _OPTIONAL if args[name] is not None]
    kernel = functools.partial(_kernel, rows=m, groups=k_pad // g, steps=g // bk, block_k=bk,
                               has={name: args[name] is not None for name in _OPTIONAL})
    return pl.pallas_call(
        kernel, grid=(n_pad // cfg.block_n,),
        in_specs=[whole(x), pl.BlockSpec((cfg.block_n, k_pad), lambda j: (j, 0))]
        + [specs[name](args[name]) for name in present],
        out_specs=pl.BlockSpec((m, cfg.block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_pad), out_dtype or x.dtype),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=f"jquant_gemv8_{codes.dtype.name}",
    )(x, codes, *[args[name] for name in present])
