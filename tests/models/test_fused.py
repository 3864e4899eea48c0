"""Fused q/k/v and gate/up projections: the fused model computes what the unfused one does, fused
quantized weights are exactly those of quantizing the fused float kernel, per-tensor FP8 parts are
requantized at their largest scale as vLLM does, and other weights whose scales span the parts are
refused by name."""

import chex
import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

from jquant.checkpoint.hf_checkpoint import PROJECTIONS, hf_module_name
from jquant.flax.linen import quantized_apply
from jquant.flax.rules import prepare_params, quantize_params
from jquant.formats.fp8 import quantize_fp8
from jquant.models.fused import fuse_projections, requantize_to_max_scale
from jquant.models.llama import LlamaConfig, LlamaForCausalLM, decode_step, new_cache

CONFIG = LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=128)
UNFUSED = LlamaForCausalLM(CONFIG)
FUSED = LlamaForCausalLM(CONFIG, fused_projections=True)


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="module")
def params():
    return UNFUSED.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))


def _ids(batch, length, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


def test_fused_tree_matches_the_fused_model(params):
    fused = fuse_projections(params)
    want = jax.eval_shape(FUSED.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    chex.assert_trees_all_equal_shapes(fused, want)
    layer = fused["params"]["layers_0"]
    k = params["params"]["layers_0"]
    # Order along N: q, k, v then gate, up (the model splits in that order).
    np.testing.assert_array_equal(layer["qkv_proj"]["kernel"][:, 256:384], k["k_proj"]["kernel"])
    np.testing.assert_array_equal(layer["gate_up_proj"]["kernel"][:, 384:], k["up_proj"]["kernel"])
    assert fuse_projections(fused) == fused  # already fused: unchanged


def test_fused_float_model_equals_unfused(params):
    ids = _ids(2, 9, 0)
    fused = fuse_projections(params)
    want, _ = UNFUSED.apply(params, ids)
    got, _ = FUSED.apply(fused, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scheme", ["int4_g128", "fp8_e4m3_channel", "int8_ch", "mxfp4"])
def test_fusing_quantized_parts_equals_quantizing_the_fused_kernel(params, scheme):
    parts, _ = quantize_params(params["params"], [(PROJECTIONS, scheme)], prepare=False)
    fused_after, _ = quantize_params(fuse_projections(params["params"]), [(PROJECTIONS, scheme)], prepare=False)
    chex.assert_trees_all_equal(fuse_projections(parts), fused_after)


def test_quantized_fused_decode_step_equals_unfused(params):
    """The decode step people run (paged int8 cache, int4 weights, donated) gives the same logits fused."""
    ids = _ids(2, 6, 3)
    q_unfused, _ = quantize_params(params["params"], [(PROJECTIONS, "int4_g128")], prepare=False)
    q_fused = prepare_params(fuse_projections(q_unfused))
    q_unfused = prepare_params(q_unfused)
    outs = []
    for model, p in ((UNFUSED, q_unfused), (FUSED, q_fused)):
        cache = new_cache(model, 2, 16, "int8_per_token_head", page_size=4)
        _, cache = quantized_apply(model, {"params": p}, ids[:, :5], cache)
        logits, _ = decode_step(model, {"params": p}, ids[:, 5:], cache)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def _vllm_requantize(parts):
    """vLLM's requantize_with_max_scale, step by step in numpy: codes.to(float16) * scale (the float32
    scale cast to float16 by the CUDA multiply), then sat(x * (1 / max scale)) to e4m3."""
    scales = [np.float32(np.asarray(p.scale).reshape(())) for p in parts]
    top = max(scales)
    out = []
    for p, s in zip(parts, scales):
        dq = (np.asarray(p.data).astype(np.float32) * np.float32(np.float16(s))).astype(np.float16)
        q = np.clip(dq.astype(np.float32) * (np.float32(1.0) / top), -448, 448)
        out.append(q.astype(ml_dtypes.float8_e4m3fn))
    return np.concatenate(out), top


def test_per_tensor_fp8_parts_fuse_at_their_largest_scale(params):
    """q, k, v quantized per tensor have three scales; one GEMM takes one, so each part is requantized at
    the largest, as vLLM loads such checkpoints: the codes are vLLM's bit for bit, the part at the max
    scale keeps its own, the others move by at most half an e4m3 step, and the fused model's logits
    stay those of the separate projections to within that rounding."""
    parts, _ = quantize_params(params["params"], [(PROJECTIONS, "fp8_e4m3_tensor")], prepare=False)
    fused = fuse_projections(parts)
    layer = parts["layers_0"]
    names = ("q_proj", "k_proj", "v_proj")
    weights = [layer[n]["kernel"].weight for n in names]
    got = fused["layers_0"]["qkv_proj"]["kernel"].weight
    want, top = _vllm_requantize(weights)
    assert len({float(np.asarray(w.scale).reshape(())) for w in weights}) == 3   # the parts differ
    np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), want.view(np.uint8))
    assert float(np.asarray(got.scale).reshape(())) == top and got.shape == (512, 256)
    rows = np.cumsum([0] + [w.shape[0] for w in weights])
    for w, a, b in zip(weights, rows[:-1], rows[1:]):
        before = np.asarray(w.data).astype(np.float32) * np.float32(np.asarray(w.scale).reshape(()))
        after = np.asarray(got.data[a:b]).astype(np.float32) * top
        if float(np.asarray(w.scale).reshape(())) == top:
            np.testing.assert_array_equal(np.asarray(got.data[a:b]).view(np.uint8), np.asarray(w.data).view(np.uint8))
        assert (np.abs(after - before) <= np.maximum(np.abs(before) * 2.0 ** -4, top * 2.0 ** -10)).all()
    ids = _ids(2, 7, 3)
    want_logits, _ = quantized_apply(UNFUSED, {"params": prepare_params(parts)}, ids)
    got_logits, _ = quantized_apply(FUSED, {"params": prepare_params(fused)}, ids)
    float_logits, _ = UNFUSED.apply(params, ids)
    requantized = np.linalg.norm(np.asarray(got_logits) - np.asarray(want_logits))
    quantized = np.linalg.norm(np.asarray(want_logits) - np.asarray(float_logits))
    assert requantized <= quantized   # requantizing costs less than quantizing did


@pytest.mark.parametrize("code, scale, want, not_want", [
    (0.0234375, 0.45825195, 0.01171875, 0.009765625),  # a float16 scale: the product's float16 rounding
    (0.34375, 0.7730898, 0.25, 0.28125),  # the scale in float16 (0.77295) is what CUDA multiplies by
])
def test_requantizing_rounds_as_vllm_on_cuda(code, scale, want, not_want):
    """Cells where the float16 steps decide the code: the dequantized value is rounded to float16, and
    the scale is cast to float16 before the multiply (PyTorch's CUDA kernels; float32 arithmetic gives
    ``not_want``). The other part holds the max scale, 1.0."""
    base = quantize_fp8(jnp.ones((1, 2), jnp.float32), granularity="tensor")
    part = base.replace(data=jnp.full((1, 2), code, jnp.float8_e4m3fn), scale=jnp.full((1, 1), scale, jnp.float32))
    unit = base.replace(data=jnp.ones((1, 2), jnp.float8_e4m3fn), scale=jnp.ones((1, 1), jnp.float32))
    fused = requantize_to_max_scale([part, unit])
    assert float(fused.data[0, 0]) == want != not_want
    assert float(fused.scale.reshape(())) == 1.0 and (np.asarray(fused.data[1]).astype(np.float32) == 1).all()


def test_requantizing_never_flushes_a_tiny_scale():
    """Scales below float16's smallest value (weights of ~1e-6: scales ~1e-8) would be flushed to 0 by
    vLLM's float16 dequantization, and every weight with them; here such parts are dequantized in
    float32, so they survive the requantization within half an e4m3 step."""
    rng = np.random.default_rng()
    parts = [quantize_fp8(jnp.asarray(rng.standard_normal((8, 16)) * m, jnp.float32), granularity="tensor")
             for m in (1e-6, 2e-6)]
    scales = [float(np.asarray(p.scale).reshape(())) for p in parts]
    assert max(scales) < 2.0 ** -24 and not _vllm_requantize(parts)[0].astype(np.float32).any()
    both = requantize_to_max_scale(parts)
    top = max(scales)
    for p, s, rows in zip(parts, scales, (slice(0, 8), slice(8, 16))):
        before = np.asarray(p.data).astype(np.float32) * s
        after = np.asarray(both.data[rows]).astype(np.float32) * top
        assert (np.abs(after - before) <= np.maximum(np.abs(before) * 2.0 ** -4, top * 2.0 ** -10)).all()


def test_requantizing_refuses_bad_scales_and_keeps_zero_ones_zero():
    """A NaN, infinite or negative part scale is refused (its max would make every fused code NaN or flip
    signs); parts whose scales are all 0 (all-zero weights) stay zeros, not 0 / 0 = NaN."""
    base = quantize_fp8(jnp.ones((2, 4), jnp.float32), granularity="tensor")
    for bad in (np.nan, np.inf, -0.5):
        with pytest.raises(ValueError, match="must be finite and ≥ 0"):
            requantize_to_max_scale([base, base.replace(scale=jnp.full((1, 1), bad, jnp.float32))])
    zero = base.replace(scale=jnp.zeros((1, 1), jnp.float32))
    fused = requantize_to_max_scale([zero, zero])
    assert fused.shape == (4, 4) and not np.asarray(fused.data).astype(np.float32).any()
    assert float(fused.scale.reshape(())) == 0.0


def test_per_tensor_parts_of_different_formats_are_refused():
    x = jnp.ones((4, 8), jnp.float32)
    a = quantize_fp8(x, "fp8_e4m3", granularity="tensor").replace(k_axis=1)
    b = quantize_fp8(x, "fp8_e5m2", granularity="tensor").replace(k_axis=1)
    from jquant.models.fused import _concat_qtensors
    with pytest.raises(ValueError,
                       match=r"here/qkv_proj: requantizing needs per-tensor FP8 parts \[N_i, K\] of one format"):
        _concat_qtensors([a, b], "here/qkv_proj")


@pytest.mark.parametrize("scheme, match", [("nvfp4", "global scale"),
                                           ("nf4_dq", "nested scales")])
def test_parts_sharing_a_scale_are_refused(params, scheme, match):
    parts, _ = quantize_params(params["params"], [(PROJECTIONS, scheme)], prepare=False)
    with pytest.raises(ValueError, match=match) as err:
        fuse_projections(parts)
    assert "layers_0/qkv_proj" in str(err.value)


def test_block_scales_fuse_only_when_the_parts_align(params):
    parts, _ = quantize_params(params["params"], [(PROJECTIONS, "fp8_e4m3_block128x128")], prepare=False)
    fused = fuse_projections(parts)  # q 256, k 128, v 128 rows: 128-row blocks line up
    assert fused["layers_0"]["qkv_proj"]["kernel"].weight.shape == (512, 256)
    small = jax.tree.map(lambda a: a[:, :64] if a.ndim == 2 and a.shape[1] == 128 else a, params["params"])
    parts, _ = quantize_params(small, [(PROJECTIONS, "fp8_e4m3_block128x128")], prepare=False)
    with pytest.raises(ValueError, match="span the output rows"):
        fuse_projections(parts)


def test_refusals_name_the_layer(params):
    p = params["params"]
    prepared, _ = quantize_params(p, [(PROJECTIONS, "int4_g128")])
    with pytest.raises(ValueError, match="fuse before preparing"):
        fuse_projections(prepared)
    mixed, _ = quantize_params(p, [(r"layers_\d+/q_proj/kernel", "int4_g128")], prepare=False)
    with pytest.raises(ValueError, match="layers_0/qkv_proj: some parts are quantized"):
        fuse_projections(mixed)
    two, _ = quantize_params(p, [(r"layers_\d+/q_proj/kernel", "int4_g128"), (PROJECTIONS, "int8_ch")],
                             prepare=False)
    with pytest.raises(ValueError, match="different schemes"):
        fuse_projections(two)
    partial = {**p, "layers_0": {k: v for k, v in p["layers_0"].items() if k != "v_proj"}}
    with pytest.raises(ValueError, match="layers_0 has only some"):
        fuse_projections(partial)
    with pytest.raises(ValueError, match="fused projection"):
        hf_module_name("layers_0/qkv_proj")
