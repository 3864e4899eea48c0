"""Paged decode attention: the Pallas kernel (interpreted on CPU, compiled under JQUANT_TEST_GPU=1)
and the XLA path against a dense float64 computation on the contiguous, dequantized context."""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jquant.kernels.decode_attention import TuningConfig, decode_attention
from jquant.kernels.decode_attention.config import SHARED_BYTES, shared_bytes

FP8 = ml_dtypes.float8_e4m3fn


def _cache(rng, *, batch, hq, hkv, d, page_size, lengths, kind, extra_pages=3):
    """Random pool with shuffled block tables; pages no sequence owns hold NaN (bf16) or the
    largest code, so any read past a length shows."""
    max_pages = max(1, max(-(-n // page_size) for n in lengths))
    num_pages = batch * max_pages + extra_pages
    perm = rng.permutation(num_pages)
    bt = perm[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    x_k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    x_v = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    owned = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            owned[bt[b, t // page_size], t % page_size] = True
    if kind == "bf16":
        k = x_k.astype(ml_dtypes.bfloat16); v = x_v.astype(ml_dtypes.bfloat16)
        k[~owned] = np.nan; v[~owned] = np.nan
        ks = vs = None
        kf, vf = k.astype(np.float64), v.astype(np.float64)
    elif kind in ("fp8_tok", "int8_tok"):
        qmax = 448.0 if kind == "fp8_tok" else 127.0
        ks = (np.abs(x_k).max(-1) / qmax).astype(np.float32)
        vs = (np.abs(x_v).max(-1) / qmax).astype(np.float32)
        if kind == "fp8_tok":
            k = (x_k / ks[..., None]).astype(FP8); v = (x_v / vs[..., None]).astype(FP8)
            k[~owned] = FP8(448.0); v[~owned] = np.nan
        else:
            k = np.rint(x_k / ks[..., None]).astype(np.int8)
            v = np.rint(x_v / vs[..., None]).astype(np.int8)
            k[~owned] = 127; v[~owned] = 127
        ks[~owned] = np.nan; vs[~owned] = np.nan
        kf = k.astype(np.float64) * ks[..., None]; vf = v.astype(np.float64) * vs[..., None]
    elif kind == "fp8_tensor":
        ks, vs = np.float32(0.02), np.float32(0.03)
        k = (x_k * 20).astype(FP8); v = (x_v * 20).astype(FP8)
        v[~owned] = np.nan
        kf = k.astype(np.float64) * ks; vf = v.astype(np.float64) * vs
    q = rng.standard_normal((batch, hq, d)).astype(ml_dtypes.bfloat16)
    return q, k, v, bt, np.asarray(lengths, np.int32), ks, vs, kf, vf


def _dense(q, kf, vf, bt, lengths, page_size, scale):
    batch, hq, d = q.shape
    hkv = kf.shape[2]
    out = np.zeros((batch, hq, d))
    for b in range(batch):
        n = lengths[b]
        if n == 0:
            continue
        slots = [(bt[b, t // page_size], t % page_size) for t in range(n)]
        kk = np.stack([kf[p, s] for p, s in slots])          # [n, hkv, d]
        vv = np.stack([vf[p, s] for p, s in slots])
        for h in range(hq):
            g = h // (hq // hkv)
            logits = kk[:, g] @ q[b, h].astype(np.float64) * scale
            w = np.exp(logits - logits.max()); w /= w.sum()
            out[b, h] = w @ vv[:, g]
    return out


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


CASES = [  # (lengths, page_size, hq, hkv, d)
    ((0, 1, 16, 17, 40), 16, 8, 2, 64),
    ((5, 33, 0, 64), 8, 4, 4, 32),
    ((31, 32, 1), 32, 32, 8, 128),
]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("kind", ["bf16", "fp8_tok", "int8_tok", "fp8_tensor"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_dense(impl, kind, case, interpret):
    lengths, page_size, hq, hkv, d = CASES[case]
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=len(lengths), hq=hq, hkv=hkv, d=d,
                                             page_size=page_size, lengths=lengths, kind=kind)
    scale = 1 / math.sqrt(d)
    ref = _dense(q, kf, vf, bt, ln, page_size, scale)
    config = TuningConfig(block_tokens=32, num_splits=2)
    out = decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bt),
                           jnp.asarray(ln), k_scale=None if ks is None else jnp.asarray(ks),
                           v_scale=None if vs is None else jnp.asarray(vs), impl=impl,
                           config=config, interpret=interpret)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert _rel(out, ref) < 2e-2
    zero = ln == 0
    assert (np.asarray(out, np.float32)[zero] == 0).all()


@pytest.mark.parametrize("block_tokens,num_splits", [(16, 1), (16, 7), (64, None)])
def test_split_and_block_shapes_agree(block_tokens, num_splits, interpret):
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=3, hq=8, hkv=2, d=32, page_size=4,
                                             lengths=(0, 49, 100), kind="fp8_tok")
    ref = _dense(q, kf, vf, bt, ln, 4, 1 / math.sqrt(32))
    out = decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)), k_scale=jnp.asarray(ks),
                           v_scale=jnp.asarray(vs), impl="pallas", interpret=interpret,
                           config=TuningConfig(block_tokens=block_tokens, num_splits=num_splits))
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("kind", ["bf16", "fp8_tok", "int8_tok", "fp8_tensor"])
@pytest.mark.parametrize("case,heads", [(0, 2), (1, 4), (1, 2), (2, 4), (2, 8)])
def test_kv_heads_per_program_matches_dense(kind, case, heads, interpret):
    """Several KV heads per program (block-diagonal q): the same attention, every GQA group
    padded or not (case 2: 4 heads × 4 fill the 16 rows exactly; 8 × 4 take 32)."""
    lengths, page_size, hq, hkv, d = CASES[case]
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=len(lengths), hq=hq, hkv=hkv, d=d,
                                             page_size=page_size, lengths=lengths, kind=kind)
    ref = _dense(q, kf, vf, bt, ln, page_size, 1 / math.sqrt(d))
    config = TuningConfig(block_tokens=32, num_splits=2, kv_heads_per_program=heads)
    if shared_bytes(config, d, k.dtype.itemsize) > SHARED_BYTES:   # 8 bf16 heads of 128: one stage fits
        config = dataclasses.replace(config, num_stages=1)
    out = decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)),
                           k_scale=None if ks is None else jnp.asarray(ks),
                           v_scale=None if vs is None else jnp.asarray(vs), impl="pallas",
                           config=config, interpret=interpret)
    assert _rel(out, ref) < 2e-2
    assert (np.asarray(out, np.float32)[ln == 0] == 0).all()


