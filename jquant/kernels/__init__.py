"""Pallas kernels, one folder per op (api, reference, config, one file per backend, bench).

Importing a kernel package loads no Pallas GPU backend: each imports it when the kernel first runs.
"""
