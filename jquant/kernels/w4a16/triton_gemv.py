"""The 4-bit GEMV: a few rows of x times an int4 weight in the Mosaic GPU kernel's layout, as a
Triton-backend Pallas kernel.

At M = 1 a decode step's 4-bit GEMMs are short streams of bytes: Llama-3-8B's 4096×4096 output
projection is 8.4 MB, 2 µs at the H200's bandwidth, yet the Mosaic GPU kernel's 128 CTAs of 8
dependent TMA + wgmma steps take ~18 µs there (``bench/results/h200/w4a16.md``). Here, as in the 8-bit
GEMV (``jquant.kernels.gemv8``), a program owns ``block_n`` weight rows and walks K in steps of
``block_k`` codes with plain loads: no shared memory, no barriers, no cluster, so many programs share
an SM and their loads overlap.

It reads ``PackedW4NK`` as the Mosaic GPU kernel does (no second copy): int4 codes ``code − 8``,
optional zero points, group scales. A step's tile is viewed ``[block_n, groups, group]``, so each
code is dequantized in fp32 as the reference does (``(code − zero) · scale``, one rounding) and
multiplied by its x column; the sums are reduced once, at the end. In word order (``to_word_order``)
the stored K positions are permuted within blocks of 32 codes; the kernel loads x's columns in the
same permutation (a gather from L1) instead of moving the weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jquant.kernels.gemv8.config import MAX_ROWS, GemvConfig
from jquant.kernels.lowered_once import lowered_once
from jquant.kernels.w4a16.layout import PackedW4NK
from jquant.kernels.w4a16.mosaic_gpu_decode import WORD_CODES

# 8 rows × 512 codes: 2 KB of codes a step, as many weight bytes in flight a program as the 8-bit
# GEMV's default launch (4 rows × 1024 codes of one byte, docs/design/gemv8.md).
DEFAULT_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4)


def gemv_fits(packed: PackedW4NK, m: int) -> bool:
    """Whether the GEMV runs ``packed`` at ``m`` rows: int4 codes (with or without zero points) in
    groups that hold whole 32-code word blocks (32, 64·j or per channel; groups of 16 split a block),
    and at most ``MAX_ROWS`` rows.

    Examples:
      >>> import numpy as np
      >>> from jquant.kernels.w4a16 import prepack_nk
      >>> q, s = np.zeros((64, 8), np.int32), np.ones((4, 8), np.float32)
      >>> gemv_fits(prepack_nk(q, s[:2], group_size=32), 1), gemv_fits(prepack_nk(q, s, group_size=16), 1)
      (True, False)
      >>> gemv_fits(prepack_nk(q, s[:2], group_size=32), MAX_ROWS + 1)
      False
    """
    return packed.lut == "int4" and packed.group_size % WORD_CODES == 0 and 1 <= m <= MAX_ROWS


def step_codes(block_k: int, k_pad: int, group_size: int) -> int:
    """Codes a loop step takes: the largest power of 2 up to ``block_k`` (and at least 32) that divides
    ``k_pad`` and either holds whole groups or lies inside one.

    Examples:
      >>> step_codes(512, 4096, 128), step_codes(512, 14336, 14336), step_codes(512, 576, 576)
      (512, 512, 64)
      >>> step_codes(512, 4096, 192 * 2), step_codes(512, 4096, 32)
      (128, 512)
    """
    bk = 1 << (max(block_k, WORD_CODES).bit_length() - 1)
    while bk > WORD_CODES and (k_pad % bk or (bk % group_size if group_size <= bk else group_size % bk)):
        bk //= 2
    return bk


def _word_sources(cols):
    """The K position (within its 32-code block) that stored position ``cols`` holds in int4 word
    order: stored ``[thread c, half h, pair q]`` is K column ``8q + 2c + h`` (``word_order_sources``)."""
    return ((cols & ~31) + ((cols & 3) << 3) + (((cols >> 3) & 3) << 1) + ((cols >> 2) & 1))


def _kernel(*refs, rows, steps, groups, width, group_size, word_order, has_zero, has_global, has_bias):
    from jax import lax
    from jax.experimental import pallas as pl

    it = iter(refs)
    x_ref, w_ref, s_ref = next(it), next(it), next(it)
    z_ref = next(it) if has_zero else None
    gs_ref = next(it) if has_global else None
    b_ref = next(it) if has_bias else None
    o_ref = next(it)
    bn = w_ref.shape[0]
    step = groups * width
    # Scale rows a step meets: one per group slot, or the one group a step lies in.
    scale_rows = groups if group_size <= step else 1
    cols = (lax.broadcasted_iota(jnp.int32, (groups, width), 0) * width
            + lax.broadcasted_iota(jnp.int32, (groups, width), 1))
    src = _word_sources(cols) if word_order else cols

    def per_row(a_ref, i):
        """``[block_n, groups, 1]`` fp32 of a per-group operand for step ``i``."""
        first = (i * step) // group_size
        return a_ref[pl.ds(first, scale_rows), :].astype(jnp.float32).T[:, :, None]

    def body(i, parts):
        k0 = i * step
        w = w_ref[:, pl.ds(i * groups, groups), :].astype(jnp.float32)
        if z_ref is not None:
            w = w - per_row(z_ref, i)
        w = w * per_row(s_ref, i)
        return tuple(p + w * x_ref[r, k0 + src].astype(jnp.float32)[None]
                     for r, p in enumerate(parts))

    init = tuple(jnp.zeros((bn, groups, width), jnp.float32) for _ in range(rows))
    parts = lax.fori_loop(0, steps, body, init) if steps > 1 else body(0, init)
    for r, p in enumerate(parts):
        acc = jnp.sum(jnp.sum(p, axis=2), axis=1)
        if gs_ref is not None:
            acc = acc * gs_ref[0]
        if b_ref is not None:
            acc = acc + b_ref[...]
        o_ref[r, :] = acc.astype(o_ref.dtype)


@lowered_once("config", "interpret")
def w4a16_gemv(x, packed: PackedW4NK, bias=None, *, config: GemvConfig | None = None,
               interpret: bool = False) -> jax.Array:
    """``x`` ``[M, K_pad]`` (M ≤ ``MAX_ROWS``; bf16, fp16 or fp32, columns in stored act order: what
    ``kernel_x`` gives) times the packed weight: ``[M, N_pad]`` in x's dtype, fp32 sums. ``bias``:
    optional fp32 ``[N_pad]``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jquant.kernels.w4a16 import prepack_nk, reference_nk
      >>> rng = np.random.default_rng(0)
      >>> q, s = rng.integers(0, 16, (128, 8)), rng.uniform(0.5, 1, (2, 8)).astype(np.float32)
      >>> packed = prepack_nk(q, s, group_size=64)
      >>> x = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
      >>> y = w4a16_gemv(x, packed, interpret=True)[:, :8]
      >>> y.shape, bool(jnp.allclose(y, reference_nk(x, packed), rtol=1e-5, atol=1e-4))
      ((1, 8), True)
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    m = x.shape[0]
    if x.ndim != 2 or x.shape[1] != packed.k_pad:
        raise ValueError(f"x must be [M, K_pad={packed.k_pad}], got shape {tuple(x.shape)}")
    if not gemv_fits(packed, m):
        raise ValueError(f"the 4-bit GEMV takes int4 codes in groups of a multiple of {WORD_CODES} and 1 to "
                         f"{MAX_ROWS} rows of x; got lut={packed.lut!r}, group_size={packed.group_size}, "
                         f"{m} rows")
    cfg = config or DEFAULT_CONFIG
    n_pad, k_pad, g = packed.n_pad, packed.k_pad, packed.group_size
    if n_pad % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} must divide the weight's {n_pad} rows")
    step = step_codes(cfg.block_k, k_pad, g)
    width = min(g, step)
    groups = step // width
    # [N_pad, K_pad / width, width]: a reshape of the row-major codes, no copy.
    data = packed.data.reshape(n_pad, k_pad // width, width)
    operands = [x, data, packed.scale]
    cols = lambda a: pl.BlockSpec((a.shape[0], cfg.block_n), lambda j: (0, j))
    specs = [pl.BlockSpec(x.shape, lambda j: (0, 0)),
             pl.BlockSpec((cfg.block_n, k_pad // width, width), lambda j: (j, 0, 0)), cols(packed.scale)]
    if packed.zero is not None:
        operands.append(packed.zero)
        specs.append(cols(packed.zero))
    if packed.global_scale is not None:
        operands.append(packed.global_scale)
        specs.append(pl.BlockSpec((1,), lambda j: (0,)))
    if bias is not None:
        operands.append(bias)
        specs.append(pl.BlockSpec((cfg.block_n,), lambda j: (j,)))
    kernel = functools.partial(
        _kernel, rows=m, steps=k_pad // step, groups=groups, width=width, group_size=g,
        word_order=packed.word_order, has_zero=packed.zero is not None,
        has_global=packed.global_scale is not None, has_bias=bias is not None)
    return pl.pallas_call(
        kernel, grid=(n_pad // cfg.block_n,), in_specs=specs,
        out_specs=pl.BlockSpec((m, cfg.block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_pad), x.dtype),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="jquant_w4a16_gemv",
    )(*operands)
