"""The Llama model over a paged, quantized KV cache: equal to the dense cache in bf16, the prefill and
decode paths agree on every format, ragged batches continue at their own lengths, overflow is loud."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU

from jquant.kv import PagedCache, default_skip_layers
from jquant.models.llama import KVCache, LlamaConfig, LlamaForCausalLM, decode_step, generate, new_cache

CONFIG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=256)
MODEL = LlamaForCausalLM(CONFIG)
FORMATS = ["bf16", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "turboquant_k8v4",
           "turboquant_4bit_nc", "turboquant_3bit_nc"]


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    """On a GPU, float32 dots default to TF32 (~1e-3 relative): the comparisons below are of paths that
    must agree to float32 rounding, so they run at full precision there too."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="module")
def params():
    ids = jnp.zeros((1, 4), jnp.int32)
    # A fixed model: the error bounds below are for a chaotic random network, set with 2x margin.
    p = MODEL.init(jax.random.key(0), ids)
    # Larger than init's weights so attention is not uniform and the formats' errors show.
    return jax.tree.map(lambda a: a * 3.0, p)


def _ids(batch, length, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


def test_bf16_paged_equals_dense_cache(params):
    """A dense cache stored in bf16 rounds keys/values exactly as the bf16 pages do."""
    ids = _ids(2, 11, 0)
    dense = KVCache.zeros(CONFIG, 2, 32, jnp.bfloat16)
    paged = new_cache(MODEL, 2, 32, "bf16", page_size=8)
    lp, paged = MODEL.apply(params, ids[:, :7], paged)
    ld, dense = MODEL.apply(params, ids[:, :7], dense)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ld), atol=1e-4, rtol=1e-4)
    for t in range(7, 11):
        sp, paged = MODEL.apply(params, ids[:, t:t + 1], paged)
        sd, dense = MODEL.apply(params, ids[:, t:t + 1], dense)
        np.testing.assert_allclose(np.asarray(sp), np.asarray(sd), atol=2e-3, rtol=1e-3)  # sum order
    np.testing.assert_array_equal(np.asarray(paged.lengths), [11, 11])


@pytest.mark.parametrize("kv", FORMATS)
def test_prefill_equals_token_by_token_decode(params, kv):
    """Prefill attends over the cache as stored, so one call over the prompt scores like T decode steps."""
    ids = _ids(2, 9, 1)
    c1 = new_cache(MODEL, 2, 16, kv, page_size=4)
    whole, c1 = MODEL.apply(params, ids, c1)
    c2 = new_cache(MODEL, 2, 16, kv, page_size=4)
    steps = []
    for t in range(9):
        lg, c2 = MODEL.apply(params, ids[:, t:t + 1], c2)
        steps.append(lg[:, 0])
    steps = np.stack(steps, axis=1)
    assert np.isfinite(steps).all()
    np.testing.assert_allclose(np.asarray(whole), steps, atol=2e-3, rtol=2e-3)
    # The same codes, but for a rare flip where the batched and one-row projections round apart.
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        close = np.isclose(a, b, rtol=1e-2, atol=1e-2)
        assert close.mean() > 0.99, (kv, close.mean())


def _decode_logits(model, params, ids, kv):
    cache, steps, step = new_cache(model, 2, 16, kv, page_size=4), [], jax.jit(model.apply)
    for t in range(ids.shape[1]):
        logits, cache = step(params, ids[:, t:t + 1], cache)
        steps.append(np.asarray(logits[:, 0], np.float32))
    return np.stack(steps, axis=1)


def _attention_kernels(monkeypatch, on: bool):
    """The GPU policy with (``on``) or without the Triton-backend kernels; off a GPU they run interpreted."""
    from jquant.kernels.decode_attention import triton as kernel, triton_turboquant
    from jquant.kernels.kv_insert import api as insert_api
    from jquant.schemes import dispatch
    monkeypatch.setattr(dispatch, "runs_triton_pallas", lambda device=None: on)
    if on and not ON_GPU:
        monkeypatch.setattr(insert_api, "choose_impl", lambda spec: "xla")   # bit-exact with it on a GPU
        for module, name in ((kernel, "partials"), (triton_turboquant, "turboquant_decode_attention")):
            run = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, run=run, **k: run(*a, **{**k, "interpret": True}))


