"""One decision across ranks: every rank of a tensor-parallel group must run the same backend.

Each rank selects on its own (its own GPU, libraries and environment), so ranks can disagree:
a missing library on one node, a different GPU, an ``ATTN_BACKEND`` set on one host only. Mixed
kernels give numerically different heads and are hard to notice. These functions gather every
rank's decision fingerprint over `torch.distributed` (gloo, NCCL, any backend) and raise
`RankMismatchError` on every rank, naming the ranks and their choices, when they differ.

A rank whose own step fails, with any exception, still joins the collective carrying its error,
so every rank raises the same `RankMismatchError` at once instead of the others waiting for the
process-group timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._values._errors import AttentionBackendError, InvalidArgumentError
from .._values._platform import indexed
from .._values._records import (
    canonical,
    canonical_json,
    canonical_text,
    differing_fields,
    dumps,
    json_safe,
)
from .._values._spec import AttentionSpec
from ._registry import Registry
from ._selector import Selection, SelectRequest, select_request

_ERROR_CHARS = 2000
"""A failed rank's error message is cut to this length before it is sent to every rank."""
EXPLAINING_DETAILS = frozenset({"preprocess_fallback"})
"""Detail entries that explain a choice rather than make it, left out of the fingerprint: their
text may name a host, a PID or a path, which differ between ranks that chose alike."""


@dataclass(frozen=True)
class RankDecision:
    """What one rank decided (or why it could not), as gathered from every rank."""

    rank: int
    """Global rank (``torch.distributed.get_rank()``), 0 without a process group."""
    platform: str
    backend: str | None
    """Selected backend; None when this rank's selection raised."""
    fingerprint: str | None
    """`rank_fingerprint`: backend, its internal choices, the spec, the device and the library
    versions, as canonical JSON; None when this rank's selection raised."""
    details: str = ""
    error: str | None = None
    """The message of the exception this rank's selection raised (None: it did not)."""
    error_type: str | None = None
    """That exception's class name, e.g. ``NoBackendError`` or ``RuntimeError``."""

    def describe(self) -> str:
        if self.error is None and self.error_type is None:
            return f"{self.backend} [{self.details}]" if self.details else str(self.backend)
        first = (self.error or "").strip().splitlines()
        return f"no backend ({self.error_type}: {first[0] if first else ''})"


class RankMismatchError(AttentionBackendError, RuntimeError):
    """Ranks of one process group selected different backends (or some failed to select).

    Defined here, beside the `RankDecision`s it carries, so that the errors module depends on
    nothing above it.
    """

    def __init__(self, message: str, decisions: Sequence[RankDecision] = ()) -> None:
        super().__init__(message)
        self.decisions: tuple[RankDecision, ...] = tuple(decisions)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_fingerprint(selection: Selection) -> str:
    """Canonical JSON of everything the decision depends on, equal on ranks that chose alike.

    Unlike `Selection.fingerprint` it holds the device and the library versions (torch and its
    CUDA/HIP build, and the optional libraries the platform recorded), since two ranks with
    different versions may run the same backend name with different kernels. A number that is
    not finite follows the library's one JSON convention (`_records`).
    """
    platform = selection.platform
    versions: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
    }
    versions.update(platform.libraries)
    record = json_safe(
        {
            "backend": selection.name,
            "details": {
                key: canonical_text(value)
                for key, value in selection.details
                if key not in EXPLAINING_DETAILS
            },
            "spec": canonical(selection.spec.to_dict()),
            "platform": {
                "kind": platform.kind,
                "arch": platform.arch,
                "device_name": platform.device_name,
                "assumed": platform.assumed,
            },
            "versions": versions,
        }
    )
    return canonical_json(record)


def decision_of(selection: Selection) -> RankDecision:
    """This rank's decision, ready to gather."""
    details = ", ".join(f"{k}={v}" for k, v in selection.details)
    return RankDecision(
        _rank(), str(selection.platform), selection.name, rank_fingerprint(selection), details
    )


