"""``quantize_params``: replace Dense kernels in a parameter tree by QParams, and MoE expert stacks by
QExperts, chosen by path rules.

Paths are the tree's keys joined by ``/`` (``layers_3/q_proj/kernel``; NNX: ``layers/3/q_proj/kernel``).
Rules are tried in order and the first whose regex fully matches a path wins (as in qwix); a rule whose
scheme is None keeps that path in float. Candidates are 2-D ``kernel`` leaves and 3-D expert stacks
(floating ``[E, N, K]`` leaves named ``gate_up_proj`` / ``down_proj``, as ``jquant.models.moe.MoE``
holds them; they become ``QExperts``, exactly what ``quantize_experts`` gives), so embeddings, norms,
routers and biases stay in float unless a model names an embedding ``kernel``; ``skip`` patterns
(default: anything with ``embed`` in its path) and predicates (e.g. a checkpoint config's ignore list,
``jquant.checkpoint.hf_checkpoint.skip_from_config``) are never quantized.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jquant.checkpoint.writer import path_str
from jquant.kernels.moe.experts import EXPERT_PARAMS, QExperts, is_expert_stack, quantize_expert_weights
from jquant.schemes.qparam import QParam
from jquant.qtensor import QTensor
from jquant.schemes.scheme import Scheme, get_scheme

DEFAULT_SKIP = (r".*embed.*",)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Quantize the kernels whose path ``pattern`` (a regex) fully matches with ``scheme`` (a name or a
    Scheme); None keeps them in float. ``quantize_params`` also takes ``(pattern, scheme)`` pairs.

    Examples:
      The first matching rule wins:

      >>> import numpy as np
      >>> from jquant.flax import Rule, quantize_params
      >>> params = {"q_proj": {"kernel": np.ones((64, 16), np.float32)},
      ...           "lm_head": {"kernel": np.ones((64, 16), np.float32)}}
      >>> _, report = quantize_params(params, [Rule(r"lm_head/kernel", None), Rule(r".*kernel", "int8_ch")])
      >>> report.quantized, report.kept
      ({'q_proj/kernel': 'int8_ch'}, ('lm_head/kernel',))
    """

    pattern: str
    scheme: str | Scheme | None