# Not TurboQuant: at this model's head_dim 16 its kernel does not run (XLA's reference does), and its
# 3-bit codes flip under any rounding upstream, so the distance to float32 measures the flips (on the
# H100 0.132 against 0.053 with the same attention path for the TurboQuant layer); its kernel is tested
# against the reference in tests/kernels/decode_attention/test_turboquant_kernel.py.
@pytest.mark.parametrize("kv", ["bf16", "int8_per_token_head", "fp8_per_token_head"])
def test_bf16_model_decodes_on_the_kernels_as_closely_as_on_xla(params, kv, monkeypatch):
    """A bf16 model's decode runs the 16-bit attention kernels on a GPU: it is as close to the float32
    model's over the same cache format as XLA's bf16 decode is. Interpreted on CPU, relative errors
    kernel / XLA: 0.0192 / 0.0197, 0.0355 / 0.0329, 0.0656 / 0.0660 (all three pass on the H100); an
    output 3 % too large (a wrong scale) fails the first two."""
    ids = _ids(2, 9, 1)
    want = _decode_logits(MODEL, params, ids, kv)
    bf16 = LlamaForCausalLM(CONFIG, dtype=jnp.bfloat16)
    _attention_kernels(monkeypatch, on=False)
    on_xla = _decode_logits(bf16, params, ids, kv)
    _attention_kernels(monkeypatch, on=True)
    on_kernel = _decode_logits(bf16, params, ids, kv)
    err = lambda got: np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(on_kernel).all() and (on_kernel != on_xla).any()   # the kernel path ran: it rounds apart
    assert err(on_kernel) < 1.2 * err(on_xla) + 2e-3, (err(on_kernel), err(on_xla))


def test_quantized_cache_error_follows_the_bits(params):
    ids = _ids(2, 12, 2)
    full = np.asarray(MODEL.apply(params, ids)[0])
    err = {}
    for kv in ("bf16", "int8_per_token_head", "fp8_per_token_head", "fp8", "turboquant_3bit_nc"):
        got, _ = MODEL.apply(params, ids, new_cache(MODEL, 2, 12, kv, page_size=4, skip_layers=()))
        err[kv] = np.linalg.norm(np.asarray(got) - full) / np.linalg.norm(full)
    assert err["bf16"] < 0.1 and err["int8_per_token_head"] < 0.2 and err["fp8_per_token_head"] < 0.4, err
    assert err["bf16"] < err["int8_per_token_head"] < err["fp8_per_token_head"] < err["turboquant_3bit_nc"], err


def test_ragged_batch_continues_each_sequence_at_its_own_length(params):
    a, b = _ids(1, 5, 3), _ids(1, 9, 4)
    cache = new_cache(MODEL, 2, 16, "int8_per_token_head", page_size=4)
    # Prefill each row separately into one batch cache: row 0 gets 5 tokens, row 1 gets 9.
    one = new_cache(MODEL, 1, 16, "int8_per_token_head", page_size=4)
    _, ca = MODEL.apply(params, a, one)
    _, cb = MODEL.apply(params, b, one)
    layers = tuple(jax.tree.map(lambda x, y, z: x.at[:4].set(y[:4]).at[4:].set(z[:4])
                                if x.ndim else x, full, la, lb)
                   for full, la, lb in zip(cache.layers, ca.layers, cb.layers))
    cache = PagedCache(layers, cache.block_tables, jnp.asarray([5, 9], jnp.int32))
    nxt = _ids(2, 1, 5)
    got, cache = MODEL.apply(params, nxt, cache)
    want_a, _ = MODEL.apply(params, nxt[:1], ca)
    want_b, _ = MODEL.apply(params, nxt[1:], cb)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want_a[0]), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want_b[0]), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [6, 10])


def _same_pages(before, after):
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        bits = lambda a: np.atleast_1d(np.asarray(a)).view(np.uint8)
        np.testing.assert_array_equal(bits(x), bits(y))


def test_overflow_raises_eagerly_and_is_nan_under_jit_writing_nothing(params):
    cache = new_cache(MODEL, 2, 8, "fp8_per_token_head", page_size=4)
    _, cache = MODEL.apply(params, _ids(2, 8, 6), cache)
    before = jax.tree.map(np.asarray, cache.layers)
    with pytest.raises(ValueError, match=r"sequence 0 would hold 9 tokens, past its 8 slots"):
        MODEL.apply(params, _ids(2, 1, 7), cache)
    logits, after = jax.jit(MODEL.apply)(params, _ids(2, 1, 7), cache)
    assert np.isnan(np.asarray(logits)).all()
    _same_pages(before, after.layers)


def test_decode_step_refuses_tokens_past_the_cache_before_donating_it(params):
    """decode_step reads the lengths first: a step past a sequence's end raises and the cache (not
    donated) stays usable; with check=False the step runs and the overflowing sequence's logits are NaN."""
    cache = new_cache(MODEL, 2, 8, "int8_per_token_head", page_size=4)
    _, cache = decode_step(MODEL, params, _ids(2, 6, 3), cache)
    with pytest.raises(ValueError, match=r"sequence 0 holds 6 tokens; 3 more do not fit the cache's 8"):
        decode_step(MODEL, params, _ids(2, 3, 4), cache)
    logits, _ = decode_step(MODEL, params, _ids(2, 3, 4), cache, check=False)
    assert np.isnan(np.asarray(logits)).all()