def test_launches_past_shared_memory_are_refused_and_the_default_fits(interpret):
    """sm_90 gives a program 227 KB: four 128-token FP8 heads in two stages asked the H100 for 286720 bytes
    and failed to compile; such a launch is refused before it runs, naming the bytes. The default launch
    shrinks its steps until it fits (head_dim 256 in bf16: 128-token steps would need 278528 bytes)."""
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=2, hq=8, hkv=4, d=128, page_size=16,
                                             lengths=(40, 3), kind="fp8_tok")
    with pytest.raises(ValueError, match=r"needs ~286720 bytes of shared memory.*sm_90 has 232448"):
        decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)), k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs),
                         impl="pallas", config=TuningConfig(block_tokens=128, kv_heads_per_program=4),
                         interpret=interpret)
    assert shared_bytes(TuningConfig(), 256, 2) > SHARED_BYTES
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=2, hq=4, hkv=2, d=256, page_size=16,
                                             lengths=(150, 17), kind="bf16")
    out = decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)), impl="pallas", interpret=interpret)
    assert _rel(out, _dense(q, kf, vf, bt, ln, 16, 1 / 16)) < 2e-2


def test_a_nan_scale_stays_in_its_head(interpret):
    """Per-(token, head) scales reach each q row by a select: a NaN K scale of head 0 in a used
    token makes head 0's rows NaN and leaves its sibling head in the program finite."""
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=1, hq=8, hkv=2, d=32, page_size=4,
                                             lengths=(9,), kind="fp8_tok")
    ks[bt[0, 1], 2, 0] = np.nan
    out = np.asarray(decode_attention(
        *map(jnp.asarray, (q, k, v, bt, ln)), k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs),
        impl="pallas", config=TuningConfig(block_tokens=16, kv_heads_per_program=2),
        interpret=interpret), np.float32)
    assert np.isnan(out[0, :4]).all() and np.isfinite(out[0, 4:]).all()


