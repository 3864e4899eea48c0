"""HF-style safetensors checkpoints of the Llama model, float or quantized in a vLLM layout.

``save_hf_checkpoint`` writes ``model.safetensors`` with HF's Llama tensor names (projections as the
scheme's checkpoint layout stores them, e.g. ``...q_proj.qweight``) and a ``config.json`` carrying the
``quantization_config``; ``load_hf_checkpoint`` reads such a directory back into Flax params whose
quantized projections are QParams, bit-identical to what was saved.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jquant.checkpoint import from_checkpoint
from jquant.checkpoint.hf_config import quant_method, skipped_modules
from jquant.checkpoint.module_scheme import module_scheme
from jquant.checkpoint.writer import tensor_separator
from jquant.schemes.qparam import QParam
from jquant.schemes.scheme import Scheme

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Flax paths of the seven projections of every layer (or of their fused forms, jquant.models.fused): what the
# demo, ledger, benchmarks and online loading quantize.
PROJECTIONS = r"layers_\d+/(q|k|v|o|gate|up|down|qkv|gate_up)_proj/kernel"


def hf_module_name(flax_module: str) -> str:
    """``layers_3/q_proj`` → ``model.layers.3.self_attn.q_proj`` (and the other Llama modules)."""
    m = re.fullmatch(r"layers_(\d+)/(\w+)", flax_module)
    if m:
        layer, name = m.groups()
        group = "self_attn" if name in _ATTN else "mlp" if name in _MLP else None
        sub = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}.get(name)
        if group:
            return f"model.layers.{layer}.{group}.{name}"
        if sub:
            return f"model.layers.{layer}.{sub}"
        if name in ("qkv_proj", "gate_up_proj"):
            raise ValueError(f"{flax_module!r} is a fused projection, which HF Llama checkpoints do not hold; "
                             "save the parameters from before fuse_projections")
    fixed = {"embed_tokens": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
    if flax_module in fixed:
        return fixed[flax_module]
    raise ValueError(f"no HF Llama name for Flax module {flax_module!r}")


def skip_from_config(quantization_config: dict) -> Callable[[str], bool]:
    """A ``quantize_params`` skip predicate on Flax paths (``layers_0/down_proj/kernel``): True where the
    config's ignore list keeps the HF module (``model.layers.0.mlp.down_proj``) in float."""
    skipped = skipped_modules(quantization_config)

    def skip(path: str) -> bool:
        try:
            return skipped(hf_module_name(path.rsplit("/", 1)[0]))
        except ValueError:  # not a Llama module: no HF name to match
            return False
    return skip


def _flat(params: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in params.items():
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flat(v, path))
        else:
            out[path] = v
    return out


def layout_meta(scheme: Scheme) -> dict:
    """The ``from_checkpoint`` arguments a scheme's layout needs that its tensors do not carry."""
    weight, layout = scheme.weight, scheme.checkpoint_layout
    if weight.family == "int" and layout in ("gptq", "awq", "compressed-tensors"):
        meta: dict[str, Any] = {"sym": weight.symmetric, "dtype": jnp.float32}
        if weight.group_size is not None:  # None (per output channel): the layout infers it from the scales
            meta["group_size"] = weight.group_size
        if layout != "awq":
            meta["bits"] = weight.bits
        if layout == "gptq":
            meta.update(scheme.layout_kwargs())
        return meta
    if layout in ("fp8-block", "compressed-tensors") and weight.granularity == "block":
        # The config's block (weight_block_size / block_structure): a scale grid that also fits the
        # layout's default 128 × 128 (192 × 192 in blocks of 96) would otherwise load with the wrong one.
        return {"dtype": jnp.float32, "block_size": tuple(weight.block_size)}
    if layout == "modelopt" and weight.family == "fp8":
        # The quant_algo fixes the scale granularity: a scale of another shape (per channel under "FP8") would
        # otherwise load as what it looks like.
        return {"dtype": jnp.float32, "variant": "fp8", "granularity": weight.granularity}
    if layout in ("fp8", "fp8-block", "compressed-tensors", "modelopt", "gpt-oss"):
        return {"dtype": jnp.float32}
    return {}