def test_a_dense_cache_refuses_tokens_past_its_end(params):
    """Eager: a ValueError, as for the paged cache; under jit (where XLA would clamp the write over the
    last tokens) NaN logits; a step that exactly fills the cache is fine."""
    cache = new_cache(MODEL, 1, 8)
    _, cache = MODEL.apply(params, _ids(1, 6, 3), cache)
    with pytest.raises(ValueError, match=r"sequence 0 holds 6 tokens; 3 more do not fit the cache's 8"):
        MODEL.apply(params, _ids(1, 3, 4), cache)
    with pytest.raises(ValueError, match=r"9 tokens do not fit the cache's 8"):
        jax.jit(MODEL.apply)(params, _ids(1, 9, 4), new_cache(MODEL, 1, 8))
    step = jax.jit(MODEL.apply)
    assert np.isnan(np.asarray(step(params, _ids(1, 3, 4), cache)[0])).all()
    assert np.isfinite(np.asarray(step(params, _ids(1, 2, 4), cache)[0])).all()


def _with(cache, block_tables=None, lengths=None):
    return PagedCache(cache.layers, jnp.asarray(cache.block_tables if block_tables is None else block_tables, jnp.int32),
                      jnp.asarray(cache.lengths if lengths is None else lengths, jnp.int32))


@pytest.mark.parametrize("new_tokens", [1, 3])   # the decode and the prefill path
def test_bad_tables_and_lengths_raise_before_any_write(params, new_tokens):
    cache = new_cache(MODEL, 2, 16, "int8_per_token_head", page_size=8)   # sequence b owns pages 2b, 2b + 1
    _, cache = MODEL.apply(params, _ids(2, 5, 9), cache)
    ids = _ids(2, new_tokens, 10)
    bt = np.asarray(cache.block_tables)
    for bad, match in (
            (_with(cache, lengths=[5, -2]), r"non-negative; sequence 1 has length -2"),
            (_with(cache, block_tables=np.stack([bt[0], [bt[0, 0], 3]])), r"page 0 is owned by sequences 0 and 1"),
            (_with(cache, block_tables=np.stack([bt[0], [9, 3]])), r"sequence 1 points at page 9, outside the pool")):
        with pytest.raises(ValueError, match=match):
            MODEL.apply(params, ids, bad)


def test_under_jit_a_negative_length_or_an_outside_page_is_nan_and_spares_the_cache(params):
    cache = new_cache(MODEL, 2, 16, "int8_per_token_head", page_size=8)   # sequence 1 owns pages 2 and 3
    _, cache = MODEL.apply(params, _ids(2, 5, 9), cache)
    step = jax.jit(MODEL.apply)
    bt = np.asarray(cache.block_tables)
    for bad in (_with(cache, lengths=[5, -2]), _with(cache, block_tables=np.stack([bt[0], [9, 3]]))):
        for new_tokens in (1, 3):   # -2 + 3 tokens reaches position 0: still not written
            logits, after = step(params, _ids(2, new_tokens, 10), bad)
            assert np.isnan(np.asarray(logits[1])).all() and np.isfinite(np.asarray(logits[0])).all()
            _same_pages([np.asarray(x)[bt[1]] for x in jax.tree.leaves(cache.layers) if np.ndim(x) >= 3],
                        [np.asarray(y)[bt[1]] for y in jax.tree.leaves(after.layers) if np.ndim(y) >= 3])


def _greedy(params, ids, cache, new_tokens):
    """``new_tokens`` greedy tokens after ``ids`` by a prefill and single steps over ``cache`` (generate's twin)."""
    step = jax.jit(MODEL.apply)
    logits, cache = step(params, ids, cache)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
        logits, cache = step(params, tokens[-1][:, None], cache)
    return np.stack(tokens, axis=1)


def test_generate_with_a_quantized_cache(params):
    ids = _ids(2, 6, 8)
    paged = generate(MODEL, params, ids, 5, kv_cache_dtype="int8_per_token_head", page_size=4)
    cache = new_cache(MODEL, 2, 11, "int8_per_token_head", page_size=4)
    np.testing.assert_array_equal(np.asarray(paged), _greedy(params, ids, cache, 5))
    tq = generate(MODEL, params, ids, 5, kv_cache_dtype="turboquant_3bit_nc")
    assert tq.shape == (2, 5) and (np.asarray(tq) >= 0).all()
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        generate(MODEL, params, ids, 2, kv_cache_dtype="fp4")


