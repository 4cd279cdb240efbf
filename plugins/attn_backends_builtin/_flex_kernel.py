"""torch FlexAttention plumbing for ``flex`` (and its former name ``headwise``).

A packed batch runs as one ``[1, heads, tokens, D]`` sequence; the mask function keeps every
token inside its own sequence (`document_ids`). The kernel is ``torch.compile``-d on CUDA
(compiled once per process and per shape class) and runs eagerly elsewhere, where it
materialises the scores: fine for tests and small inputs. A failed compilation is logged once
per backend and the eager kernel serves from then on.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attn_backends.errors import BackendFailure
from attn_backends.plugin import Reason, ReasonCode

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger("attn_backends")

FLEX_MODULE = "torch.nn.attention.flex_attention"
"""Imported lazily: it exists from torch 2.5 on, and the package allows older torch."""
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


@dataclass
class CompileState:
    """A backend's compiled-kernel health in this process (the compiled kernel is one per
    process, so is its health); after a failure the eager kernel serves until `reset`."""

    failures: int = 0
    last_error: str | None = None
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def record_failure(self, error: str) -> None:
        """Count one failure of the compiled kernel; concurrent batches lose no count."""
        with self._lock:
            self.failures += 1
            self.last_error = error

    def reset(self) -> None:
        """Try the compiled kernel again on the next CUDA batch (a toolchain fixed, tests)."""
        with self._lock:
            self.failures = 0
            self.last_error = None


def flex_missing_reasons() -> list[Reason]:
    """A ``library_missing`` reason when this torch has no FlexAttention."""
    if importlib.util.find_spec(FLEX_MODULE) is not None:
        return []
    return [
        Reason(
            ReasonCode.LIBRARY_MISSING,
            f"needs {FLEX_MODULE} (torch >= 2.5)",
            "torch",
            torch.__version__,
            ">= 2.5",
        )
    ]


def document_ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[tokens]``: the index of the sequence each packed token belongs to."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), counts)
    return doc.to(device)


EAGER_MASK_LIMIT = 1 << 24
"""Above ``heads * tokens**2`` entries a block mask is built by a compiled kernel instead of
evaluating the mask over the whole grid (CUDA only)."""


def build_flex_block_mask(
    mask: MaskMod, heads: int | None, tokens: int, device: torch.device
) -> BlockMask:
    """The block mask of ``mask`` over ``tokens x tokens`` (``heads=None``: the same for every
    head), built by a compiled kernel on CUDA above `EAGER_MASK_LIMIT` grid entries."""
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = device.type == "cuda" and (heads or 1) * tokens * tokens > EAGER_MASK_LIMIT
    return create_block_mask(mask, None, heads, tokens, tokens, device=device, _compile=compiled)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _eager_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    gqa: bool,
    score_mod: ScoreMod | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        # Eager flex is the intended path off CUDA; its "not compiled" notice is noise here.
        warnings.filterwarnings("ignore", message=".*flex_attention.*compile.*")
        out = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
    if not isinstance(out, torch.Tensor):
        raise BackendFailure(f"flex_attention returned {type(out).__name__}, not a tensor")
    return out


def run_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    gqa: bool,
    *,
    state: CompileState,
    backend: str,
    score_mod: ScoreMod | None = None,
) -> torch.Tensor:
    """flex on ``[1, heads, tokens, D]``: compiled on CUDA, eager elsewhere or after a failed
    compilation (recorded in ``state``, logged under ``backend``'s name)."""
    if q.device.type != "cuda" or state.failures:
        return _eager_flex(q, k, v, block_mask, scale, gqa, score_mod)
    try:
        return _compiled_flex()(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
    except Exception as exc:  # a compiler failure must not take attention down with it
        state.record_failure(f"{type(exc).__name__}: {exc}")
        logger.warning("%s: compiled flex_attention failed, running eager: %s", backend, exc)
        return _eager_flex(q, k, v, block_mask, scale, gqa, score_mod)


def run_packed(
    views_q: torch.Tensor,
    views_k: torch.Tensor,
    views_v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    gqa: bool,
    *,
    state: CompileState,
    backend: str,
    score_mod: ScoreMod | None = None,
) -> torch.Tensor:
    """flex on packed ``[tokens, heads, D]`` views; returns ``[tokens, Hq, D]``."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (views_q, views_k, views_v))
    out = run_flex(
        q, k, v, block_mask, scale, gqa, state=state, backend=backend, score_mod=score_mod
    )
    return out.squeeze(0).transpose(0, 1)
