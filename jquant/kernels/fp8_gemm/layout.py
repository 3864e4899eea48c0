"""The FP8 weight of the W8A8 GEMM (``PackedFp8``, ``prepack_fp8``), how activations meet it
(``activation_operands``) and the kernel's pure-JAX twin (``reference_fp8``). Plain XLA.

``y[m, n] = Σ_b sx[m, b] · sw[n, b] · Σ_{k ∈ block b} xq[m, k] · wq[n, k]``: one K block
(``b``) per-token and per-channel scales, or ``K / 128`` blocks for DeepSeek's block FP8 (1 × 128
activation groups, 128 × 128 weight blocks). Scales are stored ``[blocks, rows]`` in fp32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jquant.formats.exact import to_float32_exact
from jquant.kernels.fp8_gemm.config import BLOCK_K
from jquant.kernels.w4a16.layout import PaddedNK, round_up


@dataclasses.dataclass(frozen=True)
class PackedFp8(PaddedNK):
    """An e4m3 weight for the FP8 GEMM: ``data`` ``[N_pad, K_pad]`` float8_e4m3fn (zero padded to
    multiples of 256 and 128), ``scale`` fp32 ``[blocks, N_pad]`` (blocks: 1, or ``K_pad / 128``
    for block FP8), ``k``, ``n`` the true sizes; MoE experts stack both (``[E, …]``).

    Examples:
      >>> import numpy as np, ml_dtypes
      >>> from jquant.kernels.fp8_gemm import prepack_fp8
      >>> w = np.ones((300, 200), ml_dtypes.float8_e4m3fn)  # [N, K]
      >>> p = prepack_fp8(w, np.full(300, 0.5, np.float32))
      >>> p.data.shape, p.scale.shape, p.blocked
      ((512, 256), (1, 512), False)
    """

    data: jax.Array
    scale: jax.Array
    k: int = 0
    n: int = 0

    @property
    def blocked(self) -> bool:
        return self.scale.shape[-2] > 1


jax.tree_util.register_dataclass(PackedFp8, data_fields=["data", "scale"], meta_fields=["k", "n"])


def prepack_fp8(w, scale) -> PackedFp8:
    """Lays out e4m3 codes ``w`` ``[N, K]`` with a per-tensor (scalar), per-channel (``[N]`` or
    ``[N, 1]``) or 128 × 128 block (``[ceil(N/128), ceil(K/128)]``) scale.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, ml_dtypes
      >>> from jquant.kernels.fp8_gemm import prepack_fp8
      >>> w = np.ones((256, 384), ml_dtypes.float8_e4m3fn)
      >>> p = prepack_fp8(w, np.arange(6, dtype=np.float32).reshape(2, 3))  # 128 × 128 blocks
      >>> p.scale.shape, p.scale[:, [0, 128]].tolist()  # [K blocks, N_pad], spread over each block's rows
      ((3, 256), [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])
    """
    w = jnp.asarray(w)
    if w.ndim != 2 or 0 in w.shape or w.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"prepack_fp8 takes float8_e4m3fn codes [N, K], got {w.dtype} of shape {tuple(w.shape)}")
    n, k = w.shape
    n_pad, k_pad = round_up(n, 256), round_up(k, BLOCK_K)
    s = jnp.asarray(scale, jnp.float32)
    kb = k_pad // BLOCK_K
    if s.size == 1:
        rows = jnp.broadcast_to(s.reshape(1, 1), (1, n))
    elif s.shape in ((n,), (n, 1)):
        rows = s.reshape(1, n)
    elif s.shape == (-(-n // BLOCK_K), kb):
        rows = jnp.repeat(s, BLOCK_K, axis=0)[:n].T
    else:
        raise ValueError(f"scale has shape {tuple(s.shape)}; expected a scalar, ({n},) per channel or "
                         f"({-(-n // BLOCK_K)}, {kb}) per 128 × 128 block for a weight of shape ({n}, {k})")
    data = jnp.pad(w, ((0, n_pad - n), (0, k_pad - k)))
    return PackedFp8(data=data, scale=jnp.pad(rows, ((0, 0), (0, n_pad - n))), k=k, n=n)


def activation_operands(xq: jax.Array, x_scale: jax.Array, packed: PackedFp8, rows: int):
    """``xq`` ``[M, K]`` e4m3 and its scale (scalar, ``[M]`` / ``[M, 1]`` per token, or ``[M, K /
    128]`` per 1 × 128 group, matching the weight's blocks) as the kernel reads them: codes
    ``[rows, K_pad]`` and fp32 scales ``[blocks, rows]`` (padding 0)."""
    m, k = xq.shape
    if k != packed.k or xq.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"xq must be float8_e4m3fn [M, K={packed.k}], got {xq.dtype} {tuple(xq.shape)}")
    s = jnp.asarray(x_scale, jnp.float32)
    blocks = packed.scale.shape[-2]
    if s.size == 1:
        cols = jnp.broadcast_to(s.reshape(1, 1), (blocks, m))
    elif s.shape in ((m,), (m, 1)):
        cols = jnp.broadcast_to(s.reshape(1, m), (blocks, m))
    elif s.shape == (m, blocks) and packed.blocked:
        cols = s.T
    else:
        raise ValueError(f"x_scale has shape {tuple(s.shape)}; expected a scalar, ({m},) per token"
                         + (f" or ({m}, {blocks}) per 1 × 128 group" if packed.blocked else ""))
    codes = jnp.pad(xq, ((0, rows - m), (0, packed.k_pad - k)))
    return codes, jnp.pad(cols, ((0, 0), (0, rows - m)))


def reference_fp8(xq, x_scale, packed: PackedFp8, bias=None, out_dtype=jnp.bfloat16) -> jax.Array:
    """The kernel's twin: per K block an fp32 dot of the codes, scaled by both sides' scales, summed
    in block order; then the bias, in fp32; ``[M, N]`` in ``out_dtype``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, ml_dtypes
      >>> from jquant.kernels.fp8_gemm import prepack_fp8, reference_fp8
      >>> w = np.full((8, 64), 2, ml_dtypes.float8_e4m3fn)
      >>> xq = jnp.ones((3, 64), jnp.float8_e4m3fn)
      >>> y = reference_fp8(xq, jnp.full((3, 1), 0.5), prepack_fp8(w, np.full(8, 0.25, np.float32)))
      >>> y.shape, float(y[0, 0])  # 64 · 2 · 0.5 · 0.25
      ((3, 8), 16.0)
    """
    m = xq.shape[0]
    codes, cols = activation_operands(xq, x_scale, packed, m)
    blocks = packed.scale.shape[0]
    span = packed.k_pad // blocks
    a = to_float32_exact(codes).reshape(m, blocks, span)   # codes made in the same program stay rounded
    b = packed.data.astype(jnp.float32).reshape(packed.n_pad, blocks, span)
    parts = jnp.einsum("mbk,nbk->bmn", a, b, precision=jax.lax.Precision.HIGHEST)
    out = jnp.sum(parts * cols[:, :, None] * packed.scale[:, None, :], axis=0)[:, :packed.n]
    if bias is not None:
        out = out + jnp.asarray(bias, jnp.float32)
    return out.astype(out_dtype)
