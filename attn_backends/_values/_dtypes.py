"""Dtype facts shared by the spec, the contract and capability checks."""

from __future__ import annotations

import torch

FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
)
FLOAT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
MODEL_DTYPES: frozenset[torch.dtype] = FLOAT_DTYPES | FP8_DTYPES

_BY_NAME: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the short name used in records and messages."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Parse a CLI/env dtype name; raises `ValueError` listing the accepted names."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {', '.join(sorted(_BY_NAME))}"
        ) from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES
