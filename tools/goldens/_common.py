"""Helpers shared by the golden modules (run in the reference venvs, never by the tests)."""

from __future__ import annotations

import importlib.metadata
import pathlib

import numpy as np


def versions(*packages: str) -> np.ndarray:
    return np.array([f"{p}=={importlib.metadata.version(p)}" for p in packages])


def save(out_dir: pathlib.Path, name: str, packages: tuple[str, ...], **arrays) -> pathlib.Path:
    path = pathlib.Path(out_dir) / f"{name}.npz"
    np.savez_compressed(path, meta_versions=versions(*packages), **arrays)
    return path
