"""One decision across ranks: every rank of a tensor-parallel group must run the same backend.

Each rank selects on its own (its own GPU, libraries and environment), so ranks can disagree:
a missing library on one node, a different GPU, an ``ATTN_BACKEND`` set on one host only. Mixed
kernels give numerically different heads and are hard to notice. These functions gather every
rank's decision fingerprint over `torch.distributed` (gloo, NCCL, any backend) and raise
`RankMismatchError` on every rank, naming the ranks and their choices, when they differ.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ._errors import AttentionBackendError, RankMismatchError
from ._platform import Platform
from ._registry import Registry
from ._selector import Selection, select
from ._spec import AttentionSpec


@dataclass(frozen=True)
class RankDecision:
    """What one rank decided (or why it could not), as gathered from every rank."""

    rank: int
    """Global rank (``torch.distributed.get_rank()``), 0 without a process group."""
    platform: str
    backend: str | None
    """Selected backend; None when this rank's selection raised."""
    fingerprint: str | None
    """`Selection.fingerprint`: backend, its internal choices and the spec."""
    details: str = ""
    error: str | None = None

    def describe(self) -> str:
        if self.error is not None:
            return f"no backend ({self.error})"
        return f"{self.backend} [{self.details}]" if self.details else str(self.backend)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def decision_of(selection: Selection) -> RankDecision:
    """This rank's decision, ready to gather."""
    details = ", ".join(f"{k}={v}" for k, v in selection.details)
    return RankDecision(
        _rank(), str(selection.platform), selection.name, selection.fingerprint(), details
    )


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL moves only CUDA tensors; every other backend here takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None) -> list[bytes]:
    """All-gather one byte string per rank with plain tensor collectives.

    ``all_gather_object`` would do this too, but it needs NumPy to decode, which a serving image
    need not have; the decisions are small JSON, so two tensor all-gathers suffice.
    """
    device = _collective_device(group)
    world = dist.get_world_size(group)
    data = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    return [bytes(chunk[: int(n.item())].tolist()) for chunk, n in zip(chunks, sizes, strict=True)]


def _gather(mine: RankDecision, group: dist.ProcessGroup | None) -> tuple[RankDecision, ...]:
    if not (dist.is_available() and dist.is_initialized()):
        return (mine,)
    payloads = _all_gather_bytes(json.dumps(asdict(mine)).encode(), group)
    decisions = []
    for payload in payloads:
        try:
            decisions.append(RankDecision(**json.loads(payload)))
        except (ValueError, TypeError) as exc:
            raise RankMismatchError(
                f"a rank sent an unreadable decision ({exc}); run the same attn-backends "
                "version on every rank"
            ) from None
    return tuple(decisions)


def _message(decisions: tuple[RankDecision, ...]) -> str:
    groups: dict[tuple[str, str | None, str | None], list[int]] = {}
    for d in decisions:
        groups.setdefault((d.platform, d.fingerprint, d.describe()), []).append(d.rank)
    lines = ["the ranks did not reach one decision on the no-cache prefill attention backend:"]
    for (platform, _, text), ranks in groups.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"  {label} {', '.join(map(str, ranks))} ({platform}): {text}")
    texts = {text for _, _, text in groups}
    if len(texts) < len({fp for _, fp, _ in groups}):
        lines.append("  (the same backend name with different specs or kernel choices)")
    lines.append(
        "every rank must run the same backend: choose it explicitly on all ranks (backend= or "
        "$ATTN_BACKEND), or give every rank the same GPU type, libraries and environment"
    )
    return "\n".join(lines)


def _check(mine: RankDecision, group: dist.ProcessGroup | None) -> tuple[RankDecision, ...]:
    decisions = _gather(mine, group)
    failed = any(d.error is not None for d in decisions)
    if failed or len({d.fingerprint for d in decisions}) > 1:
        raise RankMismatchError(_message(decisions), decisions)
    return decisions


def check_consistent_across_ranks(
    selection: Selection, group: dist.ProcessGroup | None = None
) -> tuple[RankDecision, ...]:
    """Gather every rank's decision and raise `RankMismatchError` if any differs.

    A collective: every rank of ``group`` (default: the world) must call it. Without an
    initialised process group there is one rank and nothing to compare. With NCCL, set the
    rank's CUDA device first (``torch.cuda.set_device``), as for any object collective. If a
    rank may fail to select, use `select_across_ranks` so that it still joins the collective.
    """
    return _check(decision_of(selection), group)


def select_across_ranks(
    spec: AttentionSpec,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    has_kv_cache: bool = False,
    need_rope_kv_cache: bool | None = None,
    backend: str | None = None,
    platform: Platform | str | None = None,
    registry: Registry | None = None,
    strict: bool | None = None,
) -> Selection:
    """`select` on every rank, then the cross-rank check; a rank whose selection fails still
    joins the collective, so every rank raises instead of the others hanging."""
    try:
        selection = select(
            spec,
            device=device,
            has_kv_cache=has_kv_cache,
            need_rope_kv_cache=need_rope_kv_cache,
            backend=backend,
            platform=platform,
            registry=registry,
            strict=strict,
        )
    except AttentionBackendError as exc:
        where = str(platform) if platform is not None else str(device or "this machine")
        first = str(exc).splitlines()[0] if str(exc) else ""
        mine = RankDecision(_rank(), where, None, None, error=f"{type(exc).__name__}: {first}")
        decisions = _gather(mine, group)
        raise RankMismatchError(_message(decisions), decisions) from exc
    check_consistent_across_ranks(selection, group)
    return selection
