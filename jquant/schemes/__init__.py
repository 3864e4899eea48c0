"""Quantization schemes: typed specs, the named schemes, the one dispatch and the XLA implementation."""
