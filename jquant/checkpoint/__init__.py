"""Checkpoint layouts vLLM reads; each module registers one family of layouts."""

from jquant.checkpoint.base import from_checkpoint, layouts, register_layout, to_checkpoint

# Importing a family module registers its layouts.
from jquant.checkpoint import gptq_awq as _gptq_awq  # noqa: F401,E402
from jquant.checkpoint import fp8_layouts as _fp8  # noqa: F401,E402
from jquant.checkpoint import fp4_layouts as _fp4  # noqa: F401,E402
from jquant.checkpoint import bnb_layout as _bnb  # noqa: F401,E402
from jquant.checkpoint import int8_layouts as _int8  # noqa: F401,E402
from jquant.checkpoint.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from jquant.checkpoint.kv_cache import KVCacheSettings, kv_cache_settings  # noqa: E402
from jquant.checkpoint.module_scheme import module_scheme  # noqa: E402

__all__ = ["KVCacheSettings", "from_checkpoint", "kv_cache_settings", "layouts", "load_hf_checkpoint",
           "module_scheme", "register_layout", "save_hf_checkpoint", "to_checkpoint"]