@pytest.mark.parametrize("kind", ["fp8_tok", "fp8_tensor"])
@pytest.mark.parametrize("operand", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("q_mag,k_mag,v_mag", [(1e5, 1e-5, 1.0), (1e-7, 1e7, 1.0), (1.0, 1.0, 1e-6),
                                               (1.0, 1.0, 1e4)])
def test_operands_keep_the_range_of_q_and_scales(kind, operand, q_mag, k_mag, v_mag, interpret):
    """FP8 pages widen to float16 for the tensor cores (5 exponent bits, largest 65504, subnormal
    below 6.1e-5) unless told otherwise. q of 1e5 would overflow it and q of 1e-7 sink into its
    subnormals, and per-token V scales of ~1e-8 would flush every probability · scale to 0: each is
    scaled into range and back, so the result equals the float64 attention at any magnitude."""
    lengths, page_size, hq, hkv, d = (0, 1, 16, 17, 40), 16, 8, 2, 64
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=len(lengths), hq=hq, hkv=hkv, d=d,
                                             page_size=page_size, lengths=lengths, kind=kind)
    q = (q.astype(np.float32) * q_mag).astype(ml_dtypes.bfloat16)
    ks, vs = (ks * np.float32(k_mag)).astype(np.float32), (vs * np.float32(v_mag)).astype(np.float32)
    kf, vf = kf * np.float64(np.float32(k_mag)), vf * np.float64(np.float32(v_mag))
    ref = _dense(q, kf, vf, bt, ln, page_size, 1 / math.sqrt(d))
    out = decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)), k_scale=jnp.asarray(ks),
                           v_scale=jnp.asarray(vs), impl="pallas", interpret=interpret,
                           config=TuningConfig(block_tokens=32, num_splits=2, operand_dtype=operand))
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("operand", ["bfloat16", "float16"])
def test_a_non_finite_q_stays_in_its_row(operand, interpret):
    """An infinite or NaN q value of one head gives that head NaN and leaves the heads beside it in the
    program as they were: it does not steer the float16 prescale of the rows."""
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=2, hq=8, hkv=2, d=32, page_size=4,
                                             lengths=(9, 30), kind="fp8_tok")
    q[0, 1, 3], q[1, 4, 0] = np.inf, np.nan
    ref = _dense(q, kf, vf, bt, ln, 4, 1 / math.sqrt(32))
    out = np.asarray(decode_attention(
        *map(jnp.asarray, (q, k, v, bt, ln)), k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs),
        impl="pallas", config=TuningConfig(block_tokens=16, operand_dtype=operand), interpret=interpret),
        np.float64)
    bad = np.zeros((2, 8), bool)
    bad[0, 1] = bad[1, 4] = True
    assert not np.isfinite(out[bad]).any()
    assert _rel(out[~bad], ref[~bad]) < 2e-2


def test_operand_dtype_must_be_a_16_bit_float():
    with pytest.raises(ValueError, match="operand_dtype must be None or one of"):
        TuningConfig(operand_dtype="float8_e4m3fn")


def test_kv_heads_per_program_must_divide_the_kv_heads():
    a = _args()   # 2 KV heads
    with pytest.raises(ValueError, match="must divide the KV heads"):
        decode_attention(a["q"], a["k"], a["v"], a["bt"], a["ln"], impl="pallas", interpret=True,
                         config=TuningConfig(kv_heads_per_program=4))
    with pytest.raises(ValueError, match="power of two"):
        TuningConfig(kv_heads_per_program=3)


@pytest.mark.parametrize("kind", ["bf16", "fp8_per_token_head", "int8_per_token_head"])
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_lowers_for_cuda(kind, heads):
    """Llama-3-8B heads (32 / 8, d = 128), page 16, the heads per program the bench sweeps: the
    Triton lowering (3-D selects and reshapes of the block-diagonal path included) runs here."""
    from cuda_lowering import join_kwidth_hazards, triton_modules
    from jquant.kernels.decode_attention.paged_cache import cache_decode_attention
    from jquant.kv.paged import allocate

    layer = allocate(kind, 64, 16, 8, 128, k_scale=0.02, v_scale=0.02)
    bt = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    q, ln = jnp.zeros((2, 32, 128), jnp.bfloat16), jnp.full((2,), 500, jnp.int32)
    # the longest step that fits in shared memory (bf16 with 2 heads: 64 tokens)
    config = next(c for c in (TuningConfig(block_tokens=b, kv_heads_per_program=heads) for b in (128, 64, 32))
                  if shared_bytes(c, 128, layer.k_pages.dtype.itemsize) <= SHARED_BYTES)
    [ttir] = triton_modules(lambda *a: cache_decode_attention(*a, impl="pallas", config=config),
                            q, layer, bt, ln)
    assert join_kwidth_hazards(ttir) == []


