"""The MoE benchmark (``jquant bench moe``): one MoE layer with quantized experts as a model runs it,
against the same layer with bf16 experts, in one run.

A cell is (layer shape, expert format, tokens). The layer is ``jquant.models.moe.MoE``: router, top-k
(gpt-oss: softmax over the top-k logits; DeepSeek-V3: sigmoid scores with a correction bias and
group-limited top-k), the tokens sorted by expert, the grouped gate/up GEMM, the activation (gpt-oss'
clamped SwiGLU, SiLU SwiGLU), the grouped down GEMM and the weighted combine; no shared expert.
Parameters are random bf16 of the shapes ``MoE.init`` gives (router and experts ``N(0, 1/K)``); the
quantized ones come from ``quantize_experts`` as a user would make them. x is random, so the router
spreads tokens about evenly (a served model's routing is more skewed).

Candidates of a cell, timed interleaved (``time_interleaved``) on copies of the parameters rotated
past the L2:

* ``quantized``: the layer as a user runs it: ``QExperts`` laid out by ``prepare_experts`` for this
  device (the record's ``impl``: ``mgpu``, the grouped kernel, or ``xla``);
* ``bf16_ragged_dot``: the layer on bf16 experts, ``jax.lax.ragged_dot``. XLA (JAX 0.11.2) computes
  it as every row times every expert, masked (the CPU lowering shows it; on the H100 the gpt-oss-20b
  layer at 4096 tokens took 35.4 ms, 32 experts × its 0.82 TFLOP at ~740 TFLOP/s), E times the
  useful work: at many tokens a weak peer. The records' ``tflop_per_s`` (useful FLOPs,
  ``expert_flops``) compare each candidate with a dense bf16 GEMM's rate instead;
* ``dequant_ragged_dot``: the quantized experts dequantized to bf16 inside the program, then the bf16
  layer (what a kernel must beat without changing the format);
* ``grouped_kernel`` (on Hopper): the same layer with the experts laid out for their grouped Mosaic GPU
  kernel (``kernel_params``: 4-bit experts ``W4A16Experts``, W8A8 FP8 ``Fp8Experts``), forced, the
  activation applied by XLA between the two GEMMs (the ``quantized`` parameters themselves where
  ``prepare_experts`` already chose that layout; where it chose the activation in the gate/up GEMM's
  epilogue, this candidate is the same kernels without it);
* ``separate_gemms`` (with ``grouped_kernel``): those experts with each grouped GEMM gathering its rows
  into slots and back on its own (``SeparateGemms``), the layer without one slot layout;
* ``tokamax`` (int4 formats, when ``import tokamax`` works): the same layer with each grouped GEMM
  ``tokamax.ragged_dot`` on the same int4 codes and scales as a qwix ``QArray``: its Mosaic GPU kernel,
  else its default chain (``tokamax_impl``; why the kernel refused, ``tokamax_refusals``). tokamax is
  not a dependency; a record says ``absent`` when it is not installed.

The byte floor of a cell is the bytes it must read at least once: the experts the routing activates
at this token count (counted from the routing of the cell's x), the router, x and y, at the HBM rate
measured in the same run. A record holds the run's ``device``, ``jax_version``, ``commit`` and
``date`` (``run_meta``), the shape, tokens, format, µs, speedup vs bf16 ragged_dot and the floor; with
``profile_dir``, also ``profile``: a summary of a ``jax.profiler`` trace of a few calls of
``quantized``, ``grouped_kernel`` and ``separate_gemms`` (``summarize_trace``), to see where a call's
time goes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from jquant.bench.profile import trace_steps
from jquant.bench.records import markdown_title, run_meta
from jquant.bench.timing import (array_bytes, copies_for, device_hbm_bytes_per_s, spread_pct, time_interleaved,
                                 time_steadiest)
from jquant.kernels.moe.api import choose_impl, prepare_experts
from jquant.kernels.moe.experts import EXPERT_PARAMS, QExperts
from jquant.kernels.moe.grouped_fp8 import Fp8Experts
from jquant.kernels.moe.grouped_w4a16 import W4A16Experts
from jquant.kernels.moe.slots import SeparateGemms
from jquant.models.moe import MoE, quantize_experts
from jquant.qtensor import QTensor
from jquant.schemes import dispatch
from jquant.schemes.scheme import get_scheme

TOKENS = (1, 8, 64, 512, 4096)
# Copies of one candidate's parameters at most this large in all, else one copy: DeepSeek-V3's experts
# (6-23 GB; one token reads 8 experts, 0.35 GB of FP8) dwarf the L2 already, and the XLA reference's
# temporaries (the whole stack dequantized, per call) must fit beside them; gpt-oss' MXFP4 experts
# (0.4 GB; one token reads 53 MB, less than the 60 MB L2) get three copies.
MAX_COPY_BYTES = 8 * 2**30
# Parameters with a leading expert axis: their bytes count once per activated expert.
_PER_EXPERT = EXPERT_PARAMS + ("gate_up_bias", "down_bias")
# Calls traced per candidate with ``profile_dir``, and the candidates traced: the layer as a user runs
# it and the grouped kernel forced (the baselines' kernels are XLA's, already understood).
PROFILE_STEPS = 5
_PROFILED = ("quantized", "grouped_kernel", "separate_gemms")


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A MoE layer to time: ``MoE``'s sizes and routing options, and the expert formats (registered
    scheme names) timed on it by default.

    Examples:
      >>> from jquant.kernels.moe.bench import SHAPES
      >>> shape = SHAPES["deepseek-v3"]
      >>> shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, shape.formats[0]
      (256, 8, 7168, 2048, 'fp8_e4m3_block128x128')
      >>> shape.tiny().hidden, shape.model().n_group
      (128, 8)
    """

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    formats: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()   # MoE fields: routing, activation, biases
    tiny_sizes: tuple[tuple[str, Any], ...] = ()  # what ``tiny`` changes

    def model(self, dtype: Any = jnp.bfloat16) -> MoE:
        return MoE(num_experts=self.num_experts, top_k=self.top_k, hidden=self.hidden,
                   intermediate=self.intermediate, dtype=dtype, param_dtype=dtype, **dict(self.options))

    def tiny(self) -> "MoEShape":
        """The same layer a few hundred times smaller (``--shrink``: a plumbing check)."""
        sizes = dict(self.tiny_sizes)
        options = {**dict(self.options), **{k: v for k, v in sizes.items() if k in ("n_group", "topk_group")}}
        return dataclasses.replace(self, name=f"{self.name}-tiny", options=tuple(options.items()),
                                   **{k: v for k, v in sizes.items() if k not in ("n_group", "topk_group")})

    def expert_flops(self, tokens: int) -> int:
        """The grouped GEMMs' multiply-adds ×2 for ``tokens`` (each row to ``top_k`` experts: gate/up
        ``[2I, H]``, down ``[H, I]``), the work a dense bf16 GEMM would do for the same rows."""
        return 2 * tokens * self.top_k * 3 * self.hidden * self.intermediate

    def describe(self) -> dict:
        """The shape as a record holds it."""
        e, i, h = self.num_experts, self.intermediate, self.hidden
        return dict(shape=self.name, num_experts=e, top_k=self.top_k, hidden=h, intermediate=i,
                    weight_shapes={"gate_up_proj": [e, 2 * i, h], "down_proj": [e, h, i]},
                    layer={k: v for k, v in self.options})