def test_generate_uses_a_checkpoints_static_scales(params):
    """k_scales / v_scales reach generate's fp8 pages (what kv_cache_settings reads from a checkpoint): its
    tokens are the loop's over new_cache with those scales, and scales that clip K change them."""
    ids = _ids(2, 6, 9)
    scales = dict(k_scales=[0.002, 0.5, 1.0, 2.0, 0.002], v_scales=[0.01, 0.25, 1.0, 4.0, 0.01])
    got = generate(MODEL, params, ids, 5, kv_cache_dtype="fp8", page_size=4, **scales)
    cache = new_cache(MODEL, 2, 11, "fp8", page_size=4, **scales)
    assert [float(layer.k_scale) for layer in cache.layers] == [np.float32(v) for v in scales["k_scales"]]
    np.testing.assert_array_equal(np.asarray(got), _greedy(params, ids, cache, 5))
    unit = generate(MODEL, params, ids, 5, kv_cache_dtype="fp8", page_size=4)
    assert (np.asarray(unit) != np.asarray(got)).any()   # K clipped at ±448 · 0.002: another attention
    with pytest.raises(ValueError, match="pass a kv_cache_dtype"):
        generate(MODEL, params, ids, 2, k_scales=[1.0] * 5)
    with pytest.raises(ValueError, match="one scale per layer"):
        generate(MODEL, params, ids, 2, kv_cache_dtype="fp8", k_scales=[1.0])


def test_decode_step_donates_the_cache(params):
    cache = new_cache(MODEL, 1, 8, "fp8", page_size=4)
    _, cache = decode_step(MODEL, params, _ids(1, 3, 9), cache)
    old = cache
    logits, cache = decode_step(MODEL, params, _ids(1, 1, 10), cache)
    assert logits.shape == (1, 1, CONFIG.vocab_size)
    assert int(cache.lengths[0]) == 4
    if jax.default_backend() != "cpu":   # CPU ignores donation
        assert old.layers[0].k_pages.is_deleted()


@pytest.mark.parametrize("model_dtype, cache_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                                      (jnp.bfloat16, jnp.float32)], ids=["bf16", "f32-on-bf16", "bf16-on-f32"])
def test_a_decode_step_on_the_dense_cache_copies_none_of_it(params, model_dtype, cache_dtype):
    """The dense cache is stored [B, Hkv, L, D], as its attention reads it: the step compiled for a donated
    cache writes the token in place and copies or transposes no cache-sized array (stored [B, L, Hkv, D],
    every layer's K and V were copied transposed; in a dtype other than the model's, XLA fused the
    update into the converted read too, so both needed the old cache and it was copied)."""
    cache = KVCache.zeros(CONFIG, 3, 80, cache_dtype)
    assert cache.keys[0].shape == (3, CONFIG.num_kv_heads, 80, CONFIG.head_dim) and cache.max_len == 80
    step = jax.jit(MODEL.clone(dtype=model_dtype).apply, donate_argnums=2)
    compiled = step.lower(params, _ids(3, 1, 11), cache).compile()
    text = compiled.as_text()
    moved = [line for line in text.splitlines() for shape in re.findall(r"= \w+\[([\d,]+)\]\S* (?:copy|transpose)\(", line)
             if sorted(map(int, shape.split(","))) == sorted(cache.keys[0].shape)]
    assert "dynamic-update-slice" in text and not moved, moved
    logits, cache = compiled(params, _ids(3, 1, 11), cache)  # and it runs
    assert int(cache.length) == 1 and np.isfinite(np.asarray(logits)).all()


def test_turboquant_keeps_boundary_layers_bf16():
    assert default_skip_layers("turboquant_3bit_nc", 5) == (0, 1, 3, 4)
    assert default_skip_layers("turboquant_3bit_nc", 3) == (0, 2)   # vLLM: at most layers // 2 each side
    assert default_skip_layers("fp8", 5) == ()
    cache = new_cache(MODEL, 1, 8, "turboquant_3bit_nc")
    assert cache.kv_cache_dtypes == ("bf16", "bf16", "turboquant_3bit_nc", "bf16", "bf16")
    with pytest.raises(ValueError, match="outside"):
        new_cache(MODEL, 1, 8, "turboquant_3bit_nc", skip_layers=(7,))


def test_a_cache_of_another_shape_is_refused(params):
    with pytest.raises(ValueError, match="batch 3 but the paged cache holds 2"):
        MODEL.apply(params, _ids(3, 1, 11), new_cache(MODEL, 2, 8, "fp8"))
    other = PagedCache.allocate("bf16", num_layers=CONFIG.num_layers, batch=1, max_len=8, kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="4 KV heads of 16; the model has 2 of 16"):
        MODEL.apply(params, _ids(1, 1, 12), other)
    short = PagedCache.allocate("bf16", num_layers=2, batch=1, max_len=8, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="2 layers, the model 5"):
        MODEL.apply(params, _ids(1, 1, 13), short)
    with pytest.raises(ValueError, match="positive"):
        PagedCache.allocate("bf16", num_layers=2, batch=0, max_len=8, kv_heads=2, head_dim=16)
