"""``w4a16_matmul``: ``x @ W`` for a prepacked 4-bit weight, dispatched by M and device.

Two weight layouts: ``PackedW4NK`` (``prepack_nk``; int4, E2M1 or NF4 codes, groups of 16, 32,
64·j or per-channel) runs the Mosaic GPU kernel (``"mgpu"``, every M up to ``MGPU_MAX_M``), the
fastest on the H200 and what the schemes use; ``PackedW4`` (``prepack``, tile-major) runs the
Triton kernels, kept as a measured alternative.

Implementations (``impl``):
* ``"mgpu"``: the Mosaic GPU kernel (Hopper, ``PackedW4NK`` only).
* ``"gemv"``: the small-M Pallas kernel (no tensor cores), ``M ≤ GEMV_MAX_ROWS``.
* ``"mma"``: the tensor-core Pallas kernel.
* ``"pallas"``: whichever kernel fits the layout and M.
* ``"xla"``: dequantize to ``x``'s dtype, then ``jnp.dot`` with fp32 accumulation (XLA/cuBLAS).
* ``"reference"``: dequantize in fp32, fp32 dot (the exact twin; slow on GPUs).
* ``"auto"``: on Hopper, ``mgpu`` for a ``PackedW4NK`` up to ``MGPU_MAX_M`` rows
  (``MGPU_MAX_M_SMALL_WEIGHT`` for weights under 8192×8192); for a ``PackedW4`` the kernel and
  variant of the first rule of ``AUTO_RULES`` (data: ``auto_dispatch_h200.json``, rewritten from
  device measurements) whose ``max_m`` ≥ M; else xla. xla on other GPUs; reference on CPU. With
  ``interpret=True`` the kernels run on any device.

Forcing ``"gemv"``/``"mma"`` where no GPU can run them warns once and runs the reference;
``"pallas"`` there is an error (it asks for a kernel, nothing else).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import warnings

import jax
import jax.numpy as jnp

from jquant.pallas_kernels import w4a16_grouped  # noqa: F401  (registers the grouped kernel bodies)
from jquant.device import compute_capability
from jquant.pallas_kernels.w4a16_layout import PackedW4, dequantize_packed, gather_pad
from jquant.pallas_kernels.w4a16_mgpu import (MgpuConfig, PackedW4NK, reference_nk,
                                              w4a16_mgpu_matmul)
from jquant.pallas_kernels.w4a16_triton import (GEMV_MAX_ROWS, VARIANTS, TuningConfig,
                                                effective_split, reference, w4a16_pallas)
from jquant.qtensor import QTensor

IMPLS = ("auto", "pallas", "mgpu", "gemv", "mma", "xla", "reference")
# Above these M, "auto" runs XLA for PackedW4NK: the kernel decodes W once per 128 rows of x. On the
# H200 it beat XLA dequant + dot up to M = 1024 for weights of 8192×8192 and up (917 vs 1371 µs at
# 28672×8192) but not for 4096×4096 (131 vs 104 µs) or SmolLM2's 1536×576 past M = 128.
MGPU_MAX_M = 1024
MGPU_MAX_M_SMALL_WEIGHT = 128
MGPU_LARGE_WEIGHT = 8192 * 8192
AUTO_DISPATCH_FILE = pathlib.Path(__file__).with_name("auto_dispatch_h200.json")


@dataclasses.dataclass(frozen=True)
class AutoRule:
    """``impl="auto"`` runs kernel ``mode``/``variant`` for M ≤ ``max_m`` (first match wins)."""

    max_m: int
    mode: str
    variant: str


def load_auto_rules(path=AUTO_DISPATCH_FILE) -> tuple[AutoRule, ...]:
    """The dispatch table, checked: known kernels, ``max_m`` increasing, gemv within its rows."""
    rules = tuple(AutoRule(int(r["max_m"]), r["mode"], r["variant"])
                  for r in json.loads(pathlib.Path(path).read_text())["rules"])
    for prev, rule in zip((None,) + rules, rules):
        if rule.variant not in VARIANTS.get(rule.mode, ()):
            raise ValueError(f"{path}: unknown kernel {rule.mode!r}/{rule.variant!r}")
        if prev is not None and rule.max_m <= prev.max_m:
            raise ValueError(f"{path}: max_m must increase, got {prev.max_m} then {rule.max_m}")
        if rule.mode == "gemv" and rule.max_m > GEMV_MAX_ROWS:
            raise ValueError(f"{path}: gemv handles at most {GEMV_MAX_ROWS} rows")
    return rules


# Measured on an H200 (bench/NOTES.md): gemv at M = 1 and mma at M ≤ 32 beat XLA bf16 on the large
# shapes; at M = 128 the base mma kernel is ~2-3x slower than bf16 and close to XLA dequant + dot.
AUTO_RULES = load_auto_rules()


def auto_rule(m: int) -> AutoRule | None:
    """The rule ``impl="auto"`` follows at ``m`` rows on Hopper (None: XLA)."""
    return next((r for r in AUTO_RULES if m <= r.max_m), None)
# Programs to aim for: many waves over the H200's 132 SMs, so enough bytes are in flight.
_GEMV_TARGET_PROGRAMS = 2048
_MMA_TARGET_PROGRAMS = 264

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def default_config(mode: str, m: int, packed: PackedW4, variant: str = "base") -> TuningConfig:
    """A sane launch for kernel ``mode``/``variant`` at ``m`` rows on the packed layout.

    From the H200 sweeps (bench/NOTES.md): gemv wants many programs (split-K 16 or more), 4 warps,
    2 stages; mma wants split-K 2-4, 4 warps, 2 stages, and row blocks of 16-64 (a 128-row x tile
    with 512-row K tiles overflows the 227 KB of shared memory).
    """
    nt, kt = packed.data.shape[:2]
    if mode == "gemv":
        split = effective_split(kt, max(16, math.ceil(_GEMV_TARGET_PROGRAMS / nt)))
        return TuningConfig(packed.block_n, packed.block_k, split, num_warps=4, num_stages=2,
                            block_m=1, variant=variant)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if packed.block_k >= 512 else 128
    programs = -(-m // bm) * nt
    split = effective_split(kt, max(4 if bm == 16 else 2,
                                    math.ceil(_MMA_TARGET_PROGRAMS / programs)))
    return TuningConfig(packed.block_n, packed.block_k, split,
                        num_warps=8 if bm == 128 else 4, num_stages=2, block_m=bm, variant=variant)


def resolve_impl(impl: str, m: int, interpret: bool = False, layout: str = "tile",
                 weight_elems: int = MGPU_LARGE_WEIGHT) -> str:
    """The implementation ``w4a16_matmul`` runs for ``impl`` at ``m`` rows on the default device,
    for a ``PackedW4`` (``layout="tile"``) or a ``PackedW4NK`` (``layout="nk"``, of ``weight_elems``
    = N·K weights)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("xla", "reference"):
        return impl
    if layout == "nk":
        return _resolve_nk(impl, m, interpret, weight_elems)
    if impl == "mgpu":
        raise ValueError("impl='mgpu' needs a weight packed with prepack_nk (int4 / E2M1); this one is a "
                         "PackedW4 for the Triton kernels")
    rule = auto_rule(m) if impl == "auto" else None
    if rule is not None:
        kernel = rule.mode
    else:   # "pallas", or "auto" past the table (where interpret mode still runs a kernel)
        kernel = "gemv" if impl == "pallas" and m <= GEMV_MAX_ROWS else "mma"
    if interpret:
        return kernel if impl in ("auto", "pallas") else impl
    cc = compute_capability()  # 0 off NVIDIA GPUs
    if impl == "auto":
        if cc == 0:
            return "reference"
        if cc // 10 != 9:
            return "xla"
        return kernel if rule is not None else "xla"
    if cc == 0:
        if impl == "pallas":
            raise ValueError("impl='pallas' needs an NVIDIA GPU; on "
                             f"{jax.devices()[0].platform} pass interpret=True to run the Pallas "
                             "kernels in interpret mode")
        _warn_once(impl, f"impl={impl!r} cannot run on {jax.devices()[0].platform}; using the "
                         "pure-JAX reference instead (pass interpret=True to run the kernel)")
        return "reference"
    return kernel if impl == "pallas" else impl