def save_hf_checkpoint(params: dict, directory, *, quantization_config: dict | None = None,
                       model_config: dict | None = None) -> pathlib.Path:
    """Writes ``params`` (float kernels, or QParams holding QTensors) as an HF Llama checkpoint:
    ``model.safetensors`` and a ``config.json`` of ``model_config`` (e.g. ``LlamaConfig.to_hf_config()``,
    which transformers' and vLLM's loaders need) with ``quantization_config``. ``load_hf_checkpoint``
    shows a quantized round trip.

    Examples:
      >>> import json, tempfile, jax.numpy as jnp
      >>> from jquant.checkpoint import save_hf_checkpoint
      >>> directory = save_hf_checkpoint({"final_norm": {"scale": jnp.ones(4)}}, tempfile.mkdtemp(),
      ...                                model_config={"model_type": "llama"})   # the final norm alone
      >>> sorted(p.name for p in directory.iterdir()), json.loads((directory / "config.json").read_text())
      (['config.json', 'model.safetensors'], {'model_type': 'llama'})
    """
    from jquant.checkpoint.writer import save_checkpoint

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(params, directory / "model.safetensors", metadata={"format": "pt"},
                    name_map=hf_module_name, kernel_to_weight=True)
    config = dict(model_config or {})
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def load_hf_checkpoint(directory, like: dict, *, quantization_config: dict | None = None,
                       quantize: str | Scheme | None = None, prepare: bool = True) -> dict:
    """Reads an HF Llama checkpoint into the structure of ``like`` (the model's float params, or their
    ``jax.eval_shape``). Projections stored quantized become QParams of the config's scheme;
    ``quantize`` (a scheme name) quantizes a float checkpoint's projections as they load (online
    quantization). Float tensors load in any float dtype (fp32, bf16, fp16; FP8 without scales), cast to
    ``like``'s dtypes. Modules the config's ignore list names (``skipped_modules``) must be stored in
    float and stay float. Static-activation FP8 projections carry their checkpoint ``input_scale``; as
    vLLM fuses q/k/v and gate/up into one GEMM with one activation scale, each such group shares the
    largest of its scales.

    Raises ValueError naming the parameter when tensors are missing, left over, or disagree with the config.

    Examples:
      A GPTQ-layout int4 checkpoint written and read back, bit for bit:

      >>> import tempfile, jax, jax.numpy as jnp
      >>> from jquant.checkpoint import load_hf_checkpoint, save_hf_checkpoint
      >>> from jquant.flax import quantize_params
      >>> from jquant.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
      ...                      num_kv_heads=1, head_dim=32, rope_theta=1e4, rms_norm_eps=1e-5,
      ...                      max_position_embeddings=32)
      >>> params = LlamaForCausalLM(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
      >>> qparams, _ = quantize_params(params, [(r".*_proj/kernel", "int4_g32")], prepare=False)
      >>> gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
      >>> directory = save_hf_checkpoint(qparams, tempfile.mkdtemp(), quantization_config=gptq,
      ...                                model_config=config.to_hf_config())
      >>> loaded = load_hf_checkpoint(directory, params, prepare=False)
      >>> q, l = qparams["layers_0"]["down_proj"]["kernel"], loaded["layers_0"]["down_proj"]["kernel"]
      >>> bool(jnp.array_equal(q.qtensor.dequantize(), l.qtensor.dequantize()))
      True
    """
    from jquant.checkpoint.safetensors_file import load_file

    directory = pathlib.Path(directory)
    files = safetensors_files(directory)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for f in files:
        for key, value in load_file(str(f)).items():
            if key in tensors:  # which copy is right is unknowable: refuse rather than let the last file win
                raise ValueError(f"tensor {key!r} is stored in both {origin[key]!r} and {f.name!r} of "
                                 f"{str(directory)!r}")
            tensors[key], origin[key] = value, f.name
    if quantization_config is None and (directory / "config.json").exists():
        quantization_config = json.loads((directory / "config.json").read_text()).get("quantization_config")
    scheme_of = module_scheme(quantization_config) if quantization_config else (lambda name: None)
    used: set[str] = set()
    out: dict[str, Any] = {}
    for path, ref in _flat(like).items():
        module, leaf_name = path.rsplit("/", 1)
        name = hf_module_name(module)
        scheme = scheme_of(name)
        value = _float_weight(tensors, name)
        stored = sorted(k for k in tensors if k.startswith(name + "."))
        if value is None and stored and quantization_config and scheme is None:
            raise ValueError(f"parameter {path!r}: the quantization_config keeps {name} in float (its ignore "
                             f"list, or no group targets it), but the checkpoint stores {stored} for it")
        if value is not None and scheme is not None and jnp.dtype(value.dtype).itemsize == 1:
            # FP8 codes without their scale under a quantized config (a lost shard, a renamed tensor): read as
            # floats they would be off by the missing scale, silently.
            raise ValueError(f"parameter {path!r}: the checkpoint stores {name}.weight as {value.dtype} codes "
                             f"with no scale tensor beside it, but the quantization_config ({scheme.name}) "
                             "quantizes this module; a weight_scale / weight_scale_inv is missing")
        if value is not None:
            used.add(f"{name}.weight")   # KV-cache scales beside a float k_proj / v_proj: KV_SCALE_NAME below
            value = value.T if leaf_name == "kernel" else value
            if value.shape != tuple(ref.shape):
                raise ValueError(f"parameter {path!r}: checkpoint tensor {name}.weight has shape "
                                 f"{tuple(value.shape)}, expected {tuple(ref.shape)}")
            out[path] = jnp.asarray(value, ref.dtype)
            continue
        prefix = name + tensor_separator(scheme.checkpoint_layout if scheme is not None else None)
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not own:
            raise ValueError(f"parameter {path!r}: no tensor {name}.weight (or quantized tensors) in the checkpoint")
        if scheme is None or leaf_name != "kernel":
            raise ValueError(f"parameter {path!r}: the checkpoint stores {sorted(own)} under {name} but no "
                             "quantization_config says how to read them")
        read = _Reads(own)
        try:
            qt = from_checkpoint(read, scheme.checkpoint_layout, **layout_meta(scheme))
        except (ValueError, TypeError) as e:
            raise ValueError(f"parameter {path!r}: tensors {sorted(own)} do not match the quantization_config "
                             f"({scheme.name}): {e}") from e
        if qt.shape != (ref.shape[1], ref.shape[0]):
            raise ValueError(f"parameter {path!r}: checkpoint holds a {qt.shape} weight, the model expects "
                             f"{(ref.shape[1], ref.shape[0])}")
        input_scale = _static_input_scale(read, scheme, path, name) if scheme.activation.mode == "static" else None
        # A tensor the layout did not read (a bias, a zero point) would be dropped silently; KV-cache scales
        # are read by no linear layer (vLLM's default "auto" KV-cache dtype does not apply them either).
        unread = sorted(set(own) - read.names - _KV_CACHE_SCALES)
        if unread:
            raise ValueError(f"parameter {path!r}: checkpoint tensors {[prefix + k for k in unread]} are not "
                             f"part of the {scheme.checkpoint_layout!r} layout ({scheme.name}) and would be dropped")
        used.update(prefix + k for k in own)
        out[path] = QParam(scheme.process_weights_after_loading(qt) if prepare else qt, scheme, input_scale)
    _share_fused_input_scales(out)
    # Attention-level KV-cache scales belong to the cache (jquant.checkpoint.kv_cache reads them), not to a parameter.
    extra = sorted(k for k in set(tensors) - used if not KV_SCALE_NAME.match(k))
    if extra:
        raise ValueError(f"checkpoint tensors {extra[:8]}{'...' if len(extra) > 8 else ''} match no model parameter")
    if quantize is not None:
        if quantization_config:
            raise ValueError(f"quantize={quantize!r} asks to quantize a checkpoint that is already quantized "
                             f"({quant_method(quantization_config)})")
        from jquant.flax.rules import quantize_params

        return quantize_params(_unflat(out), [(PROJECTIONS, quantize)], prepare=prepare)[0]
    return _unflat(out)


