"""Quantize-and-insert of new tokens into the paged KV cache, one pass, in place."""

from jquant.kernels.kv_insert.api import choose_impl, insert
from jquant.kernels.kv_insert.triton import InsertConfig

__all__ = ["InsertConfig", "choose_impl", "insert"]
