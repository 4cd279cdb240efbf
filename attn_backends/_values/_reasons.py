"""Structured rejection reasons: a code a program can match, and a message a person can act on."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReasonCode(enum.Enum):
    """Why a backend cannot serve a request. Stable names: tools match on them."""

    PLATFORM = "platform"
    ARCH = "arch"
    DTYPE = "dtype"
    HEAD_DIM = "head_dim"
    GQA = "gqa"
    CAUSAL = "causal"
    BIDIRECTIONAL = "bidirectional"
    MLA = "mla"
    FP8 = "fp8"
    HEADWISE = "headwise"
    ROPE = "rope"
    SLIDING_WINDOW = "sliding_window"
    SOFTCAP = "logit_softcap"
    ALIBI = "alibi"
    CHUNKED = "chunked_attention"
    SINKS = "attention_sinks"
    LIBRARY_MISSING = "library_missing"
    KV_CACHE_PRESENT = "kv_cache_present"
    DISABLED = "disabled"
    NOT_RANKED = "not_ranked"
    CANARY_FAILED = "canary_failed"
    CUDA_GRAPH = "cuda_graph"
    BACKEND_SPECIFIC = "backend_specific"


@dataclass(frozen=True)
class Reason:
    """One reason a backend refuses a request.

    ``field`` names the spec or platform field at fault; ``got`` and ``allowed`` say what was
    asked for and what would have been accepted, as short strings ready to print.
    """

    code: ReasonCode
    message: str
    field: str | None = None
    got: str | None = None
    allowed: str | None = None

    def __str__(self) -> str:
        text = f"[{self.code.value}] {self.message}"
        if self.got is not None or self.allowed is not None:
            text += f" (got {self.got}; allowed {self.allowed})"
        return text

    def to_dict(self) -> dict[str, str | None]:
        return {
            "code": self.code.value,
            "message": self.message,
            "field": self.field,
            "got": self.got,
            "allowed": self.allowed,
        }
