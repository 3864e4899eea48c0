"""The TurboQuant decode-attention kernel against ``attention_reference`` (interpreted on CPU, compiled under
JQUANT_TEST_GPU=1), its lowering for CUDA, and its routing from ``cache_decode_attention``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_lowering import join_kwidth_hazards, lower_for_cuda, triton_modules
from jquant.kernels.decode_attention import cache_decode_attention
from jquant.kernels.decode_attention.config import TuningConfig
from jquant.kernels.decode_attention.triton_turboquant import (centroid_poly, centroids, supports,
                                                               turboquant_decode_attention)
from jquant.kv import (KVCacheSpec, allocate, attention_reference, insert_reference, kv_cache_spec,
                       lloyd_max)

PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4")
CASES = [(16, 4, 128), (32, 1, 64)]   # (page_size, GQA group, head_dim)
MAX_PAGES, KV_HEADS = 3, 2


def _random_bytes(rng, a):
    """An array of a's shape and dtype holding random bytes: NaN and Inf side values, NaN fp8 codes."""
    a = np.asarray(a)
    return jnp.asarray(np.frombuffer(rng.bytes(a.nbytes), a.dtype).reshape(a.shape))


def _layer(rng, name, *, page_size, group, head_dim, extra_pages=3):
    """Sequences of lengths 0, 1, page, page + 1 and full in shuffled pages, filled by
    ``insert_reference``; every byte nobody wrote (pages no sequence owns, slots past a length) is
    random, and unused block-table entries point outside the pool."""
    lengths = np.array([0, 1, page_size, page_size + 1, MAX_PAGES * page_size], np.int32)
    batch = len(lengths)
    num_pages = batch * MAX_PAGES + extra_pages
    layer = allocate(name, num_pages, page_size, KV_HEADS, head_dim)
    layer = jax.tree.map(lambda a: a if a.ndim == 0 else _random_bytes(rng, a), layer)
    bt = rng.permutation(num_pages)[:batch * MAX_PAGES].reshape(batch, MAX_PAGES).astype(np.int32)
    slots = np.concatenate([bt[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for b, n in enumerate(lengths)]).astype(np.int32)
    k, v = rng.standard_normal((2, len(slots), KV_HEADS, head_dim)).astype(np.float32)
    layer = jax.jit(insert_reference)(layer, jnp.asarray(k), jnp.asarray(v * 0.5 + 0.3), jnp.asarray(slots))
    used = np.arange(MAX_PAGES)[None, :] < -(-lengths[:, None] // page_size)
    bt = np.where(used, bt, np.where(np.arange(MAX_PAGES) % 2, -3, num_pages + 5)).astype(np.int32)
    q = rng.standard_normal((batch, KV_HEADS * group, head_dim)).astype(np.float32) * 2
    return jnp.asarray(q), layer, jnp.asarray(bt), jnp.asarray(lengths)


def _reference(q, layer, bt, ln):
    return np.asarray(jax.jit(attention_reference)(q, layer, bt, ln))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(name, case, interpret):
    page_size, group, head_dim = case
    rng = np.random.default_rng([PRESETS.index(name), CASES.index(case)])
    q, layer, bt, ln = _layer(rng, name, page_size=page_size, group=group, head_dim=head_dim)
    ref = _reference(q, layer, bt, ln)
    config = TuningConfig(block_tokens=16, num_splits=2)   # several steps per split, a split past the end
    kernel = jax.jit(functools.partial(turboquant_decode_attention, config=config, interpret=interpret))
    out = np.asarray(kernel(q, layer, bt, ln))
    assert out.shape == q.shape and np.isfinite(out).all()
    assert (out[0] == 0).all()                             # length 0
    # fp16 q and centroids (2^-11) and bf16 p * scale in the value dot (2^-9) are the kernel's only
    # roundings (the logic matches to 1e-5 with fp32 dots); they move outputs ~0.3% of their range.
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()


def test_without_norm_correction(interpret):
    """Raw N(0, 1/d) centroids (no preset uses them; a KVCacheSpec may)."""
    spec = KVCacheSpec("tq4_raw", "turboquant", "lloyd_max", "uniform", 4, 4, norm_correction=False)
    q, layer, bt, ln = _layer(np.random.default_rng(7), spec, page_size=16, group=4, head_dim=64)
    ref = _reference(q, layer, bt, ln)
    kernel = jax.jit(functools.partial(turboquant_decode_attention, interpret=interpret))
    out = np.asarray(kernel(q, layer, bt, ln))
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("bits", [3, 4])
def test_centroid_polynomial_matches_the_table(bits):
    idx = jnp.arange(2**bits, dtype=jnp.uint32)
    got = np.asarray(centroids(2 * idx, bits, centroid_poly(bits)), np.float64)
    table = np.asarray(lloyd_max.unit_centroids(bits))
    assert np.abs(got / table - 1).max() < 1e-3


def _realistic(name, batch=2, ctx_pages=32, page_size=16):
    layer = allocate(name, batch * ctx_pages, page_size, 8, 128)
    bt = jnp.arange(batch * ctx_pages, dtype=jnp.int32).reshape(batch, ctx_pages)
    return jnp.zeros((batch, 32, 128), jnp.bfloat16), layer, bt, jnp.full((batch,), 500, jnp.int32)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("block_tokens", [64, 128, 256])
def test_lowers_for_cuda(name, block_tokens):
    """Every launch the bench sweeps (and the default, 128) at Llama-3-8B shapes, page 16."""
    config = TuningConfig(block_tokens=block_tokens)
    text = lower_for_cuda(lambda *a: turboquant_decode_attention(*a, config=config), *_realistic(name))
    assert "triton" in text


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("block_tokens", [16, 32, 128])
def test_no_dot_operand_gets_a_kwidth_its_k_cannot_hold(name, block_tokens):
    """Triton's MMA layout pass widens a dot operand built through a join (8-bit loads: kWidth 8,
    K ≥ 32); the value dot's K is the step's tokens, so 3-bit values are built without joins."""
    config = TuningConfig(block_tokens=block_tokens, num_splits=1)
    for ttir in triton_modules(lambda *a: turboquant_decode_attention(*a, config=config), *_realistic(name)):
        assert join_kwidth_hazards(ttir) == []


def test_the_kwidth_check_sees_a_join_behind_a_short_k():
    """The check itself: a value tile joined from two 8-bit halves along N, with K = 16 tokens."""
    from jax.experimental import pallas as pl

    def kernel(p_ref, v_ref, o_ref):
        lo, hi = (v_ref[:, pl.ds(j, 16, stride=2)].astype(jnp.uint32) for j in range(2))
        v = jnp.stack([lo, hi], axis=-1).reshape(16, 32).astype(jnp.float16)
        o_ref[...] = jax.experimental.pallas.triton.dot(p_ref[...], v)

    def fn(p, v):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32))(p, v)

    [ttir] = triton_modules(fn, jnp.zeros((16, 16), jnp.float16), jnp.zeros((16, 32), jnp.uint8))
    assert len(join_kwidth_hazards(ttir)) == 1