SHAPES = {
    # gpt-oss-20b: 32 experts, top-4, hidden = intermediate = 2880 (2880 = 90 groups of 32, not whole
    # groups of 128: int4 takes groups of 32, as MXFP4 does); router and expert biases, clamped SwiGLU.
    "gpt-oss-20b": MoEShape("gpt-oss-20b", 32, 4, 2880, 2880, ("mxfp4", "int4_g32"),
                            (("router_bias", True), ("expert_bias", True), ("activation", "gptoss_swiglu")),
                            (("num_experts", 8), ("hidden", 64), ("intermediate", 64))),
    # DeepSeek-V3: 256 routed experts, top-8 from 4 of 8 groups, sigmoid scores with a correction bias,
    # weights renormalized and scaled by 2.5; block FP8 is its checkpoint's format.
    "deepseek-v3": MoEShape("deepseek-v3", 256, 8, 7168, 2048, ("fp8_e4m3_block128x128", "int4_g128", "mxfp4"),
                            (("scoring", "sigmoid"), ("n_group", 8), ("topk_group", 4),
                             ("routed_scaling_factor", 2.5)),
                            (("num_experts", 16), ("top_k", 4), ("hidden", 128), ("intermediate", 128),
                             ("n_group", 4), ("topk_group", 2))),
    # Qwen3-30B-A3B: 128 experts, top-8 of a softmax renormalized, hidden 2048, intermediate 768, no shared
    # expert; its FP8 checkpoint is block-128 FP8. A block-FP8 layer whose bf16 ragged_dot fits one GPU:
    # DeepSeek-V3's masked product (256 experts × 32768 rows × 7168 at 4096 tokens) does not.
    "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", 128, 8, 2048, 768, ("fp8_e4m3_block128x128", "int4_g128"), (),
                              (("num_experts", 16), ("top_k", 4), ("hidden", 128), ("intermediate", 128))),
}


