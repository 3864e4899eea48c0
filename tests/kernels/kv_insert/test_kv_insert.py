"""The quantize-and-insert kernel (interpreted on CPU, compiled under JQUANT_TEST_GPU=1) writes the
same bits as ``insert_reference`` for every kv_cache_dtype, leaves every other slot as it was, and
lowers for CUDA at a model's shapes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_lowering import lower_for_cuda
from jquant.kernels import kv_insert
from jquant.kernels.kv_insert import InsertConfig, insert
from jquant.kernels.kv_insert import triton as kernel
from jquant.kv import VALID_NAMES, allocate, insert_reference, kv_cache_spec
from jquant.schemes import dispatch


def _bits(a) -> np.ndarray:
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def assert_same_bits(out, ref):
    """Every leaf byte for byte (NaN payloads, -0.0 and fp8 codes included)."""
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _compiled(fn, *args):
    """fn(*args) jitted, with NaN carried through max and min as XLA defines them: XLA:CPU hands row
    reductions of 32+ rows to YNNPACK, which drops NaN (an all-NaN row's max is -inf), so both sides
    of a comparison compile without it (an option the GPU ignores)."""
    return jax.jit(fn).lower(*args).compile({"xla_cpu_experimental_ynn_fusion_type": ""})(*args)


def _old_cache(name, num_pages, page_size, kv_heads, head_dim, seed):
    """A cache of random bytes in every page and per-(token, head) side array, so a slot written
    by mistake, or one left unwritten, shows."""
    cache = allocate(name, num_pages, page_size, kv_heads, head_dim, k_scale=0.05, v_scale=0.07)
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(cache)

    def fill(a):
        if not a.ndim:
            return a
        b = rng.integers(0, 256, a.size * a.dtype.itemsize, np.uint8)
        if a.dtype == jnp.float8_e5m2:
            # XLA:CPU rewrites every e5m2 NaN to 0x7F whenever it copies such an array (the
            # reference does too): old contents hold Inf there instead.
            b = np.where(((b & 0x7C) == 0x7C) & (b & 3 > 0), b & 0xFC, b)
        return jnp.asarray(b.view(a.dtype).reshape(a.shape))

    return jax.tree.unflatten(tree, [fill(a) for a in leaves])


def _slots(rng, tokens, num_slots):
    """Distinct slots shuffled over the pool; some padding (-1) and past-the-pool ones, never written."""
    s = rng.permutation(num_slots)[:tokens].astype(np.int32)
    s[1::5] = -1
    s[3::11] = num_slots + 7 * np.arange(len(s[3::11]))
    return s


def _new_tokens(rng, live, kv_heads, head_dim, dtype):
    """Normal rows plus the edge cases, in K and in V of tokens that are written (``live``): zeros,
    -0.0, ±0 mixed, a NaN row, a lone NaN, ±Inf, huge and tiny magnitudes, .5 ties for int8 codes."""
    x = rng.standard_normal((2, len(live), kv_heads, head_dim)).astype(np.float32) * 3
    specials = [np.zeros(head_dim), -np.zeros(head_dim), np.where(np.arange(head_dim) % 2, 0.0, -0.0),
                np.full(head_dim, np.nan), np.r_[np.nan, np.ones(head_dim - 1)],
                np.r_[np.inf, rng.standard_normal(head_dim - 1)], np.r_[-np.inf, np.inf, np.zeros(head_dim - 2)],
                rng.standard_normal(head_dim) * 1e30, rng.standard_normal(head_dim) * 1e-30,
                np.r_[127.0, np.arange(head_dim - 1) % 7 - 2.5], np.abs(rng.standard_normal(head_dim))]
    written = [(t, h) for t in np.flatnonzero(live) for h in range(kv_heads)]
    for i, row in enumerate(specials):
        x[0][written[i % len(written)]] = row
        x[1][written[(i + 5) % len(written)]] = row
    return (jnp.asarray(a).astype(dtype) for a in x)


# (page_size, head_dim, kv_heads, tokens, input dtype, block_tokens)
CASES = [(16, 128, 2, 37, jnp.bfloat16, 16),
         (32, 64, 3, 1, jnp.bfloat16, 32),
         (16, 64, 1, 20, jnp.float32, 8)]


def _every_case(name: str) -> bool:
    """Aliases, and formats the kernel leaves to the reference, take case 0 only."""
    spec = kv_cache_spec(name)
    return spec.name == name and kernel.covers(spec, 64)


@pytest.mark.parametrize("name,case", [(n, c) for n in VALID_NAMES for c in range(len(CASES))
                                       if c == 0 or _every_case(n)])
def test_kernel_writes_the_references_bits(name, case, interpret):
    page_size, d, hkv, t, dtype, block = CASES[case]
    rng = np.random.default_rng(case)
    num_pages = -(-t // page_size) + 3
    cache = _old_cache(name, num_pages, page_size, hkv, d, seed=case)
    slots = _slots(rng, t, num_pages * page_size)
    k, v = _new_tokens(rng, (slots >= 0) & (slots < num_pages * page_size), hkv, d, dtype)
    slots = jnp.asarray(slots)
    ref = _compiled(insert_reference, cache, k, v, slots)
    out = _compiled(functools.partial(insert, impl="pallas", config=InsertConfig(block_tokens=block),
                                      interpret=interpret), cache, k, v, slots)
    assert_same_bits(out, ref)


@pytest.mark.parametrize("name", ["bf16", "fp8_e5m2", "int8_per_token_head", "turboquant_k8v4"])
def test_slots_not_addressed_keep_their_exact_old_contents(name, interpret):
    rng = np.random.default_rng(5)
    page_size, hkv, d, t = 16, 2, 64, 24
    cache = _old_cache(name, 6, page_size, hkv, d, seed=9)
    slots = _slots(rng, t, 6 * page_size)
    written = np.zeros(6 * page_size, bool)
    written[slots[(slots >= 0) & (slots < written.size)]] = True
    k, v = _new_tokens(rng, (slots >= 0) & (slots < written.size), hkv, d, jnp.bfloat16)
    # Under jit (concrete past-the-pool slots raise; test_rejects_bad_arguments).
    out = _compiled(functools.partial(insert, impl="pallas", interpret=interpret), cache, k, v, jnp.asarray(slots))
    assert written.any() and not written.all()
    for new, old in zip(jax.tree.leaves(out), jax.tree.leaves(cache)):
        if old.ndim:      # per-tensor scalars are read, never written
            flat = lambda a: _bits(a).reshape(written.size, -1)
            np.testing.assert_array_equal(flat(new)[~written], flat(old)[~written])
            assert (flat(new)[written] != flat(old)[written]).any()
        else:
            np.testing.assert_array_equal(_bits(new), _bits(old))


COVERED = [n for n in VALID_NAMES if kernel.covers(kv_cache_spec(n), 128) and kv_cache_spec(n).name == n]


def test_covered_formats():
    assert COVERED == ["bf16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head",
                       "turboquant_k8v4"]
    assert not kernel.covers(kv_cache_spec("bf16"), 96)
    assert not kernel.covers(dataclasses.replace(kv_cache_spec("turboquant_k8v4"), value_bits=3), 128)


@pytest.mark.parametrize("tokens", [32768, 8])
@pytest.mark.parametrize("name", COVERED)
def test_lowers_for_cuda_at_llama3_8b_shapes(name, tokens):
    """8 KV heads, head_dim 128, page 16, a pool twice the tokens: one Triton call, no XLA scatter."""
    cache = jax.eval_shape(lambda: allocate(name, 2 * -(-tokens // 16), 16, 8, 128))
    new = jax.ShapeDtypeStruct((tokens, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    text = lower_for_cuda(functools.partial(insert, impl="pallas"), cache, new, new, slots)
    assert text.count("__gpu$xla.gpu.triton") == 1 and f"jquant_kv_insert_{name}" in text
    assert "scatter" not in text


def test_uncovered_formats_and_empty_inserts_run_the_reference():
    cache = allocate("turboquant_3bit_nc", 2, 16, 1, 64)
    new = jax.ShapeDtypeStruct((4, 1, 64), jnp.bfloat16)
    text = lower_for_cuda(functools.partial(insert, impl="pallas"), cache, new, new,
                          jax.ShapeDtypeStruct((4,), jnp.int32))
    assert "triton" not in text and "scatter" in text
    empty = jnp.zeros((0, 1, 64), jnp.bfloat16)
    out = insert(allocate("fp8", 2, 16, 1, 64), empty, empty, jnp.zeros((0,), jnp.int32), impl="pallas")
    assert_same_bits(out, allocate("fp8", 2, 16, 1, 64))


@pytest.mark.parametrize("name,pages,kernel_runs", [("fp8", 2**17, True), ("fp8", 2**17 + 1, False),
                                                     ("bf16", 2**17 + 1, True)])
def test_pools_that_int32_offsets_would_wrap_run_the_reference(name, pages, kernel_runs):
    """Pallas indexes arrays up to 4 GiB with int32 element offsets: 1-byte pools past 2**31 bytes
    (2**17 pages of 16 x 8 x 128) go to the reference. Shapes only: nothing is allocated."""
    cache = jax.eval_shape(lambda: allocate(name, pages, 16, 8, 128))
    new = jax.ShapeDtypeStruct((8, 8, 128), jnp.bfloat16)
    text = lower_for_cuda(functools.partial(insert, impl="pallas"), cache, new, new,
                          jax.ShapeDtypeStruct((8,), jnp.int32))
    assert ("jquant_kv_insert" in text) == kernel_runs


def test_rejects_bad_arguments():
    cache = allocate("fp8", 2, 16, 2, 64)
    x = jnp.zeros((3, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl"):
        insert(cache, x, x, jnp.zeros(3, jnp.int32), impl="triton")
    with pytest.raises(ValueError, match=r"\[T, 2, 64\]"):
        insert(cache, x, jnp.zeros((3, 2, 32)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"slots must be \[3\]"):
        insert(cache, x, x, jnp.zeros(4, jnp.int32))
    for run in (insert, functools.partial(insert, impl="xla"), insert_reference):
        # A slot past the pool was dropped silently; float slots were truncated to integers.
        with pytest.raises(ValueError, match=r"slot 32 \(token 2\) is past the pool's 32 slots"):
            run(cache, x, x, jnp.array([0, -1, 32], jnp.int32))
        with pytest.raises(TypeError, match="slots must be integers"):
            run(cache, x, x, jnp.array([0.5, 1.7, 2.2]))
    with pytest.raises(ValueError, match="power of two"):
        InsertConfig(block_tokens=24)


@pytest.mark.parametrize("capability,name,want", [(90, "fp8", "pallas"), (80, "fp8", "xla"),
                                                  (90, "bf16", "pallas"), (80, "bf16", "pallas"),
                                                  (90, "int8_per_token_head", "pallas"),
                                                  (80, "int8_per_token_head", "pallas"),
                                                  (90, "fp8_per_token_head", "pallas"),
                                                  (80, "fp8_per_token_head", "xla"),
                                                  (90, "turboquant_k8v4", "pallas"),
                                                  (90, "turboquant_3bit_nc", "xla"),
                                                  (80, "fp8_e5m2", "pallas"), (0, "bf16", "xla")])
def test_choose_impl(monkeypatch, capability, name, want):
    monkeypatch.setattr(dispatch, "runs_triton_pallas", lambda device=None: capability >= 80)
    monkeypatch.setattr(dispatch, "compute_capability", lambda device=None: capability)
    assert kv_insert.choose_impl(kv_cache_spec(name)) == want


def test_choose_impl_on_this_machine_matches_the_attention_policy():
    want = dispatch.decode_attention_impl()
    assert kv_insert.choose_impl(kv_cache_spec("bf16")) == want
