"""What a quantized KV cache costs a real model: perplexity over a long context and greedy agreement.

Each ``kv_cache_dtype`` runs the unquantized model with its paged cache: the evaluation rows are
prefilled through the cache (every query attends over keys and values as the cache stores them, as in
token-by-token decoding), and a greedy continuation of each row's first tokens is compared with the
bf16 cache's continuation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jquant.apps.demo import nll_and_top1
from jquant.kv.cache import token_bytes
from jquant.kv.dtypes import kv_cache_spec
from jquant.models.llama import LlamaForCausalLM, generate, new_cache


@dataclasses.dataclass(frozen=True)
class KVQuality:
    kv_cache_dtype: str
    bytes_per_token: int        # K + V over every layer and KV head (bf16 layers included)
    ppl: float
    top1_agreement: float       # next-token argmax over the evaluated rows equal to the bf16 cache's
    greedy_agreement: float     # share of continuation tokens equal to the bf16 cache's (one early
                                # divergence changes every later token: a coarse figure)


def evaluate(model: LlamaForCausalLM, variables, ids, kv_cache_dtypes, *, prompt_len: int = 64,
             new_tokens: int = 32, log=lambda s: None) -> list[KVQuality]:
    """``ids [rows, T]``: perplexity of each row through a fresh cache of each dtype, its next-token
    argmax agreement with the bf16 cache's, and the greedy agreement of ``new_tokens`` after the row's
    first ``prompt_len`` tokens with the bf16 cache's continuation."""
    ids = jnp.asarray(ids, jnp.int32)
    rows, t = ids.shape

    @jax.jit
    def nll(variables, ids, cache):
        return nll_and_top1(model.apply(variables, ids, cache)[0], ids)

    reference = reference_top1 = None
    out = []
    for name in ("bf16",) + tuple(n for n in kv_cache_dtypes if kv_cache_spec(n).name != "bf16"):
        cache = new_cache(model, rows, t, name)
        loss, top1 = nll(variables, ids, cache)
        tokens = np.asarray(generate(model, variables, ids[:, :prompt_len], new_tokens, kv_cache_dtype=name))
        if reference is None:
            reference, reference_top1 = tokens, np.asarray(top1)
        ppl = float(jnp.exp(loss))
        c = model.config
        nbytes = token_bytes(name, num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        out.append(KVQuality(kv_cache_spec(name).name, nbytes, ppl,
                             float(np.mean(np.asarray(top1) == reference_top1)),
                             float(np.mean(tokens == reference))))
        log(f"{name}: PPL {ppl:.3f}")
    return out


def to_table(results: list[KVQuality], header: str) -> str:
    base = results[0]
    lines = [header, "", "| kv_cache_dtype | bytes / token | vs bf16 | PPL | ΔPPL | top-1 agreement | "
             "greedy agreement |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.kv_cache_dtype} | {r.bytes_per_token} | {base.bytes_per_token / r.bytes_per_token:.2f}× "
                     f"| {r.ppl:.3f} | {r.ppl - base.ppl:+.3f} | {r.top1_agreement:.1%} | {r.greedy_agreement:.1%} |")
    return "\n".join(lines) + "\n"