def random_params(model: MoE, key) -> dict:
    """Random parameters of ``model`` in its ``param_dtype``, made on the device: weights ``N(0, 1/K)``,
    biases ``N(0, 0.02²)``; a large expert stack one expert at a time (DeepSeek-V3's gate/up is 7.5G
    values: its float32 draws at once would be 30 GB)."""
    shapes = jax.eval_shape(model.init, key, jnp.zeros((1, model.hidden), model.param_dtype))["params"]
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))

    def one(k, path, s):
        scale = 0.02 if "bias" in jax.tree_util.keystr(path) else s.shape[-1] ** -0.5
        normal = lambda kk, shape: (scale * jax.random.normal(kk, shape, jnp.float32)).astype(s.dtype)
        if len(s.shape) == 3 and math.prod(s.shape) > 2**26:
            return jax.lax.map(lambda kk: normal(kk, s.shape[1:]), jax.random.split(k, s.shape[0]))
        return normal(k, s.shape)

    make = jax.jit(lambda ks: [one(k, p, s) for k, (p, s) in zip(ks, leaves)])
    return jax.tree_util.tree_unflatten(tree, make(keys))


def dequantized(params: dict, dtype: Any = jnp.bfloat16) -> dict:
    """``params`` with every QExperts replaced by its weights dequantized to ``dtype`` (inside a jitted
    candidate: the dequant-then-ragged_dot baseline)."""
    return jax.tree.map(lambda q: q.weight.dequantize(dtype) if isinstance(q, QExperts) else q, params,
                        is_leaf=lambda q: isinstance(q, QExperts))


def expert_bytes(params: dict, num_experts: int) -> tuple[float, int]:
    """(bytes of one expert: its gate/up and down weights, scales and biases; bytes of the rest: the
    router)."""
    per, rest = 0, 0
    for name, leaf in params.items():
        if name in _PER_EXPERT:
            per += array_bytes(leaf)
        else:
            rest += array_bytes(leaf)
    return per / num_experts, rest


# ---- tokamax (optional) -----------------------------------------------------------------------------

def _import_tokamax():
    """``(tokamax, qwix)`` or None when either does not import (tokamax builds on qwix)."""
    try:
        import qwix
        import tokamax
    except ImportError:
        return None
    return tokamax, qwix