def _resolve_nk(impl: str, m: int, interpret: bool, weight_elems: int) -> str:
    if impl in ("gemv", "mma"):
        raise ValueError(f"impl={impl!r} needs the tile-major layout of prepack; this weight is a "
                         "PackedW4NK (prepack_nk) for the Mosaic GPU kernel: use 'mgpu' or 'auto'")
    if interpret:
        return "mgpu"
    cc = compute_capability()
    if impl == "auto":
        if cc == 0:
            return "reference"
        max_m = MGPU_MAX_M if weight_elems >= MGPU_LARGE_WEIGHT else MGPU_MAX_M_SMALL_WEIGHT
        return "mgpu" if cc // 10 == 9 and m <= max_m else "xla"
    if cc // 10 != 9:   # wgmma is Hopper-only
        where = jax.devices()[0].platform if cc == 0 else f"compute capability {cc}"
        if impl == "pallas":
            raise ValueError(f"impl='pallas' on a PackedW4NK needs a Hopper GPU (sm_90), not {where}; "
                             "pass interpret=True to run the kernel in interpret mode")
        _warn_once(f"mgpu{cc}", f"impl='mgpu' cannot run on {where}; using the XLA path instead")
        return "reference" if cc == 0 else "xla"
    return "mgpu"


def w4a16_matmul(x, packed: PackedW4 | PackedW4NK | QTensor, *, bias=None, impl: str = "auto",
                 config: TuningConfig | MgpuConfig | None = None, interpret: bool = False,
                 poison: bool = False):
    """``x`` ``[..., K]`` (bf16 / fp16 / fp32) contracted with a 4-bit weight's K axis; fp32
    accumulation, result ``[..., N]`` in ``x``'s dtype. ``bias`` is an optional ``[N]`` vector.

    The weight is a ``PackedW4`` or ``PackedW4NK``, whose K axis is that of the ``[K, N]`` codes it
    was packed from (``x @ W`` for those codes; a scheme's prepared weight holds its ``[N, K]``
    QTensor's codes transposed, so this is ``Scheme.apply``'s ``x @ W.T``), or a 4-bit ``[N, K]``
    QTensor recording ``k_axis=1`` (``x @ W.T``), laid out for the Mosaic GPU kernel on every call
    (``Scheme.process_weights_after_loading`` lays it out once); any other ``k_axis`` is refused.

    ``config`` overrides the launch: a ``TuningConfig`` for a ``PackedW4`` (its ``block_n``/
    ``block_k`` must match the packing), an ``MgpuConfig`` for a ``PackedW4NK``;
    ``interpret`` runs the Pallas kernels on CPU; ``poison`` (testing) NaN-fills kernel outputs first.
    """
    if isinstance(packed, QTensor):
        packed = _pack_qtensor(packed)
    if not isinstance(packed, (PackedW4, PackedW4NK)):
        raise TypeError("packed must be a PackedW4 (prepack), a PackedW4NK (prepack_nk) or a 4-bit "
                        f"QTensor, got {type(packed).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize not in (2, 4):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype} (shape {tuple(x.shape)})")
    if x.ndim < 1 or x.shape[-1] != packed.k or x.size == 0:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., K={packed.k}], non-empty")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (packed.n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({packed.n},)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    m = x2.shape[0]
    if isinstance(packed, PackedW4NK):
        # (interpret mode already fills never-written kernel outputs with NaN: no poison needed)
        return _nk_matmul(x2, packed, bias, impl, config, interpret).reshape(*lead, packed.n)
    kind = resolve_impl(impl, m, interpret)
    if kind == "reference":
        out = reference(x2, packed, bias)
    elif kind == "xla":
        out = _xla_matmul(x2, packed, bias)
    else:
        rule = auto_rule(m) if impl == "auto" else None
        variant = rule.variant if rule is not None and rule.mode == kind else "base"
        out = _kernel_matmul(x2, packed, bias, kind, config, variant, interpret, poison)
    return out.reshape(*lead, packed.n)



