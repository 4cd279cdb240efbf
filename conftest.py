"""Repository-wide pytest setup: hardware-marked tests skip at collection, with a reason,
on machines without that hardware (never an import error)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _rocm_ready() -> str | None:
    if torch.version.hip is None or not torch.cuda.is_available():
        return "needs a ROCm GPU (torch.version.hip and a visible device)"
    if importlib.util.find_spec("aiter") is None:
        return "needs the aiter library (amd-aiter)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_missing = None
    if not torch.cuda.is_available() or torch.version.hip is not None:
        cuda_missing = "needs an NVIDIA CUDA GPU"
    rocm_missing = _rocm_ready()
    for item in items:
        if cuda_missing and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=cuda_missing))
        if rocm_missing and item.get_closest_marker("rocm") is not None:
            item.add_marker(pytest.mark.skip(reason=rocm_missing))