_KV_CACHE_SCALES = frozenset({"output_scale", "k_scale", "v_scale"})
# Where vLLM's maybe_remap_kv_scale_name finds a layer's KV-cache scales: beside the attention
# (compressed-tensors, fp8; the deprecated single kv_scale) or under k_proj / v_proj (ModelOpt).
KV_SCALE_NAME = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.(?:(?P<proj>[kv])_proj\.)?(?P<which>k|v|kv)_scale$")


class _Reads(dict):
    """The tensors of one module, recording which of them a layout reads (``[]`` or ``get``)."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.names: set[str] = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.names.add(key)
        return value

    def get(self, key, default=None):
        if key in self:
            self.names.add(key)
        return super().get(key, default)


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The shards to read: those ``model.safetensors.index.json`` maps tensors to when it exists (as
    vLLM filters them, so a stale shard beside the index is not read), else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors files in {str(directory)!r}")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{str(index)!r} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{str(index)!r}: 'weight_map' must map tensor names to file names")
    files = [directory / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ValueError(f"{str(index)!r} names shards that are not in {str(directory)!r}: {missing[:8]}")
    return files


def _float_weight(tensors: dict, name: str):
    """``name.weight`` when it is a float tensor (any float dtype) that is not the codes of a quantized
    weight: FP8 codes come with scales under the same module; else None."""
    weight = tensors.get(f"{name}.weight")
    if weight is None or not jnp.issubdtype(weight.dtype, jnp.floating):
        return None
    if jnp.dtype(weight.dtype).itemsize == 1 and any(k.startswith(name + ".") and k != f"{name}.weight"
                                                    for k in tensors):
        return None
    return weight


def _static_input_scale(own: dict, scheme: Scheme, path: str, name: str) -> jnp.ndarray:
    if "input_scale" not in own:
        raise ValueError(f"parameter {path!r}: scheme {scheme.name} quantizes activations with a static scale, "
                         f"but the checkpoint has no {name}.input_scale")
    scale = np.asarray(own["input_scale"]).astype(np.float32)
    if scale.size == 0 or not np.all(np.isfinite(scale)) or not np.all(scale > 0):
        raise ValueError(f"parameter {path!r}: {name}.input_scale must hold positive finite floats, got {scale}")
    return jnp.asarray(scale.max())  # vLLM keeps one per-tensor scale: the max over stored shards


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def _share_fused_input_scales(out: dict[str, Any]) -> None:
    groups: dict[tuple[str, str], list[str]] = {}
    for path, leaf in out.items():
        if isinstance(leaf, QParam) and leaf.input_scale is not None:
            layer, _, proj = path.rsplit("/", 1)[0].rpartition("/")
            groups.setdefault((layer, _FUSED.get(proj, proj)), []).append(path)
    for paths in groups.values():
        shared = jnp.max(jnp.stack([out[p].input_scale for p in paths]))
        for p in paths:
            out[p] = dataclasses.replace(out[p], input_scale=shared)


def _unflat(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree
