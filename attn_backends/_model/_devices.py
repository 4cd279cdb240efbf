"""`indexed`: a device as tensors report it, so device comparisons mean what they say.

``torch.device("cuda")`` names no GPU, while every tensor on it reports ``cuda:N``: comparing
the two is always unequal. Whatever compares a tensor's device with one a caller named
resolves the name first.
"""

from __future__ import annotations

import torch


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:<current device>``; others unchanged."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev
