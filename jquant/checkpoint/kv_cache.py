"""A checkpoint's KV-cache settings as vLLM reads them: the ``kv_cache_dtype`` its config implies and the
static per-tensor ``k_scale`` / ``v_scale`` of every layer, for ``jquant.models.llama.new_cache``.

vLLM (``resolve_kv_cache_dtype_string``) turns ``kv_cache_dtype="auto"`` into ``fp8_e4m3`` where a ModelOpt
config says ``kv_cache_quant_algo: FP8``; every other config leaves the cache in the model's dtype unless
the user asks for one. Scales are read wherever vLLM's ``maybe_remap_kv_scale_name`` finds them:
``model.layers.{i}.self_attn.k_scale`` (compressed-tensors, fp8), ``...self_attn.k_proj.k_scale``
(ModelOpt), and the deprecated single ``...self_attn.kv_scale``. Per layer as vLLM's
``BaseKVCacheMethod`` settles them: both stored, both used; one stored (``kv_scale``), it serves both;
none, 1.0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import safetensors

from jquant.checkpoint.hf_checkpoint import KV_SCALE_NAME, safetensors_files
from jquant.checkpoint.hf_config import quant_method
from jquant.checkpoint.safetensors_file import load_tensors


@dataclasses.dataclass(frozen=True)
class KVCacheSettings:
    """``kv_cache_dtype``: the vLLM name the config implies (None: the model's dtype, vLLM's "auto");
    ``k_scales`` / ``v_scales``: one per layer, None when the checkpoint stores none.

    Examples:
      >>> from jquant.checkpoint import KVCacheSettings
      >>> KVCacheSettings("fp8", (0.5, 1.0), (0.25, 1.0)).cache_options()
      {'k_scales': (0.5, 1.0), 'v_scales': (0.25, 1.0)}
      >>> KVCacheSettings(None, None, None).cache_options()
      {}
    """

    kv_cache_dtype: str | None
    k_scales: tuple[float, ...] | None
    v_scales: tuple[float, ...] | None

    def cache_options(self) -> dict:
        """``new_cache`` / ``PagedCache.allocate`` keyword arguments for the scales (none when absent)."""
        return {} if self.k_scales is None else {"k_scales": self.k_scales, "v_scales": self.v_scales}


def kv_cache_dtype_from_config(quantization_config: dict | None) -> str | None:
    """The ``kv_cache_dtype`` vLLM's "auto" becomes for a checkpoint's ``quantization_config``.

    Examples:
      >>> from jquant.checkpoint.kv_cache import kv_cache_dtype_from_config
      >>> kv_cache_dtype_from_config({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}})
      'fp8'
      >>> kv_cache_dtype_from_config({"quant_method": "modelopt", "quant_algo": "NVFP4",
      ...                             "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}})
      'fp8'
      >>> kv_cache_dtype_from_config({"quant_method": "fp8", "activation_scheme": "dynamic"}) is None
      True
    """
    if not quantization_config or quant_method(quantization_config) != "modelopt":
        return None
    inner = quantization_config.get("quantization", quantization_config)
    inner = inner if isinstance(inner, dict) else {}
    # vLLM's order (get_kv_cache_quant_algo_string): kv_cache_scheme, which newer ModelOpt writes into
    # config.json, before kv_cache_quant_algo, each in the nested block first.
    algo = (inner.get("kv_cache_scheme") or quantization_config.get("kv_cache_scheme")
            or inner.get("kv_cache_quant_algo") or quantization_config.get("kv_cache_quant_algo"))
    if algo is None:
        return None
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            return "fp8"
        raise ValueError(f"kv_cache_scheme {algo!r}: jquant reads static 8-bit float (per-tensor e4m3 pages "
                         "with the checkpoint's k_scale / v_scale) or none")
    if not isinstance(algo, str) or algo.upper() != "FP8":
        raise ValueError(f"kv_cache_quant_algo {algo!r}: jquant reads 'FP8' (per-tensor e4m3 pages with the "
                         "checkpoint's k_scale / v_scale) or none; an NVFP4 KV cache has no jquant format")
    return "fp8"


def kv_cache_settings(directory, num_layers: int, quantization_config: dict | None = None) -> KVCacheSettings:
    """The KV-cache settings of the checkpoint in ``directory`` for a model of ``num_layers`` layers
    (``quantization_config``: default ``config.json``'s). A scale that is not one positive finite
    float, a layer outside the model or a scale stored twice raises a ValueError naming the tensor.

    Examples:
      >>> import json, pathlib, tempfile, numpy as np
      >>> from jquant.checkpoint import kv_cache_settings
      >>> from jquant.checkpoint.safetensors_file import save_file
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> save_file({"model.layers.0.self_attn.k_proj.k_scale": np.float32(0.5).reshape(()),
      ...            "model.layers.0.self_attn.v_proj.v_scale": np.float32(0.25).reshape(()),
      ...            "model.layers.1.self_attn.kv_scale": np.float32(2.0).reshape(())}, d / "model.safetensors")
      >>> config = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
      >>> settings = kv_cache_settings(d, num_layers=3, quantization_config=config)
      >>> settings.kv_cache_dtype, settings.k_scales, settings.v_scales  # layer 2 stores none: 1.0
      ('fp8', (0.5, 2.0, 1.0), (0.25, 2.0, 1.0))
    """
    directory = pathlib.Path(directory)
    if quantization_config is None and (directory / "config.json").exists():
        quantization_config = json.loads((directory / "config.json").read_text()).get("quantization_config")
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for f in safetensors_files(directory):
        with safetensors.safe_open(str(f), "numpy") as handle:
            names = [k for k in handle.offset_keys() if KV_SCALE_NAME.match(k)]
        for name, value in load_tensors(f, names).items():
            m = KV_SCALE_NAME.match(name)
            layer, which = int(m["layer"]), m["which"]
            if m["proj"] not in (None, which):
                raise ValueError(f"tensor {name!r}: a {which}_scale under {m['proj']}_proj")
            if layer >= num_layers:
                raise ValueError(f"tensor {name!r} belongs to layer {layer}, but the model has {num_layers} layers")
            scale = float(value.reshape(-1)[0]) if value.size == 1 else math.nan
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"tensor {name!r} must be one positive finite float (a per-tensor KV-cache "
                                 f"scale), got shape {value.shape}: {value.reshape(-1)[:4]}")
            for side in ("k", "v") if which == "kv" else (which,):
                if (layer, side) in found:
                    raise ValueError(f"layer {layer}'s {side}_scale is stored twice: {found[layer, side][0]!r} "
                                     f"and {name!r}")
                found[layer, side] = (name, scale)
    dtype = kv_cache_dtype_from_config(quantization_config)
    if not found:
        return KVCacheSettings(dtype, None, None)
    k, v = [], []
    for layer in range(num_layers):
        ks, vs = found.get((layer, "k")), found.get((layer, "v"))
        one = (ks or vs or (None, 1.0))[1]   # a single scale serves both, as vLLM duplicates it
        k.append(ks[1] if ks else one)
        v.append(vs[1] if vs else one)
    return KVCacheSettings(dtype, tuple(k), tuple(v))
