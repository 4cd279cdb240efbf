"""Graph mode: one plan per bucket, captured in a CUDA graph once, re-planned per batch.

A CUDA graph replays the kernels it captured with the same arguments, so every batch that
replays it must present the same shapes and the same device buffers. A `GraphBucket` fixes
them: a QKV buffer of ``max_tokens`` rows and at most ``max_batch`` sequences. The
`GraphPlan` of a bucket owns fixed-size device metadata; `GraphPlan.update` rewrites it in
place for each new batch (host work only, plus small copies), and the captured graph then
computes that batch.

How a batch fills the fixed metadata (`slot_lengths`): its sequences first, then empty
sequences up to ``max_batch``, then the padding rows ``[token_q_num, max_tokens)`` cut into
short "padding sequences" of at most `PAD_CHUNK` rows, then empty sequences again. The kernel
therefore always sees ``max_tokens`` rows in a fixed number of sequences; padding rows attend
only to padding rows of their own chunk, so they never reach a real token, and the cost they
add is linear in the padding. The RoPE/logn pass reads its own offsets (`GraphPlan.rope_cu`,
real sequences only), so it never writes a padding row.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._values._errors import ParamsError
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec
from ._geometry import BufferMemo
from ._preprocess import PreprocessMode, is_separate

PAD_CHUNK = 64
"""Longest padding sequence: padding rows cost at most this many keys each."""


@dataclass(frozen=True)
class GraphBucket:
    """The fixed shape of one CUDA graph: buffer rows, sequences, longest sequence."""

    max_tokens: int
    """Rows of the QKV buffer every batch of the bucket is handed over in (``padded_rows``)."""
    max_batch: int
    """Most sequences in one batch."""
    max_seqlen: int | None = None
    """Longest sequence a batch may hold; ``None``: ``max_tokens``. Kernels that choose a
    variant by sequence length (fused RoPE up to a limit) choose once, for this bound."""

    def __post_init__(self) -> None:
        for name, value in (("max_tokens", self.max_tokens), ("max_batch", self.max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamsError(f"GraphBucket.{name} must be a positive int, got {value!r}")
        limit = self.max_seqlen
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or not limit >= 1
        ):
            raise ParamsError(f"GraphBucket.max_seqlen must be a positive int, got {limit!r}")
        if self.max_batch > self.max_tokens:
            raise ParamsError(
                f"GraphBucket.max_batch ({self.max_batch}) exceeds max_tokens "
                f"({self.max_tokens}): a batch needs a row per sequence"
            )

    @property
    def seqlen_limit(self) -> int:
        return self.max_tokens if self.max_seqlen is None else min(self.max_seqlen, self.max_tokens)

    @property
    def slots(self) -> int:
        """Sequences the kernel always sees: real ones, padding chunks, empty ones."""
        return self.max_batch + math.ceil(self.max_tokens / PAD_CHUNK)

    def to_dict(self) -> dict[str, int]:
        return {
            "max_tokens": self.max_tokens,
            "max_batch": self.max_batch,
            "max_seqlen": self.seqlen_limit,
        }


def slot_lengths(bucket: GraphBucket, lengths: tuple[int, ...]) -> tuple[int, ...]:
    """The fixed-size sequence list the kernel plans for a batch of ``lengths`` (see module)."""
    total = sum(lengths)
    pad = bucket.max_tokens - total
    chunks = [PAD_CHUNK] * (pad // PAD_CHUNK) + ([pad % PAD_CHUNK] if pad % PAD_CHUNK else [])
    fixed = [*lengths, *[0] * (bucket.max_batch - len(lengths)), *chunks]
    return (*fixed, *[0] * (bucket.slots - len(fixed)))


def check_fits(bucket: GraphBucket, params: FMHAParams, device: torch.device) -> None:
    """A batch fits a bucket when its buffer is the bucket's and its sequences fit the slots."""
    if not isinstance(params, FMHAParams):
        raise ParamsError(f"update() takes FMHAParams, got {type(params).__name__}")
    problems: list[str] = []
    if params.rows != bucket.max_tokens:
        problems.append(
            f"rows {params.rows} != max_tokens {bucket.max_tokens} (build the batch with "
            f"FMHAParams.from_lengths(..., padded_rows={bucket.max_tokens}))"
        )
    if params.batch_size > bucket.max_batch:
        problems.append(f"{params.batch_size} sequences > max_batch {bucket.max_batch}")
    if params.max_seqlen_q > bucket.seqlen_limit:
        problems.append(f"a sequence of {params.max_seqlen_q} tokens > {bucket.seqlen_limit}")
    if params.device != device:
        problems.append(f"batch on {params.device}, plan on {device}")
    if problems:
        raise ParamsError(
            f"the batch does not fit the graph bucket {bucket.to_dict()}: "
            + "; ".join(problems)
            + "; use a larger bucket, or the eager prepare() for this batch"
        )