def _pack_qtensor(qt: QTensor) -> PackedW4NK:
    # Imported here: scheme_impl imports this module.
    from jquant.pallas_kernels.scheme_impl import prepack_for_kernels, unified_w4

    if qt.ndim != 2 or qt.k_axis != 1:
        raise ValueError(f"w4a16_matmul takes a QTensor weight [N, K] with k_axis=1 (x @ W.T); this "
                         f"{qt.fmt} QTensor of shape {qt.shape} records k_axis={qt.k_axis}: quantize the "
                         "[N, K] weight along axis 1 (Scheme.quantize_weight), or use jquant.qdot")
    args = unified_w4(qt)
    packed = None if args is None else prepack_for_kernels(args)
    if packed is None:
        raise ValueError(f"w4a16_matmul: a {qt.fmt} QTensor with shape {qt.shape} and block {qt.block} has "
                         "no 4-bit kernel layout (4-bit codes in groups of 16, 32 or 64·j along K, or per "
                         "channel); use Scheme.apply or jquant.qdot")
    return packed


def _xla_matmul(x2, packed: PackedW4, bias):
    # XLA:CPU cannot always run a bf16 × bf16 → f32 dot; there the operands go to f32 first.
    dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else x2.dtype
    w = dequantize_packed(packed, dtype)[:, :packed.n]
    xs = gather_pad(x2, packed, x2.shape[0]).astype(dtype)
    out = jnp.dot(xs, w, preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x2.dtype)