def test_custom_scale_and_jit(interpret):
    rng = np.random.default_rng()
    q, k, v, bt, ln, ks, vs, kf, vf = _cache(rng, batch=2, hq=4, hkv=1, d=16, page_size=16,
                                             lengths=(20, 7), kind="bf16")
    ref = _dense(q, kf, vf, bt, ln, 16, 0.5)
    f = jax.jit(lambda *a: decode_attention(*a, scale=0.5, impl="pallas", interpret=interpret))
    assert _rel(f(*map(jnp.asarray, (q, k, v, bt, ln))), ref) < 2e-2


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("where", ["v", "k", "k_scale"])
def test_nan_in_a_used_token_is_not_hidden(impl, where, interpret):
    rng = np.random.default_rng()
    kind = "fp8_tok" if where == "k_scale" else "bf16"
    q, k, v, bt, ln, ks, vs, *_ = _cache(rng, batch=1, hq=2, hkv=1, d=16, page_size=4, lengths=(6,),
                                         kind=kind)
    if where == "v":
        v[bt[0, 1], 1, 0, 3] = np.nan
    elif where == "k":
        k[bt[0, 1], 1, 0, 3] = np.nan
    else:
        ks[bt[0, 1], 1, 0] = np.nan
    scales = {} if ks is None else dict(k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    out = np.asarray(decode_attention(*map(jnp.asarray, (q, k, v, bt, ln)), **scales, impl=impl,
                                      config=TuningConfig(block_tokens=16, num_splits=2),
                                      interpret=interpret), np.float32)
    assert np.isnan(out[0, :, 3] if where == "v" else out[0]).all()


def _args(**over):
    a = dict(q=jnp.zeros((2, 8, 32), jnp.bfloat16), k=jnp.zeros((6, 4, 2, 32), jnp.bfloat16),
             v=jnp.zeros((6, 4, 2, 32), jnp.bfloat16), bt=jnp.zeros((2, 3), jnp.int32),
             ln=jnp.array([3, 12], jnp.int32))
    a.update(over)
    return a


@pytest.mark.parametrize("over,msg", [
    (dict(q=jnp.zeros((2, 5, 32), jnp.bfloat16)), "multiple of KV heads"),
    (dict(q=jnp.zeros((2, 8, 16), jnp.bfloat16)), "head_dim"),
    (dict(ln=jnp.array([3, 13], jnp.int32)), "lengths"),
    (dict(bt=jnp.array([[0, 0, 0], [1, 6, 2]], jnp.int32)), "outside the pool"),
    (dict(bt=jnp.array([[-1, 0, 0], [1, 2, 3]], jnp.int32)), "outside the pool"),
    (dict(k=jnp.zeros((6, 4, 2, 32), jnp.int8), v=jnp.zeros((6, 4, 2, 32), jnp.int8)), "need"),
    (dict(bt=jnp.zeros((3, 3), jnp.int32)), "block_tables"),
])
def test_bad_input_is_refused(over, msg):
    a = _args(**over)
    with pytest.raises(ValueError, match=msg):
        decode_attention(a["q"], a["k"], a["v"], a["bt"], a["ln"], impl="xla")


def test_unused_table_entries_may_be_anything():
    a = _args(bt=jnp.array([[5, 99, -7], [1, 2, 3]], jnp.int32))   # seq 0 uses one page only
    decode_attention(a["q"], a["k"], a["v"], a["bt"], a["ln"], impl="xla")


def test_unknown_impl():
    a = _args()
    with pytest.raises(ValueError, match="impl"):
        decode_attention(a["q"], a["k"], a["v"], a["bt"], a["ln"], impl="cuda")


@pytest.mark.gpu
def test_auto_picks_the_kernel_on_gpu():
    from jquant.kernels.decode_attention import choose_impl
    a = _args()
    assert choose_impl(a["q"], a["k"]) == "pallas"
    assert choose_impl(a["q"].astype(jnp.float32), a["k"]) == "xla"   # 16-bit operands would round it