def _has_kernel(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_cache_decode_attention_routes_turboquant_to_the_kernel(interpret):
    q, layer, bt, ln = _layer(np.random.default_rng(0), "turboquant_k3v4_nc", page_size=16, group=4,
                              head_dim=64)
    q = q.astype(jnp.bfloat16)
    kernel = lambda *a: cache_decode_attention(*a, impl="pallas", interpret=interpret)
    xla = lambda *a: cache_decode_attention(*a, impl="xla")
    assert _has_kernel(kernel, q, layer, bt, ln) and not _has_kernel(xla, q, layer, bt, ln)
    out = jax.jit(kernel)(q, layer, bt, ln)
    ref = _reference(q, layer, bt, ln)
    assert out.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out, np.float32) - ref).max() <= 2e-2 * np.abs(ref).max()


def test_narrow_heads_fall_back_to_the_reference():
    """4-bit nibbles of head_dim 16 make 8-wide dot operands, below Triton's 16."""
    layer = allocate("turboquant_4bit_nc", 2, 16, 1, 16)
    q, bt, ln = jnp.ones((1, 2, 16)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    assert not supports(kv_cache_spec("turboquant_4bit_nc"), 16)
    with pytest.raises(ValueError, match="16 wide"):
        turboquant_decode_attention(q, layer, bt, ln)
    assert not _has_kernel(lambda *a: cache_decode_attention(*a), q, layer, bt, ln)


def test_unknown_impl():
    q, layer, bt, ln = _realistic("turboquant_3bit_nc")
    with pytest.raises(ValueError, match="impl"):
        cache_decode_attention(q, layer, bt, ln, impl="cuda")


@pytest.mark.parametrize("name,kernel_expected", [("turboquant_3bit_nc", True), ("turboquant_k3v4_nc", True),
                                                  ("turboquant_4bit_nc", True)])
def test_auto_on_a_gpu_runs_every_preset_on_the_kernel(monkeypatch, name, kernel_expected):
    from jquant.schemes import dispatch
    monkeypatch.setattr(dispatch, "decode_attention_impl", lambda device=None, query_dtype=None: "pallas")
    q, layer, bt, ln = _realistic(name)
    assert _has_kernel(lambda *a: cache_decode_attention(*a), q, layer, bt, ln) == kernel_expected


@pytest.mark.parametrize("name", ["bf16", "fp8", "int8_per_token_head", "turboquant_k8v4", "turboquant_3bit_nc"])
def test_auto_on_a_gpu_keeps_a_float32_query_off_the_16_bit_kernels(monkeypatch, name):
    """On a GPU that runs the kernels, a float32 model's decode attention is XLA's: the kernels' operands
    are 16-bit and would round the query and its probabilities."""
    from jquant.schemes import dispatch
    monkeypatch.setattr(dispatch, "runs_triton_pallas", lambda device=None: True)
    q, layer, bt, ln = _realistic(name)
    auto = lambda *a: cache_decode_attention(*a)
    assert _has_kernel(auto, q, layer, bt, ln)
    assert not _has_kernel(auto, q.astype(jnp.float32), layer, bt, ln)


def test_bad_tables_and_lengths_are_refused_before_the_kernel():
    q, layer, bt, ln = _realistic("turboquant_4bit_nc")
    with pytest.raises(ValueError, match="outside the pool"):
        cache_decode_attention(q, layer, bt.at[0, 0].set(layer.num_pages), ln)
    with pytest.raises(ValueError, match="lengths must lie"):
        cache_decode_attention(q, layer, bt, ln.at[0].set(-1))
    with pytest.raises(ValueError, match=r"lengths must be \["):
        cache_decode_attention(q, layer, bt, ln[:1])


def test_one_kv_head_per_program():
    q, layer, bt, ln = _realistic("turboquant_4bit_nc", ctx_pages=2)
    with pytest.raises(ValueError, match="one KV head per program"):
        turboquant_decode_attention(q, layer, bt, jnp.full((2,), 20, jnp.int32), interpret=True,
                                    config=TuningConfig(kv_heads_per_program=2))