def _kernel_matmul(x2, packed: PackedW4, bias, mode, config, variant, interpret, poison):
    m = x2.shape[0]
    if mode == "gemv" and m > GEMV_MAX_ROWS:
        raise ValueError(f"impl='gemv' handles at most {GEMV_MAX_ROWS} rows, x has {m}")
    cfg = config or default_config(mode, m, packed, variant)
    if (cfg.block_n, cfg.block_k) != (packed.block_n, packed.block_k):
        raise ValueError(f"config tiles (block_n={cfg.block_n}, block_k={cfg.block_k}) differ from "
                         f"the packed layout ({packed.block_n}, {packed.block_k}); prepack with it")
    if mode == "gemv":
        m_pad = 1 << (m - 1).bit_length()
    else:
        m_pad = -(-m // cfg.block_m) * cfg.block_m
    xs = gather_pad(x2, packed, m_pad)
    bias_p = None
    if bias is not None:
        bias_p = jnp.pad(bias.astype(jnp.float32), (0, packed.n_pad - packed.n))
    out = w4a16_pallas(xs, packed, bias_p, mode=mode, config=cfg, interpret=interpret,
                       poison=poison)
    return out[:m, :packed.n]


def _nk_matmul(x2, packed: PackedW4NK, bias, impl, config, interpret):
    kind = resolve_impl(impl, x2.shape[0], interpret, layout="nk", weight_elems=packed.n * packed.k)
    if kind == "mgpu" and x2.dtype == jnp.float32:
        if impl == "auto":   # the kernel's wgmma takes 16-bit x; fp32 x keeps full precision in XLA
            kind = "reference" if compute_capability() == 0 else "xla"
        else:
            raise TypeError(f"impl={impl!r} runs the Mosaic GPU kernel, which takes bf16 or fp16 x; "
                            f"got float32 x of shape {tuple(x2.shape)} (cast it, or use impl='auto')")
    if kind == "reference":
        return reference_nk(x2, packed, bias)
    if kind == "xla":
        dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else x2.dtype
        return reference_nk(x2, packed, bias, dtype)
    if config is not None and not isinstance(config, MgpuConfig):
        raise TypeError(f"config for the Mosaic GPU kernel must be an MgpuConfig, got "
                        f"{type(config).__name__}")
    return w4a16_mgpu_matmul(x2, packed, bias, config=config, interpret=interpret)
