"""Backend selection: one decision per request, with every candidate's reasons on record."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from ._errors import NoBackendError, SpecError
from ._flags import derive_need_rope_kv_cache
from ._platform import Platform, detect_platform, parse_platform
from ._protocol import NoCachePrefill
from ._reasons import Reason, ReasonCode
from ._registry import BackendEntry, PluginRecord, Registry, get_registry
from ._spec import AttentionSpec

logger = logging.getLogger("attn_backends")

BACKEND_ENV = "ATTN_BACKEND"
DecisionSource = Literal["explicit", "environment", "priority"]
Verdict = Literal["selected", "eligible", "rejected", "not ranked"]


@dataclass(frozen=True)
class Candidate:
    """One registered backend as the selector judged it."""

    name: str
    plugin: str
    verdict: Verdict
    priority: int | None
    priority_rule: str | None
    reasons: tuple[Reason, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "plugin": self.plugin,
            "verdict": self.verdict,
            "priority": self.priority,
            "priority_rule": self.priority_rule,
            "reasons": [r.to_dict() for r in self.reasons],
        }


@dataclass(frozen=True)
class Selection:
    """The decision record: the winner, bound to the spec, and how it was chosen."""

    backend: NoCachePrefill
    spec: AttentionSpec
    platform: Platform
    has_kv_cache: bool
    need_rope_kv_cache: bool
    flag_given: bool | None
    source: DecisionSource
    candidates: tuple[Candidate, ...]
    details: tuple[tuple[str, str], ...]
    plugins: tuple[PluginRecord, ...]

    @property
    def name(self) -> str:
        return self.backend.name

    def fingerprint(self) -> str:
        """Stable text identifying the decision; equal on ranks that chose alike."""
        return json.dumps(
            {"backend": self.name, "details": dict(self.details), "spec": self.spec.to_dict()},
            sort_keys=True,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "selected": self.name,
            "source": self.source,
            "spec": self.spec.to_dict(),
            "platform": self.platform.to_dict(),
            "has_kv_cache": self.has_kv_cache,
            "need_rope_kv_cache": self.need_rope_kv_cache,
            "need_rope_kv_cache_given": self.flag_given,
            "details": dict(self.details),
            "candidates": [c.to_dict() for c in self.candidates],
            "plugins": [p.to_dict() for p in self.plugins],
        }

    def explain(self) -> str:
        lines = [
            f"selected: {self.name} (by {self.source})",
            f"spec: {_spec_line(self.spec)}",
            f"platform: {self.platform}"
            + (f" [{self.platform.device_name}]" if self.platform.device_name else "")
            + (" (dry run: library checks assumed to pass)" if self.platform.assumed else ""),
            f"kv cache: {'present' if self.has_kv_cache else 'none'}; need_rope_kv_cache="
            f"{self.need_rope_kv_cache} ({'given' if self.flag_given is not None else 'derived'})",
        ]
        if self.details:
            lines.append("details: " + ", ".join(f"{k}={v}" for k, v in self.details))
        lines.append("candidates:")
        for c in self.candidates:
            prio = f" priority {c.priority} [{c.priority_rule}]" if c.priority is not None else ""
            lines.append(f"  {c.verdict:>10}  {c.name} (plugin {c.plugin}){prio}")
            lines.extend(f"              - {r}" for r in c.reasons)
        bad = [p for p in self.plugins if p.status != "loaded" or p.error]
        if bad:
            lines.append("plugin problems:")
            lines.extend(f"  {p.name}: {p.status}: {p.error}" for p in bad)
        return "\n".join(lines)


def _spec_line(spec: AttentionSpec) -> str:
    rope = "none"
    if spec.rope is not None:
        style = "interleaved" if spec.rope.interleaved else "rotate-half"
        rope = f"theta={spec.rope.theta:g} {style} rotary_dim={spec.rotary_dim}"
    return (
        f"heads {spec.num_heads}/{spec.num_kv_heads} x {spec.head_dim}, "
        f"{str(spec.dtype).removeprefix('torch.')}, "
        f"{'causal' if spec.causal else 'bidirectional'}, rope {rope}, "
        f"logn {spec.logn_base if spec.use_logn_attn else 'off'}"
        + (", MLA" if spec.use_mla else "")
        + (", headwise" if spec.headwise is not None else "")
    )


def _judge(
    entry: BackendEntry, spec: AttentionSpec, platform: Platform, has_kv_cache: bool
) -> tuple[list[Reason], int | None, str | None]:
    backend = entry.backend
    reasons: list[Reason] = []
    if has_kv_cache:
        reasons.append(
            Reason(ReasonCode.KV_CACHE_PRESENT,
                   "serves no-KV-cache prefill only; a KV cache is present",
                   "has_kv_cache", "True", "False")
        )
    try:
        reasons.extend(backend.supports(spec, platform))
    except Exception as exc:
        reasons.append(
            Reason(ReasonCode.BACKEND_SPECIFIC,
                   f"supports() raised {type(exc).__name__}: {exc}")
        )
    rule = backend.capabilities.priority_for(spec, platform)
    if rule is None:
        return reasons, None, None
    return reasons, rule.score, rule.describe()


_cache: dict[tuple[object, ...], Selection] = {}
_cache_lock = threading.Lock()


def clear_selection_cache() -> None:
    with _cache_lock:
        _cache.clear()


def select(
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    has_kv_cache: bool = False,
    need_rope_kv_cache: bool | None = None,
    backend: str | None = None,
    platform: Platform | str | None = None,
    registry: Registry | None = None,
) -> Selection:
    """Pick the no-cache prefill backend for ``spec`` on this machine (or on ``platform``).

    An explicit ``backend`` (or the ``ATTN_BACKEND`` environment variable) is honoured or
    refused with its reasons, never swapped for another. Raises `KVCacheFlagError` when the
    RoPE/KV-cache flag contradicts the model and `NoBackendError` when nothing fits.
    """
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"select() takes an AttentionSpec, got {type(spec).__name__}")
    flag = derive_need_rope_kv_cache(spec, has_kv_cache, need_rope_kv_cache)
    if isinstance(platform, str):
        plat = parse_platform(platform)
    elif isinstance(platform, Platform):
        plat = platform
    else:
        plat = detect_platform(device)
    env_choice = os.environ.get(BACKEND_ENV, "").strip() or None
    explicit, source = (
        (backend, "explicit") if backend is not None
        else (env_choice, "environment") if env_choice is not None
        else (None, "priority")
    )
    reg = registry if registry is not None else get_registry()
    key = (spec, plat, has_kv_cache, flag, need_rope_kv_cache, explicit, source, id(reg),
           reg.generation)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    selection = _decide(spec, plat, has_kv_cache, flag, need_rope_kv_cache, explicit, source, reg)
    with _cache_lock:
        selection = _cache.setdefault(key, selection)
    logger.info(
        "attention backend %s selected by %s for %s on %s", selection.name, source,
        _spec_line(spec), plat,
    )
    return selection


def _decide(
    spec: AttentionSpec,
    plat: Platform,
    has_kv_cache: bool,
    flag: bool,
    flag_given: bool | None,
    explicit: str | None,
    source: DecisionSource,
    reg: Registry,
) -> Selection:
    entries = reg.entries()
    judged = [(entry, *_judge(entry, spec, plat, has_kv_cache)) for entry in entries]
    winner: BackendEntry | None = None
    if explicit is not None:
        match = next((j for j in judged if j[0].backend.name == explicit), None)
        if match is None:
            known = ", ".join(e.backend.name for e in entries) or "none registered"
            where = "backend=" if source == "explicit" else f"${BACKEND_ENV}="
            raise NoBackendError(f"unknown backend {where}{explicit!r}; known backends: {known}")
        if match[1]:
            raise NoBackendError(
                f"backend {explicit!r} was chosen explicitly ({source}) but cannot serve this "
                "request; it is not swapped for another:\n"
                + "\n".join(f"  - {r}" for r in match[1]),
                [(explicit, match[1])],
            )
        winner = match[0]
    else:
        ranked = [j for j in judged if not j[1] and j[2] is not None]
        ranked.sort(key=lambda j: (-(j[2] or 0), j[0].order))
        if ranked:
            winner = ranked[0][0]
    if winner is None:
        lines = []
        for entry, reasons, prio, _ in judged:
            text = "; ".join(str(r) for r in reasons) if reasons else (
                "fits, but has no priority on this platform (choose it explicitly)"
                if prio is None else "fits"
            )
            lines.append(f"  - {entry.backend.name}: {text}")
        head = (
            "no backend serves this request: this path serves no-KV-cache prefill only, and a "
            "KV cache is present (use the engine's KV-cache attention path)"
            if has_kv_cache
            else f"no backend serves {_spec_line(spec)} on {plat}"
        )
        raise NoBackendError(
            head + ":\n" + "\n".join(lines),
            [(e.backend.name, r) for e, r, _, _ in judged],
        )
    candidates = []
    for entry, reasons, prio, rule in judged:
        verdict: Verdict
        if entry is winner:
            verdict = "selected"
        elif reasons:
            verdict = "rejected"
        elif prio is None:
            verdict = "not ranked"
        else:
            verdict = "eligible"
        if verdict == "not ranked":
            reasons = [
                Reason(ReasonCode.NOT_RANKED,
                       f"no priority rule for {plat}; chosen only when named explicitly")
            ]
        candidates.append(
            Candidate(entry.backend.name, entry.plugin, verdict, prio, rule, tuple(reasons))
        )
    order = {"selected": 0, "eligible": 1, "not ranked": 2, "rejected": 3}
    candidates.sort(key=lambda c: (order[c.verdict], -(c.priority or 0)))
    bound = winner.backend.bind(spec)
    return Selection(
        backend=bound,
        spec=spec,
        platform=plat,
        has_kv_cache=has_kv_cache,
        need_rope_kv_cache=flag,
        flag_given=flag_given,
        source=source,
        candidates=tuple(candidates),
        details=tuple(sorted(bound.describe(plat).items())),
        plugins=tuple(reg.records()),
    )