class GraphPlan:
    """The plan of one bucket: fixed device metadata, re-planned in place per batch.

    Unlike a `PrefillPlan` it is mutable on purpose: ``forward`` captured in a graph reads
    whatever batch the last `update` planned. It is owned by the caller that captured it; a
    second caller gets its own with ``prepare_graph``. ``forward`` returns ``max_tokens`` rows;
    the first ``token_q_num`` are the batch's output, the rest belong to padding.

    Keep the plan alive as long as any graph captured with it: the graph replays reads of the
    plan's device buffers, which are freed (and reused by the allocator) when it is dropped.
    """

    def __init__(
        self,
        *,
        backend: str,
        spec: AttentionSpec,
        bucket: GraphBucket,
        device: torch.device,
        preprocess: PreprocessMode,
        kernel: object,
        replan: Callable[[GraphPlan, tuple[int, ...]], None],
        memo: BufferMemo,
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.bucket = bucket
        self.device = device
        self.preprocess: PreprocessMode = preprocess
        self.rotates = is_separate(preprocess)
        """``preprocess`` is a separate pass that writes the caller's buffer."""
        self.kernel = kernel
        """Backend-owned graph state (fixed buffers, a CUDA-graph wrapper...)."""
        self.memo = memo
        self.params: FMHAParams | None = None
        """The batch the metadata holds now; None until the first `update`."""
        self.rope_cu = torch.zeros(bucket.max_batch + 1, dtype=torch.int32, device=device)
        """Offsets of the real sequences (empty ones up to ``max_batch``) for the in-place
        RoPE/logn pass, whose kernel stops at ``rope_cu[-1]``: padding rows stay untouched."""
        self._replan = replan
        self._lock = threading.Lock()

    @property
    def token_q_num(self) -> int:
        """Valid rows of the current batch (the leading rows of ``forward``'s output)."""
        return self.current().token_q_num

    @property
    def output_rows(self) -> int:
        return self.bucket.max_tokens

    def current(self) -> FMHAParams:
        params = self.params
        if params is None:
            raise ParamsError(
                "this graph plan holds no batch yet: call plan.update(params) before forward()"
            )
        return params

    def update(self, params: FMHAParams) -> None:
        """Plan ``params`` into the fixed metadata; captured graphs then compute this batch.

        Raises `ParamsError` (nothing changed) when the batch does not fit the bucket. Call it
        on the stream that replays the graph: the device copies it makes are ordered there.
        """
        check_fits(self.bucket, params, self.device)
        cu = [0]
        for n in params.input_lengths:
            cu.append(cu[-1] + n)
        cu += [cu[-1]] * (self.bucket.max_batch + 1 - len(cu))
        with self._lock:
            self._replan(self, slot_lengths(self.bucket, params.input_lengths))
            # Pageable source, non_blocking: the copy is staged before the call returns (the
            # host list may go) and ordered on the current stream after earlier replays.
            self.rope_cu.copy_(torch.tensor(cu, dtype=torch.int32), non_blocking=True)
            self.params = params

    def valid(self, out: torch.Tensor) -> torch.Tensor:
        """The rows of a ``forward`` output that belong to the current batch."""
        return out[: self.token_q_num]

    def __repr__(self) -> str:
        batch = "empty" if self.params is None else f"{self.params.token_q_num} tokens"
        return f"<GraphPlan {self.backend!r} {self.bucket.to_dict()} holding {batch}>"