def _failed(exc: Exception, where: str) -> RankDecision:
    return RankDecision(
        _rank(),
        where,
        None,
        None,
        error=str(exc)[:_ERROR_CHARS],
        error_type=type(exc).__name__,
    )


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL moves only CUDA tensors; every other backend here takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return indexed("cuda")
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
    try:
        payloads = _all_gather_bytes(dumps(asdict(mine), indent=None).encode(), group)
    except RuntimeError as exc:  # torch.distributed reports a lost or late peer as RuntimeError
        first = str(exc).strip().splitlines()
        raise RankMismatchError(
            f"rank {mine.rank} could not gather the other ranks' decisions ({type(exc).__name__}: "
            f"{first[0] if first else ''}); every rank of the group must call "
            "select_across_ranks or check_consistent_across_ranks, and with NCCL each rank must "
            "set its CUDA device first",
            (mine,),
        ) from exc
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


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _field_lines(decisions: tuple[RankDecision, ...]) -> list[str]:
    """One line per fingerprint field that differs, with the ranks holding each value."""
    ranks: list[int] = []
    records: list[object] = []
    for d in decisions:
        if d.fingerprint is None:
            continue
        try:
            records.append(json.loads(d.fingerprint))
        except ValueError:
            return []  # a rank on another attn-backends version: the decision lines say enough
        ranks.append(d.rank)
    lines = []
    for path, values in differing_fields(records):
        holders: dict[str, list[int]] = {}
        for rank, value in zip(ranks, values, strict=True):
            holders.setdefault(json.dumps(value), []).append(rank)
        shown = "; ".join(f"{value} on {_rank_list(rs)}" for value, rs in holders.items())
        lines.append(f"  {path} differs: {shown}")
    return lines


def _message(decisions: tuple[RankDecision, ...]) -> str:
    groups: dict[tuple[str, str | None, str], list[int]] = {}
    for d in decisions:
        groups.setdefault((d.platform, d.fingerprint, d.describe()), []).append(d.rank)
    lines = ["the ranks did not reach one decision on the no-cache prefill attention backend:"]
    for (platform, _, text), ranks in groups.items():
        lines.append(f"  {_rank_list(ranks)} ({platform}): {text}")
    failed = [d.rank for d in decisions if d.fingerprint is None]
    if failed:
        lines.append(
            f"  {_rank_list(failed)} failed to select (error shown above); every rank raises "
            "this same error, so fix it where it happened"
        )
    lines.extend(_field_lines(decisions))
    lines.append(
        "every rank must run the same backend: choose it explicitly on all ranks (backend= or "
        "$ATTN_BACKEND), or give every rank the same GPU type, libraries and environment"
    )
    return "\n".join(lines)


def _agree(decisions: tuple[RankDecision, ...]) -> bool:
    return all(d.fingerprint is not None for d in decisions) and (
        len({d.fingerprint for d in decisions}) == 1
    )


def _exchange(
    decide: Callable[[], RankDecision], where: str, group: dist.ProcessGroup | None
) -> tuple[RankDecision, ...]:
    """Decide locally, whatever happens, then gather; raise `RankMismatchError` on every rank
    unless all decided alike. A local failure is re-raised as the cause on its own rank."""
    failure: Exception | None = None
    try:
        mine = decide()
    except Exception as exc:  # any local failure must still reach the collective
        failure = exc
        mine = _failed(exc, where)
    decisions = _gather(mine, group)
    if not _agree(decisions):
        raise RankMismatchError(_message(decisions), decisions) from failure
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
    where = str(selection.platform) if isinstance(selection, Selection) else "no Selection given"
    return _exchange(lambda: decision_of(selection), where, group)


def select_across_ranks(
    request: SelectRequest | AttentionSpec,
    *,
    group: dist.ProcessGroup | None = None,
    registry: Registry | None = None,
    **options: Any,
) -> Selection:
    """`select_request` on every rank, then the cross-rank check.

    ``request`` is a `SelectRequest`, or a spec with the request's other fields as keywords
    (``select_across_ranks(spec, platform="cpu", cuda_graph=True)``), exactly as `select`
    takes them. A rank whose selection raises (any `Exception`; ``KeyboardInterrupt`` still
    propagates) joins the collective with its error, so every rank raises the same
    `RankMismatchError`, naming the failed rank and its error, instead of the others hanging.
    """
    chosen: list[Selection] = []

    def decide() -> RankDecision:
        selection = select_request(_request_of(request, options), registry=registry)
        chosen.append(selection)
        return decision_of(selection)

    _exchange(decide, _where(request, options), group)
    return chosen[0]


def _request_of(request: SelectRequest | AttentionSpec, options: dict[str, Any]) -> SelectRequest:
    """The request a caller means: given whole, or a spec plus `SelectRequest`'s keywords."""
    if isinstance(request, SelectRequest):
        if options:
            raise InvalidArgumentError(
                f"select_across_ranks() takes a SelectRequest or a spec with keywords, not both "
                f"(got {', '.join(sorted(options))}); use dataclasses.replace on the request"
            )
        return request
    try:
        return SelectRequest(request, **options)
    except TypeError as exc:
        if isinstance(exc, AttentionBackendError):
            raise
        raise InvalidArgumentError(f"select_across_ranks(): {exc}") from None


def _where(request: SelectRequest | AttentionSpec, options: dict[str, Any]) -> str:
    """The platform or device a request names, for a failed rank's line."""
    if isinstance(request, SelectRequest):
        place: object = request.platform or request.device
    else:
        place = options.get("platform") or options.get("device")
    return str(place) if place is not None else "this machine"