@dataclasses.dataclass(frozen=True)
class TokamaxExperts:
    """An expert stack whose grouped GEMM is ``tokamax.ragged_dot`` on a qwix ``QArray [E, K, N]``;
    ``MoE`` runs it through ``apply`` as it runs ``QExperts``."""

    rhs: Any
    shape: tuple[int, int, int]
    implementation: str | None = None

    def apply(self, x: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
        del impl
        tokamax, _ = _import_tokamax()
        y = tokamax.ragged_dot(x, self.rhs, group_sizes, preferred_element_type=jnp.float32,
                               implementation=self.implementation)
        return y.astype(x.dtype)


jax.tree_util.register_dataclass(TokamaxExperts, data_fields=["rhs"], meta_fields=["shape", "implementation"])


def tokamax_status(scheme: str) -> str:
    """``"absent"`` (tokamax or qwix does not import), ``"n/a"`` (not an int4 format: tokamax's
    quantized ragged dot takes integer codes with scales along K, no zero points) or ``"ok"``."""
    if _import_tokamax() is None:
        return "absent"
    return "ok" if get_scheme(scheme).weight.format == "int4" else "n/a"


def _int4_qarray(qt: QTensor, qwix):
    """The stack's int4 codes and scales as a qwix ``QArray [E, K, N]`` (codes = dequantized / scale,
    exact for symmetric int4), one expert at a time."""
    def one(leaves):
        data, scale = leaves
        w = QTensor(data=data, scale=scale, fmt=qt.fmt, shape=qt.shape[1:], dtype=qt.dtype, block=qt.block[1:],
                    pack_axis=None if qt.pack_axis is None else qt.pack_axis - 1, options=qt.options, k_axis=1)
        s = w.expand(scale.astype(jnp.float32))
        codes = jnp.where(s == 0, 0, jnp.round(w.dequantize(jnp.float32) / jnp.where(s == 0, 1, s)))
        return codes.astype(jnp.int4).T, scale.astype(jnp.bfloat16).T

    codes, scales = jax.lax.map(one, (qt.data, qt.scale))
    return qwix.QArray(qvalue=codes, scale=scales, qtype=jnp.int4)


def tokamax_params(params: dict, implementation: str | None = None) -> dict:
    """``params`` with every int4 QExperts replaced by ``TokamaxExperts`` holding the same weights
    (TokamaxExperts leaves: their ``implementation`` replaced)."""
    _, qwix = _import_tokamax()

    def swap(q):
        if isinstance(q, TokamaxExperts):
            return dataclasses.replace(q, implementation=implementation)
        if not isinstance(q, QExperts):
            return q
        return TokamaxExperts(_int4_qarray(q.weight, qwix), q.shape, implementation)

    return jax.tree.map(swap, params, is_leaf=lambda q: isinstance(q, (QExperts, TokamaxExperts)))


# ---- the run ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _How:
    """How ``run`` times its cells, and the fields every record carries."""

    reps: int
    warmup: int
    retries: int
    max_spread_pct: float
    min_batch_s: float
    max_copies: int
    hbm_bytes_per_s: float
    meta: dict
    log: Callable[[str], None]
    profile_dir: str | None = None


def _copies(tree, max_copies: int) -> list:
    """``tree`` and copies of it (distinct buffers of the same values, so the L2 never holds the next),
    at most ``MAX_COPY_BYTES`` in all."""
    nbytes = array_bytes(tree)
    n = copies_for(nbytes, max_copies=max_copies) if max_copies > 1 else 1
    n = 1 if n * nbytes > MAX_COPY_BYTES else n
    return [tree] + [jax.tree.map(lambda a: a.copy(), tree) for _ in range(n - 1)]


def _time_cell(cands: dict, how: _How) -> tuple[dict, list, dict]:
    """``(times, attempt spreads, {candidate: error})``: the candidates timed interleaved; when that
    fails (a reference path out of memory at 4096 tokens), each is tried alone and the rest re-timed
    (none left: no times, every error)."""
    def once(c):
        return time_steadiest(lambda: time_interleaved(c, warmup=how.warmup, reps=how.reps,
                                                       min_batch_s=how.min_batch_s),
                              how.max_spread_pct, how.retries)

    try:
        return (*once(cands), {})
    except Exception:
        failed = {}
        for name, (fn, args) in cands.items():
            try:
                jax.block_until_ready(jax.jit(fn)(*args[0]))
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {e}"[:300]
        if not failed:   # each runs alone: not a candidate's own failure
            raise
        rest = {name: c for name, c in cands.items() if name not in failed}
        return (*once(rest), failed) if rest else ({}, [], failed)


def _profile(cands: dict, timed: Iterable[str], prefix: str, log: Callable[[str], None]) -> dict:
    """``{candidate: summarize_trace}`` of ``PROFILE_STEPS`` calls of each timed candidate of
    ``_PROFILED`` (on its parameter copies in turn, as timed), traced into ``{prefix}_{candidate}``."""
    out = {}
    for name in (n for n in _PROFILED if n in timed):
        fn, args = cands[name]
        call = jax.jit(fn)
        try:
            jax.block_until_ready(call(*args[0]))   # compiled before the trace
            out[name] = trace_steps(f"{prefix}_{name}", lambda: [call(*args[i % len(args)])
                                                                 for i in range(PROFILE_STEPS)], PROFILE_STEPS)
        except Exception as e:  # the cell's timings stand without it
            log(f"  profile {name} FAILED: {type(e).__name__}: {e}")
            continue
        log(f"  profile {name}: " + json.dumps(out[name]))
    return out


def run(shapes: Iterable[MoEShape] = tuple(SHAPES.values()), tokens: Iterable[int] = TOKENS,
        formats: Sequence[str] | None = None, *, reps: int = 9, cpu: bool = False,
        log: Callable[[str], None] = print, on_records: Callable[[list[dict]], Any] | None = None,
        profile_dir: str | None = None) -> list[dict]:
    """Times every (shape, format, tokens) cell; returns the records (``on_records`` gets them all after
    every cell, so a run cut short keeps its rows).

    ``formats``: registered scheme names for every shape (default: each shape's ``formats``). ``cpu``: a
    plumbing check (one warm-up, no copies, no re-timing; the timings mean nothing). ``profile_dir``:
    also trace a few calls of ``quantized``, ``grouped_kernel`` and ``separate_gemms`` of each cell there
    (one folder each).
    """
    how = _How(reps=reps, warmup=1 if cpu else 3, retries=0 if cpu else 1, max_spread_pct=25.0,
               min_batch_s=1e-3 if cpu else 10e-3, max_copies=1 if cpu else 64,
               hbm_bytes_per_s=device_hbm_bytes_per_s(), meta=run_meta(), log=log,
               profile_dir=profile_dir)
    records: list[dict] = []
    key = jax.random.key(0)
    for shape in shapes:
        model = shape.model()
        bf16 = random_params(model, jax.random.fold_in(key, shape.num_experts))
        bf16_copies = _copies(bf16, how.max_copies)
        xs = {t: jax.random.normal(jax.random.fold_in(key, t), (t, shape.hidden), jnp.bfloat16) for t in tokens}
        for scheme in formats or shape.formats:
            try:
                qparams, _ = quantize_experts(bf16, scheme)
                q_copies = _copies(qparams, how.max_copies)
            except Exception as e:  # one failing format must not end the run
                log(f"  FAILED {shape.name} {scheme}: quantize: {type(e).__name__}: {e}")
                continue
            status, tok_copies = tokamax_status(scheme), []
            if status == "ok":
                try:
                    tok_copies = [tokamax_params(q) for q in q_copies]
                except Exception as e:  # recorded; the cell goes on without it
                    status = f"failed: {type(e).__name__}: {e}"[:200]
            user_copies = [prepare_experts(q) for q in q_copies]
            kernel_copies = []
            if _on_kernel(user_copies[0]) and not _activation_in_epilogue(user_copies[0]):
                kernel_copies = user_copies   # the user's layout is the kernel's: no second copy in memory
            elif dispatch.runs_mosaic_gpu():
                try:   # the grouped kernel for the format on the same weights (Hopper)
                    kernel_copies = [kernel_params(q) for q in q_copies]
                except Exception as e:
                    log(f"  grouped kernel skipped for {shape.name} {scheme}: {type(e).__name__}: {e}")
            for t in tokens:
                try:
                    records.append(_cell(shape, model, scheme, t, xs[t], bf16_copies, q_copies, tok_copies,
                                         status, how, kernel_copies, user_copies))
                except Exception as e:  # one failing cell must not end the run
                    log(f"  FAILED {shape.name} {scheme} T={t}: {type(e).__name__}: {e}")
                    continue
                if on_records is not None:
                    on_records(records)
            del qparams, q_copies, tok_copies, user_copies, kernel_copies   # before the next format's stacks are made
    return records


def _on_kernel(params: dict) -> bool:
    """Whether ``params``' experts are laid out for a grouped Mosaic GPU kernel."""
    return isinstance(params[EXPERT_PARAMS[0]], (W4A16Experts, Fp8Experts))


def _separate(params: dict) -> dict:
    """``params`` with each grouped GEMM run on its own (``SeparateGemms``)."""
    return {k: SeparateGemms(v) if k in EXPERT_PARAMS else v for k, v in params.items()}


def _activation_in_epilogue(params: dict) -> bool:
    """Whether the gate/up GEMM of ``params`` applies the layer's activation in its epilogue."""
    return getattr(params[EXPERT_PARAMS[0]], "gate_up", False)


def kernel_params(params: dict, interpret: bool = False) -> dict:
    """``params`` with every QExperts laid out for its grouped Mosaic GPU kernel: 4-bit weight-only
    experts for the grouped W4A16 kernel (``W4A16Experts``), W8A8 FP8 experts for the grouped FP8 GEMM
    (``Fp8Experts``); a ValueError for other formats."""
    def swap(q):
        if not isinstance(q, QExperts):
            return q
        if q.scheme.weight_only and q.scheme.weight.bits == 4:
            return W4A16Experts.from_qexperts(q, interpret)
        if not q.scheme.weight_only and q.scheme.weight.format == "fp8_e4m3":
            return Fp8Experts.from_qexperts(q, interpret)
        raise ValueError(f"no grouped kernel for {q.scheme.name!r} experts")

    return jax.tree.map(swap, params, is_leaf=lambda q: isinstance(q, QExperts))


def _cell(shape: MoEShape, model: MoE, scheme: str, t: int, x: jax.Array, bf16_copies: list, q_copies: list,
          tok_copies: list, status: str, how: _How, kernel_copies: list = (), user_copies: list = ()) -> dict:
    """Times one (shape, format, tokens) cell: the quantized layer and its baselines, interleaved.
    ``user_copies``: the parameters as ``prepare_experts`` lays them out (default ``q_copies``)."""
    apply = lambda p, x: model.apply({"params": p}, x)
    user_copies = list(user_copies) or q_copies
    cands = {"quantized": (apply, [(p, x) for p in user_copies]),
             "bf16_ragged_dot": (apply, [(p, x) for p in bf16_copies]),
             "dequant_ragged_dot": (lambda p, x: apply(dequantized(p), x), [(p, x) for p in q_copies])}
    if kernel_copies:
        cands["grouped_kernel"] = (apply, [(p, x) for p in kernel_copies])
        cands["separate_gemms"] = (apply, [(_separate(p), x) for p in kernel_copies])
    tokamax_impl, tokamax_refusals = None, {}
    for impl in ("mosaic", None) if tok_copies else ():  # its Mosaic GPU kernel, else its default chain
        copies = [tokamax_params(p, impl) for p in tok_copies]
        try:
            jax.block_until_ready(jax.jit(apply)(copies[0], x))
        except Exception as e:  # tokamax refuses this cell: recorded, the cell goes on
            status = f"failed: {type(e).__name__}: {e}"[:200]
            tokamax_refusals[impl or "default"] = status[len("failed: "):]
            continue
        cands["tokamax"], tokamax_impl, status = (apply, [(p, x) for p in copies]), impl or "default", "ok"
        break
    times, attempts, failed = _time_cell(cands, how)
    profile = (_profile(cands, times, f"{how.profile_dir}/{shape.name}_{scheme}_t{t}", how.log)
               if how.profile_dir else None)

    indices = model.apply({"params": bf16_copies[0]}, x, method=MoE.routing).indices
    active = int(jnp.unique(indices).size)
    qparams, bf16 = q_copies[0], bf16_copies[0]
    io_bytes = 2 * array_bytes(x)   # x in, y out (bf16)

    def floor_us(params) -> float:
        per_expert, rest = expert_bytes(params, shape.num_experts)
        return 1e6 * (active * per_expert + rest + io_bytes) / how.hbm_bytes_per_s

    if "tokamax" in failed:
        status = f"failed: {failed['tokamax']}"[:200]
    median = {name: timing.median_us for name, timing in times.items()}
    q = median.get("quantized")
    baselines = {name: round(median[name], 2)
                 for name in ("bf16_ragged_dot", "dequant_ragged_dot", "tokamax", "grouped_kernel", "separate_gemms")
                 if name in median}
    ratio = lambda name: round(median[name] / q, 3) if q and name in median else None
    per_expert, rest = expert_bytes(qparams, shape.num_experts)
    floor = floor_us(qparams)
    weight = qparams[EXPERT_PARAMS[0]].weight
    impl = "mgpu" if _on_kernel(user_copies[0]) else choose_impl(weight)
    record = dict(op="moe", bench="moe", **shape.describe(), tokens=t, format=scheme, weight_fmt=weight.fmt,
                  impl=impl, time_us=None if q is None else round(q, 2), baselines=baselines,
                  speedup_vs_bf16=ratio("bf16_ragged_dot"), speedup_vs_dequant=ratio("dequant_ragged_dot"),
                  grouped_kernel_speedup_vs_bf16=(round(median["bf16_ragged_dot"] / median["grouped_kernel"], 3)
                                                  if "grouped_kernel" in median and "bf16_ragged_dot" in median
                                                  else None),
                  tokamax=status, tokamax_impl=tokamax_impl, tokamax_refusals=tokamax_refusals, active_experts=active,
                  expert_bytes=round(per_expert), bytes_touched=round(active * per_expert + rest + io_bytes),
                  hbm_bytes_per_s=round(how.hbm_bytes_per_s), byte_floor_us=round(floor, 2),
                  bf16_byte_floor_us=round(floor_us(bf16), 2),
                  pct_of_byte_floor=None if q is None else round(100.0 * floor / q, 1),
                  expert_flops=shape.expert_flops(t),
                  tflop_per_s={name: round(shape.expert_flops(t) / us / 1e6, 1) for name, us in median.items()},
                  spread_pct=spread_pct(times["quantized"]) if q else None,
                  baseline_spread_pct={name: spread_pct(times[name]) for name in baselines},
                  attempt_spreads_pct=attempts, copies=len(q_copies), **how.meta)
    if failed:
        record["failed"] = failed
    if profile is not None:
        record["profile"] = profile
    how.log(f"  {shape.name:16s} {scheme:22s} T={t:<5d} {_us(q):>10s} us  bf16 "
            f"{_us(median.get('bf16_ragged_dot')):>10s}  x{record['speedup_vs_bf16']}  experts {active:3d}  "
            f"floor {record['byte_floor_us']:.1f} us" + (f"  FAILED {sorted(failed)}" if failed else ""))
    return record


def _us(value: float | None) -> str:
    return "failed" if value is None else f"{value:.1f}"


def _status_cell(status: str) -> str:
    """A table cell for a candidate's status: ``failed (out of memory)`` for an allocation failure, else
    the status's first line, cut short (the record keeps the whole message)."""
    if not status.startswith("failed"):
        return status
    if "RESOURCE_EXHAUSTED" in status or "Out of memory" in status:
        return "failed (out of memory)"
    return " ".join(status.split())[:60]


def to_markdown(records: list[dict]) -> str:
    """The records as a table: one row per (shape, format, tokens)."""
    head = ("| shape | format | tokens | experts hit | µs | bf16 ragged_dot µs | dequant+ragged_dot µs | "
            "tokamax µs | grouped kernel µs | separate GEMMs µs | vs bf16 | byte floor µs | % of floor | TFLOP/s | "
            "spread % |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in records:
        b, failed = r["baselines"], r.get("failed", {})
        tokamax = b.get("tokamax", _status_cell(r.get("tokamax", "")))
        spreads = [v for v in (r["spread_pct"], *r.get("baseline_spread_pct", {}).values()) if v is not None]
        # A candidate that did not run says why; a ratio against one that did not is "—".
        cell = lambda v, name=None: (v if v is not None else "—" if name is None
                                     else _status_cell(f"failed: {failed[name]}") if name in failed else "failed")
        rows.append(f"| {r['shape']} | {r['format']} | {r['tokens']} | {r['active_experts']}/{r['num_experts']} | "
                    f"{cell(r['time_us'], 'quantized')} | {cell(b.get('bf16_ragged_dot'), 'bf16_ragged_dot')} | "
                    f"{cell(b.get('dequant_ragged_dot'), 'dequant_ragged_dot')} | "
                    f"{tokamax} | {b.get('grouped_kernel', '')} | {b.get('separate_gemms', '')} | "
                    f"{cell(r['speedup_vs_bf16'])} | {r['byte_floor_us']} | "
                    f"{cell(r['pct_of_byte_floor'])} | {r.get('tflop_per_s', {}).get('quantized', '')} | "
                    f"{max(spreads, default='')} |")
    detail = "one MoE layer (router, top-k, grouped gate/up, activation, grouped down, combine), bf16 activations"
    return markdown_title("MoE layer benchmark", records, detail) + head + "\n".join(rows) + "\n"