@dataclasses.dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_params`` did: the quantized paths with their scheme, the candidate kernels left in
    float, and the rules that matched nothing.

    Examples:
      >>> import numpy as np
      >>> from jquant.flax import quantize_params
      >>> params = {"q_proj": {"kernel": np.ones((64, 16), np.float32)},
      ...           "lm_head": {"kernel": np.ones((64, 16), np.float32)}}
      >>> _, report = quantize_params(params, [(r"q_proj/kernel", "int8_ch"), (r"v_proj/kernel", "int8_ch")],
      ...                             strict=False)
      >>> report.quantized, report.kept, report.unused_rules
      ({'q_proj/kernel': 'int8_ch'}, ('lm_head/kernel',), ('v_proj/kernel',))
    """

    quantized: dict[str, str]  # path → scheme name
    kept: tuple[str, ...]  # candidate kernels left in float
    unused_rules: tuple[str, ...]  # patterns that matched no path


def _as_rules(rules) -> tuple[Rule, ...]:
    if isinstance(rules, (str, Scheme)):
        return (Rule(r".*", rules),)  # every candidate: Dense kernels and expert stacks
    out = []
    for r in rules:
        if isinstance(r, Rule):
            out.append(r)
        elif isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str):
            out.append(Rule(r[0], r[1]))
        else:
            raise TypeError(f"each rule must be a Rule or a (regex, scheme) pair, got {r!r}")
    for r in out:
        try:
            re.compile(r.pattern)
        except re.error as e:
            raise ValueError(f"rule pattern {r.pattern!r} is not a valid regex: {e}") from e
        if r.scheme is not None:
            get_scheme(r.scheme)  # fail early on unknown names
    return tuple(out)


def _is_leaf(x) -> bool:
    return isinstance(x, (QParam, QTensor, QExperts))


def _check_skip(skip) -> tuple:
    if isinstance(skip, str) or callable(skip):
        skip = (skip,)
    for s in skip:
        if not (isinstance(s, str) or callable(s)):
            raise TypeError(f"each skip entry must be a regex or a predicate on paths, got {s!r}")
    return tuple(skip)


def _skipped(skip: tuple, name: str) -> bool:
    return any(s(name) if callable(s) else re.fullmatch(s, name) for s in skip)


def quantize_params(params: Any, rules: str | Scheme | Sequence, *,
                    skip: Sequence[str | Callable[[str], bool]] = DEFAULT_SKIP, prepare: bool = True,
                    strict: bool = True):
    """Returns ``(quantized_params, report)``.

    Args:
      params: a linen params dict or an NNX ``State`` (from ``nnx.split``); float kernels ``[K, N]``, and
        expert stacks ``[E, N, K]`` (PyTorch orientation per expert, ``jquant.models.moe.MoE``'s
        ``gate_up_proj`` / ``down_proj``), which become ``QExperts``.
      rules: a scheme name / Scheme (every candidate), or a sequence of ``(regex, scheme)`` pairs /
        ``Rule``s, first match wins; scheme None keeps a path in float.
      skip: regexes (full match) or predicates of paths never quantized (default: embeddings); add
        ``skip_from_config(quantization_config)`` to keep a config's ignored modules in float.
      prepare: lay weights out for this device's kernels (``process_weights_after_loading``); False keeps
        plain QTensors (for export and inspection). Expert stacks have no kernel layout yet (the grouped
        GEMM runs XLA's reference), so they are plain stacked QTensors either way.
      strict: raise when a rule matches no path (else it is only reported).

    Examples:
      >>> import numpy as np
      >>> from jquant.flax import quantize_params
      >>> rng = np.random.default_rng(0)
      >>> params = {"embed": {"embedding": rng.standard_normal((32, 64)).astype(np.float32)},
      ...           "q_proj": {"kernel": rng.standard_normal((64, 16)).astype(np.float32)},
      ...           "up_proj": {"kernel": rng.standard_normal((64, 16)).astype(np.float32),
      ...                       "bias": np.zeros(16, np.float32)}}
      >>> qparams, report = quantize_params(params, "int8_ch")  # every kernel
      >>> report.quantized
      {'q_proj/kernel': 'int8_ch', 'up_proj/kernel': 'int8_ch'}
      >>> [type(leaf).__name__ for leaf in (qparams["q_proj"]["kernel"], qparams["up_proj"]["bias"])]
      ['QParam', 'ndarray']
      >>> quantize_params(params, [(r".*v_proj/kernel", "int8_ch")])
      Traceback (most recent call last):
          ...
      ValueError: quantization rule(s) ['.*v_proj/kernel'] matched no parameter path; candidates were ...

      A MoE layer's expert stacks ``[E, N, K]`` are candidates too; they become ``QExperts``:

      >>> moe = {"router_weight": rng.standard_normal((4, 64)).astype(np.float32),   # E=4, H=64, I=32
      ...        "gate_up_proj": rng.standard_normal((4, 64, 64)).astype(np.float32),
      ...        "down_proj": rng.standard_normal((4, 64, 32)).astype(np.float32)}
      >>> qmoe, report = quantize_params({"moe": moe}, [(r".*gate_up_proj", "mxfp4"), (r".*down_proj", "int4_g32")])
      >>> report.quantized
      {'moe/down_proj': 'int4_g32', 'moe/gate_up_proj': 'mxfp4'}
      >>> type(qmoe["moe"]["gate_up_proj"]).__name__, qmoe["moe"]["gate_up_proj"].shape
      ('QExperts', (4, 64, 64))
    """
    rules = _as_rules(rules)
    skip = _check_skip(skip)
    used: set[int] = set()
    quantized: dict[str, str] = {}
    kept: list[str] = []

    def visit(path, leaf):
        name = path_str(path)
        kernel = (hasattr(leaf, "ndim") and leaf.ndim == 2 and name.split("/")[-1] == "kernel"
                  and jnp.issubdtype(leaf.dtype, jnp.floating))
        experts = not kernel and is_expert_stack(name, leaf)
        if not (kernel or experts) or _skipped(skip, name):
            return leaf
        for i, rule in enumerate(rules):
            if re.fullmatch(rule.pattern, name):
                used.add(i)
                if rule.scheme is None:
                    kept.append(name)
                    return leaf
                scheme = get_scheme(rule.scheme)
                if experts:  # quantize_expert_weights names the parameter in its errors
                    quantized[name] = scheme.name
                    return QExperts(quantize_expert_weights(leaf, scheme, name=f"parameter {name!r}"), scheme)
                try:
                    qw = scheme.quantize_kernel(leaf)
                except (ValueError, TypeError) as e:
                    # The scheme sees the [out, in] transpose of Flax's [in, out] kernel (vLLM's orientation),
                    # so its error names that shape: say which dimension is the kernel's input.
                    hint = (f" (the scheme quantizes the kernel's transpose, [out, in] = "
                            f"{tuple(leaf.shape[::-1])}, in groups along the input dimension {leaf.shape[0]})"
                            if leaf.ndim == 2 else "")
                    raise ValueError(f"parameter {name!r} (shape {tuple(leaf.shape)}) cannot be quantized "
                                     f"with scheme {scheme.name!r}: {e}{hint}") from e
                quantized[name] = scheme.name
                return QParam(scheme.process_weights_after_loading(qw) if prepare else qw, scheme)
        kept.append(name)
        return leaf

    out = jax.tree_util.tree_map_with_path(visit, params, is_leaf=_is_leaf)
    unused = tuple(r.pattern for i, r in enumerate(rules) if i not in used)
    if unused and strict:
        raise ValueError(f"quantization rule(s) {list(unused)} matched no parameter path; candidates were "
                         f"{sorted(quantized) + sorted(kept)} (2-D Dense kernels and [E, N, K] expert stacks "
                         f"named {'/'.join(EXPERT_PARAMS)})")
    return out, QuantizeReport(quantized, tuple(kept), unused)


def prepare_params(params: Any) -> Any:
    """Lays every QParam's QTensor out for this device's kernels (``quantize_params(prepare=True)`` does
    this itself; use it after inspecting or exporting ``prepare=False`` params).

    Examples:
      >>> import numpy as np
      >>> from jquant.flax import prepare_params, quantize_params
      >>> params = {"q_proj": {"kernel": np.ones((64, 16), np.float32)}}
      >>> qparams, _ = quantize_params(params, "int8_ch", prepare=False)
      >>> type(qparams["q_proj"]["kernel"].weight).__name__  # ready for to_checkpoint
      'QTensor'
      >>> type(prepare_params(qparams)["q_proj"]["kernel"].weight).__name__
      'Prepared'
    """
    def prepare(leaf):
        if isinstance(leaf, QParam) and isinstance(leaf.weight, QTensor):
            return dataclasses.replace(leaf, weight=leaf.scheme.process_weights_after_loading(leaf.weight))
        return leaf

    return jax.tree.map(prepare, params, is_leaf=_is_leaf)
