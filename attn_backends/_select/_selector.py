"""Backend selection: one decision per request, with every candidate's reasons on record."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from .._backend._protocol import NoCachePrefill
from .._path._rope_passes import table_generation
from .._values._dtypes import dtype_name
from .._values._errors import InvalidArgumentError, NoBackendError, PlatformError, SpecError
from .._values._feature_table import FEATURES
from .._values._platform import Platform, detect_platform, parse_platform
from .._values._reasons import Reason, ReasonCode
from .._values._records import canonical_json, json_safe
from .._values._spec import AttentionSpec
from ._canary import CANARY_OFF, CanaryResult, run_canary
from ._flags import derive_need_rope_kv_cache
from ._isolation import refuse_reentry
from ._policy import DISABLE_ENV, PLUGINS_ENV, PluginPolicy
from ._ranking import ranked, unplaced_reason
from ._registry import (
    BackendEntry,
    PluginRecord,
    Registry,
    RegistrySnapshot,
    get_registry,
)

logger = logging.getLogger("attn_backends")

BACKEND_ENV = "ATTN_BACKEND"
STRICT_ENV = "ATTN_BACKENDS_STRICT"
"""``1``/``true``/``yes``/``on``: run the canary on every `select` that has no ``strict=``."""
DecisionSource = Literal["explicit", "environment", "ranking"]
Verdict = Literal["selected", "eligible", "rejected", "not ranked"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class Candidate:
    """One registered backend as the selector judged it."""

    name: str
    plugin: str
    verdict: Verdict
    place: int | None
    """Place in line for this request (1: tried first); None: chosen only by name."""
    placed_by: str | None
    """The ranking-table row or plugin `Placement` that gave the place."""
    reasons: tuple[Reason, ...]
    assumed_libraries: tuple[str, ...] = ()
    """Libraries this backend needs that a dry run assumed present without checking."""

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "plugin": self.plugin,
            "verdict": self.verdict,
            "place": self.place,
            "placed_by": self.placed_by,
            "reasons": [r.to_dict() for r in self.reasons],
            "assumed_libraries": list(self.assumed_libraries),
        }


@dataclass(frozen=True)
class Selection:
    """The decision record: the winner, bound to the spec, and how it was chosen."""

    backend: NoCachePrefill
    name: str
    """The winner's name as registered (its bound instance was checked to carry it)."""
    spec: AttentionSpec
    platform: Platform
    has_kv_cache: bool
    need_rope_kv_cache: bool
    flag_given: bool | None
    source: DecisionSource
    candidates: tuple[Candidate, ...]
    details: tuple[tuple[str, str], ...]
    plugins: tuple[PluginRecord, ...]
    policy: PluginPolicy = field(default_factory=PluginPolicy)
    """The allow/block lists in force when the decision was made."""
    strict: bool = False
    canary: CanaryResult = CANARY_OFF
    """The strict-mode canary of the winner (``off`` unless strict)."""
    policy_unmatched: tuple[str, ...] = ()
    """Names in the allow/block lists that match no plugin or registered backend (typos)."""
    cuda_graph: bool = False
    """Chosen for graph mode (only backends that declare ``cuda_graph`` were candidates)."""

    def fingerprint(self) -> str:
        """Stable text identifying the decision; equal on ranks that chose alike (values
        normalised: ``RopeSpec(10000)`` and ``RopeSpec(10000.0)`` give one text)."""
        return canonical_json(
            json_safe(
                {"backend": self.name, "details": dict(self.details), "spec": self.spec.to_dict()}
            )
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
            "policy": self.policy.to_dict(),
            "policy_unmatched": list(self.policy_unmatched),
            "strict": self.strict,
            "cuda_graph": self.cuda_graph,
            "canary": self.canary.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "plugins": [p.to_dict() for p in self.plugins],
        }

    def explain(self) -> str:
        chosen = next((c for c in self.candidates if c.verdict == "selected"), None)
        decided = (
            f"decided by: {chosen.placed_by}"
            if self.source == "ranking" and chosen is not None and chosen.placed_by
            else f"decided by: the name {self.name!r} ({self.source})"
        )
        lines = [
            f"selected: {self.name} (by {self.source})",
            decided,
            f"spec: {_spec_line(self.spec)}",
            f"platform: {self.platform}"
            + (f" [{self.platform.device_name}]" if self.platform.device_name else "")
            + (" (dry run: library checks assumed to pass)" if self.platform.assumed else ""),
            f"kv cache: {'present' if self.has_kv_cache else 'none'}; need_rope_kv_cache="
            f"{self.need_rope_kv_cache} ({'given' if self.flag_given is not None else 'derived'})",
            f"plugin policy: {self.policy.describe()}"
            + (
                f" (matching no plugin or backend: {', '.join(self.policy_unmatched)})"
                if self.policy_unmatched
                else ""
            ),
            f"strict: on; {self.canary.detail}" if self.strict else "strict: off",
        ]
        if self.cuda_graph:
            lines.append("graph mode: only backends that declare cuda_graph were candidates")
        if self.details:
            lines.append("details: " + ", ".join(f"{k}={v}" for k, v in self.details))
        lines.append("candidates:")
        for c in self.candidates:
            place = f" place {c.place}" if c.place is not None else ""
            lines.append(f"  {c.verdict:>10}  {c.name} (plugin {c.plugin}){place}")
            if c.placed_by is not None:
                lines.append(f"              placed by {c.placed_by}")
            lines.extend(f"              - {r}" for r in c.reasons)
            if c.assumed_libraries:
                lines.append(f"              (assumed installed: {', '.join(c.assumed_libraries)})")
        off = [p for p in self.plugins if p.status == "disabled"]
        if off:
            lines.append("plugins disabled:")
            lines.extend(f"  {p.name}: {p.error}" for p in off)
        bad = [
            p for p in self.plugins if p.status != "disabled" and (p.status != "loaded" or p.error)
        ]
        if bad:
            lines.append("plugin problems:")
            lines.extend(f"  {p.name}: {p.status}: {p.error}" for p in bad)
        return "\n".join(lines)


def _spec_line(spec: AttentionSpec) -> str:
    rope = "none"
    if spec.rope is not None:
        style = "interleaved" if spec.rope.interleaved else "rotate-half"
        rope = f"theta={spec.rope.theta:g} {style} rotary_dim={spec.rotary_dim}"
    features = [f.explain(spec) for f in FEATURES if f.used(spec)]
    return (
        f"heads {spec.num_heads}/{spec.num_kv_heads} x {spec.head_dim}, "
        f"{dtype_name(spec.dtype)}, "
        f"{'causal' if spec.causal else 'bidirectional'}, rope {rope}, "
        f"logn {spec.logn_base if spec.use_logn_attn else 'off'}"
        + "".join(f", {text}" for text in features if text is not None)
    )


def _require_bool(name: str, value: object, *, optional: bool = False) -> None:
    """A flag must be a real bool: ``'False'`` is truthy, and would silently mean True."""
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    raise InvalidArgumentError(
        f"select({name}=...) takes {allowed}, got {type(value).__name__} {value!r}"
    )


@dataclass(frozen=True)
class SelectRequest:
    """What a caller asks `select` for: the one argument set of every way into a decision.

    `select`, `select_across_ranks`, `warmup`, the command line and the conformance suite all
    build or take one, so an argument added here reaches every one of them. Checked when built
    (a flag must be a real bool; a device or platform string must parse) and hashable, so it
    can key a cache. ``device`` is normalised to a `torch.device` and ``platform`` to a
    `Platform`, so equal requests written differently compare equal.
    """

    spec: AttentionSpec
    device: torch.device | str | None = None
    """Where the backend will run (and a strict canary runs); None: the accelerator if any."""
    platform: Platform | str | None = None
    """A dry-run platform such as ``cuda:sm90`` instead of detecting ``device``'s."""
    has_kv_cache: bool = False
    need_rope_kv_cache: bool | None = None
    """None: derived from the spec (`derive_need_rope_kv_cache`)."""
    backend: str | None = None
    """An explicit backend, honoured or refused with its reasons (default: ``$ATTN_BACKEND``)."""
    strict: bool | None = None
    """Run the canary before trusting the winner (None: ``$ATTN_BACKENDS_STRICT``)."""
    cuda_graph: bool = False
    """The caller captures ``forward`` in CUDA graphs (graph mode): only backends that declare
    ``capabilities.cuda_graph`` qualify."""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, AttentionSpec):
            raise SpecError(f"select() takes an AttentionSpec, got {type(self.spec).__name__}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise NoBackendError(
                f"backend= must be a backend name (str), got {type(self.backend).__name__}"
            )
        _require_bool("has_kv_cache", self.has_kv_cache)
        _require_bool("need_rope_kv_cache", self.need_rope_kv_cache, optional=True)
        _require_bool("strict", self.strict, optional=True)
        _require_bool("cuda_graph", self.cuda_graph)
        object.__setattr__(self, "device", _device(self.device))
        if isinstance(self.platform, str):
            object.__setattr__(self, "platform", parse_platform(self.platform))
        elif self.platform is not None and not isinstance(self.platform, Platform):
            raise PlatformError(
                f"platform must be a Platform, a string such as 'cuda:sm90', or None; got "
                f"{type(self.platform).__name__}"
            )


@dataclass(frozen=True)
class _Request:
    """A `SelectRequest` resolved against the environment: everything a decision depends on
    besides the registry; hashable, so it keys the cache."""

    spec: AttentionSpec
    platform: Platform
    has_kv_cache: bool
    flag: bool
    flag_given: bool | None
    explicit: str | None
    source: DecisionSource
    policy: PluginPolicy
    strict: bool
    canary_device: str | None
    """Where the strict canary runs; None when strict is off or the platform is a dry run."""
    cuda_graph: bool = False


@dataclass
class _Judged:
    entry: BackendEntry
    reasons: list[Reason]
    place: int | None = None
    placed_by: str | None = None

    @property
    def name(self) -> str:
        return self.entry.name


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _supports(entry: BackendEntry, spec: AttentionSpec, platform: Platform) -> list[Reason]:
    """The class's ``supports`` with a plugin's exception or wrong return turned into a reason."""
    try:
        found = entry.backend.supports(spec, platform)
    except Exception as exc:
        return [Reason(ReasonCode.BACKEND_SPECIFIC, f"supports() raised {_short_error(exc)}")]
    if not isinstance(found, list) or not all(isinstance(r, Reason) for r in found):
        return [
            Reason(
                ReasonCode.BACKEND_SPECIFIC,
                f"supports() returned {type(found).__name__}, not a list of Reason",
            )
        ]
    return found


def _judge(entry: BackendEntry, req: _Request) -> _Judged:
    refusal = req.policy.backend_refusal(entry.name, entry.plugin)
    if refusal is not None:
        return _Judged(entry, [Reason(ReasonCode.DISABLED, refusal, DISABLE_ENV)])
    reasons: list[Reason] = []
    if req.has_kv_cache:
        reasons.append(
            Reason(
                ReasonCode.KV_CACHE_PRESENT,
                "serves no-KV-cache prefill only; a KV cache is present",
                "has_kv_cache",
                "True",
                "False",
            )
        )
    if req.cuda_graph and not entry.capabilities.cuda_graph:
        reasons.append(
            Reason(
                ReasonCode.CUDA_GRAPH,
                "cannot be captured in a CUDA graph and re-planned per batch (graph mode)",
                "capabilities.cuda_graph",
                "False",
                "True (a backend that declares graph mode)",
            )
        )
    reasons.extend(_supports(entry, req.spec, req.platform))
    return _Judged(entry, reasons)


_Key = tuple[_Request, int, int, int]
"""The request, the registry's serial and generation, and the RoPE pass table's generation
(a pass installed or withdrawn changes the ``preprocess`` a backend describes)."""
SELECTION_CACHE_SIZE = 256
"""Decisions kept, least recently used dropped first: an engine asks a handful of distinct
questions, but a long-lived process that builds specs on the fly must not grow forever."""
_cache: OrderedDict[_Key, Selection] = OrderedDict()
_cache_lock = threading.Lock()
_deciding: dict[_Key, threading.Lock] = {}
"""One lock per request being decided: threads asking the same thing at once wait for the first
and share its result (a strict canary runs once, not once per thread); other requests proceed."""


_platforms: dict[tuple[str, tuple[str, ...]], Platform] = {}
"""Detected platforms by device and probed libraries: the machine does not change under a
process, so `select` probes it once per device (`clear_selection_cache` forgets them, for a
library installed since)."""


_cleared = 0
"""How many times `clear_selection_cache` ran: part of `decision_epoch`."""


def clear_selection_cache() -> None:
    """Forget every decision and every detected platform: the next `select` probes the machine
    and decides again (after installing a library, or in tests)."""
    global _cleared
    with _cache_lock:
        _cache.clear()
        _platforms.clear()
        _cleared += 1


def decision_epoch() -> tuple[object, ...]:
    """Everything a decision depends on besides its request, read in a few microseconds: the
    process registry and its generation, the RoPE pass table, the environment variables
    `select` reads and the clears of its cache. A caller that keeps a `Selection` (the
    transformers integration keeps one per attention module) reuses it while this value is
    unchanged, and asks `select` again when it changes, so a decision kept on a model follows
    the registry and the environment exactly as `select`'s own cache does."""
    registry = get_registry()
    return (
        registry.serial,
        registry.generation,
        table_generation(),
        _cleared,
        *_selection_environment(),
    )


_EPOCH_ENV = (BACKEND_ENV, STRICT_ENV, PLUGINS_ENV, DISABLE_ENV)
_EPOCH_ENV_KEYS: dict[object, tuple[object, ...]] = {}
"""`_EPOCH_ENV` as keys of each `os.environ` mapping seen (by its key encoder)."""


def _selection_environment() -> tuple[object, ...]:
    """The variables of `_EPOCH_ENV` as set now: what `os.environ.get` answers, read from the
    dict that CPython's `os.environ` keeps them in (``_data``, which every write through
    `os.environ` updates) with the names encoded once, where it has one. `os.environ.get`
    encodes each name and decodes each value per call (microseconds, once per forward of a
    served model); any other mapping in its place is read through ``get``. Values are
    compared, never used, so the raw encoded value serves."""
    env = os.environ
    # CPython's os._Environ keeps these as instance attributes, which typeshed does not name
    own = vars(env) if type(env) is os._Environ else {}
    data, encode = own.get("_data"), own.get("encodekey")
    if isinstance(data, dict) and callable(encode):
        keys = _EPOCH_ENV_KEYS.get(encode)
        if keys is None:
            keys = _EPOCH_ENV_KEYS[encode] = tuple(encode(name) for name in _EPOCH_ENV)
        return tuple(data.get(key) for key in keys)
    return tuple(env.get(name) for name in _EPOCH_ENV)


def _cached(key: _Key) -> Selection | None:
    """The cached decision, marked as just used; call under ``_cache_lock``."""
    found = _cache.get(key)
    if found is not None:
        _cache.move_to_end(key)
    return found


def _remember(key: _Key, selection: Selection) -> None:
    """Cache a decision, dropping the least recently used beyond the bound."""
    with _cache_lock:
        _cache[key] = selection
        _cache.move_to_end(key)
        while len(_cache) > SELECTION_CACHE_SIZE:
            _cache.popitem(last=False)


def strict_from_env() -> bool:
    """``$ATTN_BACKENDS_STRICT`` as a bool; an unrecognised value is taken as on, with a warning."""
    raw = os.environ.get(STRICT_ENV, "").strip().lower()
    if raw in _FALSE:
        return False
    if raw not in _TRUE:
        logger.warning("%s=%r is not one of 1/0/true/false; strict mode is on", STRICT_ENV, raw)
    return True


def _platform_for(
    device: torch.device | None, platform: Platform | None, libraries: tuple[str, ...]
) -> Platform:
    """The platform to select for; a detected one has every library in ``libraries`` probed."""
    if platform is not None:
        return platform
    key = (str(device), libraries)
    with _cache_lock:
        known = _platforms.get(key)
    if known is not None:
        return known
    try:
        found = detect_platform(device, extra_libraries=libraries)
    except (RuntimeError, AssertionError) as exc:
        raise PlatformError(f"cannot inspect device {device}: {exc}") from None
    with _cache_lock:
        return _platforms.setdefault(key, found)


def _device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlatformError(f"device {device!r} is not a torch device: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise PlatformError(
            f"select() picks kernels for cpu or cuda devices (ROCm GPUs are cuda in torch); "
            f"got {dev}"
        )
    return dev


def _canary_device(device: torch.device | None, plat: Platform) -> str:
    if device is not None:
        return str(device)
    return "cpu" if plat.kind == "cpu" else "cuda"


def select(
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    has_kv_cache: bool = False,
    need_rope_kv_cache: bool | None = None,
    backend: str | None = None,
    platform: Platform | str | None = None,
    registry: Registry | None = None,
    strict: bool | None = None,
    cuda_graph: bool = False,
) -> Selection:
    """Pick the no-cache prefill backend for ``spec`` on this machine (or on ``platform``).

    Sugar for ``select_request(SelectRequest(spec, ...), registry=registry)``; the fields of
    `SelectRequest` say what each argument means.

    An explicit ``backend`` (or the ``ATTN_BACKEND`` environment variable) is honoured or
    refused with its reasons, never swapped for another. Backends switched off by
    ``ATTN_BACKENDS_DISABLE``/``ATTN_BACKENDS_PLUGINS`` are refused with a ``disabled`` reason.
    With ``strict`` (default: ``ATTN_BACKENDS_STRICT``) the winner first runs a canary against
    the reference on ``device``; one that fails is recorded and the next candidate is taken,
    or, when chosen explicitly, `NoBackendError` is raised. A dry-run ``platform`` string skips
    the canary (nothing to run on) and the record says so.

    Raises `KVCacheFlagError` when the RoPE/KV-cache flag contradicts the model,
    `PlatformError` for a device or platform that cannot be used, and `NoBackendError` when
    nothing fits.

    With ``cuda_graph=True`` only backends that can serve graph mode (``capabilities.
    cuda_graph``: captured once per bucket, re-planned per batch) are candidates.
    """
    refuse_reentry("select()")
    request = SelectRequest(
        spec,
        device=device,
        platform=platform,
        has_kv_cache=has_kv_cache,
        need_rope_kv_cache=need_rope_kv_cache,
        backend=backend,
        strict=strict,
        cuda_graph=cuda_graph,
    )
    return select_request(request, registry=registry)


def select_request(request: SelectRequest, *, registry: Registry | None = None) -> Selection:
    """The decision for ``request`` (see `select`), from ``registry`` (default: the process's).

    Decisions are cached (least recently used dropped first) per request, environment,
    registry and registry generation.
    """
    refuse_reentry("select()")
    if not isinstance(request, SelectRequest):
        raise InvalidArgumentError(
            f"select_request() takes a SelectRequest, got {type(request).__name__}"
        )
    if registry is not None and not isinstance(registry, Registry):
        raise InvalidArgumentError(
            f"select(registry=...) takes a Registry or None, got {type(registry).__name__}"
        )
    spec = request.spec
    flag = derive_need_rope_kv_cache(spec, request.has_kv_cache, request.need_rope_kv_cache)
    reg = registry if registry is not None else get_registry()
    snap = reg.snapshot()
    device = _device(request.device)
    given = request.platform if isinstance(request.platform, Platform) else None
    plat = _platform_for(device, given, snap.required_libraries())
    env_choice = os.environ.get(BACKEND_ENV, "").strip() or None
    explicit = request.backend if request.backend is not None else env_choice
    source: DecisionSource = (
        "explicit"
        if request.backend is not None
        else "environment"
        if env_choice is not None
        else "ranking"
    )
    on = strict_from_env() if request.strict is None else request.strict
    req = _Request(
        spec=spec,
        platform=plat,
        has_kv_cache=request.has_kv_cache,
        flag=flag,
        flag_given=request.need_rope_kv_cache,
        explicit=explicit,
        source=source,
        policy=PluginPolicy.from_env(),
        strict=on,
        canary_device=_canary_device(device, plat) if on and not plat.assumed else None,
        cuda_graph=request.cuda_graph,
    )
    key = (req, reg.serial, snap.generation, table_generation())
    with _cache_lock:
        cached = _cached(key)
        if cached is not None:
            return cached
        decision_lock = _deciding.setdefault(key, threading.Lock())
    with decision_lock:
        with _cache_lock:
            cached = _cached(key)
        if cached is not None:
            return cached
        try:
            selection = _decide(req, snap)
            _remember(key, selection)
        finally:
            with _cache_lock:
                _deciding.pop(key, None)
    logger.info(
        "attention backend %s selected by %s for %s on %s",
        selection.name,
        source,
        _spec_line(spec),
        plat,
    )
    return selection


_Winner = tuple[NoCachePrefill, tuple[tuple[str, str], ...], CanaryResult]


def _bind(entry: BackendEntry, spec: AttentionSpec, platform: Platform) -> NoCachePrefill | Reason:
    """The judged class bound to ``spec`` (``supports`` was empty: it is not asked again),
    refused unless it made an instance of that class carrying that name (else the record, and
    the engine, would run something other than what was judged)."""
    cls = entry.backend
    try:
        bound = cls(spec, platform)
        name: object = bound.name if isinstance(bound, cast(type, cls)) else None
    except Exception as exc:
        return Reason(ReasonCode.BACKEND_SPECIFIC, f"binding raised {_short_error(exc)}")
    if not isinstance(bound, cast(type, cls)):
        return Reason(
            ReasonCode.BACKEND_SPECIFIC,
            f"{cast(type, cls).__name__}(spec, platform) returned a {type(bound).__name__}: a "
            "backend class must construct an instance of itself",
        )
    if name != entry.name:
        return Reason(
            ReasonCode.BACKEND_SPECIFIC,
            f"binding made a backend named {name!r}, not {entry.name!r}",
        )
    return bound


def _try_winner(judged: _Judged, req: _Request) -> _Winner | Reason:
    """Bind the candidate and, in strict mode, run its canary; a failure becomes a reason."""
    bound = _bind(judged.entry, req.spec, req.platform)
    if isinstance(bound, Reason):
        return bound
    try:
        described = bound.describe(req.platform)
    except Exception as exc:
        return Reason(ReasonCode.BACKEND_SPECIFIC, f"describe() raised {_short_error(exc)}")
    if not isinstance(described, dict):
        return Reason(
            ReasonCode.BACKEND_SPECIFIC,
            f"describe() returned {type(described).__name__}, not a dict",
        )
    details = tuple(sorted((str(k), str(v)) for k, v in described.items()))
    if not req.strict:
        return bound, details, CANARY_OFF
    if req.canary_device is None:
        return (
            bound,
            details,
            CanaryResult(
                "skipped",
                f"canary skipped: {req.platform} is a dry-run platform, nothing to run on",
            ),
        )
    probe = _bind(judged.entry, req.spec, req.platform)
    if isinstance(probe, Reason):
        return probe
    result = run_canary(probe, req.spec, req.canary_device)
    if result.status == "failed":
        got = f"{result.relative_error:.3g}" if result.relative_error is not None else None
        allowed = f"< {result.tolerance:g}" if result.tolerance is not None else None
        return Reason(ReasonCode.CANARY_FAILED, result.detail, "strict", got, allowed)
    return bound, details, result


def _failure_lines(judged: list[_Judged], platform: Platform) -> list[str]:
    lines = []
    for j in judged:
        if j.reasons:
            text = "; ".join(str(r) for r in j.reasons)
        elif j.place is None:
            text = f"fits, but {unplaced_reason(j.entry, platform)}"
        else:
            text = "fits"
        lines.append(f"  - {j.name}: {text}")
    return lines


def _failed_record(
    req: _Request,
    judged: list[_Judged],
    snap: RegistrySnapshot,
    unmatched: tuple[str, ...],
    message: str,
) -> dict[str, object]:
    """The decision record of a selection that found no backend: `Selection.to_dict`'s shape,
    with no winner, every candidate's verdict and reasons, and the error."""
    candidates = [_candidate(j, False, req.platform) for j in judged]
    return {
        "selected": None,
        "source": req.source,
        "spec": req.spec.to_dict(),
        "platform": req.platform.to_dict(),
        "has_kv_cache": req.has_kv_cache,
        "need_rope_kv_cache": req.flag,
        "need_rope_kv_cache_given": req.flag_given,
        "details": {},
        "policy": req.policy.to_dict(),
        "policy_unmatched": list(unmatched),
        "strict": req.strict,
        "cuda_graph": req.cuda_graph,
        "canary": CANARY_OFF.to_dict(),
        "candidates": [c.to_dict() for c in candidates],
        "plugins": [p.to_dict() for p in snap.records],
        "error": {"type": NoBackendError.__name__, "message": message},
    }


def _nothing_registered(
    req: _Request, snap: RegistrySnapshot, unmatched: tuple[str, ...]
) -> tuple[str, list[tuple[str, list[Reason]]]]:
    """Why no backend is registered at all, as text and as reasons (one per plugin)."""
    lines = [
        f"no backend serves {_spec_line(req.spec)} on {req.platform}: no backend is registered"
    ]
    reasons: list[tuple[str, list[Reason]]] = []
    if not snap.records:
        text = (
            "no plugin of the attn_backends entry-point group is installed (reinstall "
            "attn-backends: its built-in backends are plugins too)"
        )
        lines.append(f"  - {text}")
        reasons.append(("(no plugin)", [Reason(ReasonCode.BACKEND_SPECIFIC, text)]))
    else:
        lines[0] += ", because no plugin loaded one:"
    for record in snap.records:
        why = record.error or "it offered no backend"
        code = ReasonCode.DISABLED if record.status == "disabled" else ReasonCode.BACKEND_SPECIFIC
        lines.append(f"  - plugin {record.name}: {record.status}: {why}")
        reasons.append((f"plugin {record.name}", [Reason(code, f"plugin {record.status}: {why}")]))
    if unmatched:
        lines.append(
            f"${PLUGINS_ENV}/${DISABLE_ENV} name {', '.join(repr(n) for n in unmatched)}, which "
            f"match no plugin; unset ${PLUGINS_ENV} to load every plugin, or list plugin names "
            "(`attn-backends list` shows them)"
        )
    return "\n".join(lines), reasons


def _unknown(req: _Request, snap: RegistrySnapshot) -> NoBackendError:
    known = ", ".join(e.name for e in snap.entries) or "none registered"
    where = "backend=" if req.source == "explicit" else f"${BACKEND_ENV}="
    text = f"unknown backend {where}{req.explicit!r}; known backends: {known}"
    unloaded = [p for p in snap.records if p.status != "loaded"]
    if unloaded:
        text += "; plugins not loaded: " + "; ".join(
            f"{p.name} ({p.status}: {p.error})" for p in unloaded
        )
    return NoBackendError(text, record=_failed_record(req, [], snap, _unmatched(req, snap), text))


@functools.lru_cache(maxsize=64)
def _warn_unmatched(names: tuple[str, ...]) -> None:
    """Warn once per process for each set of names that match nothing (a typo, most often)."""
    logger.warning(
        "$%s/$%s name %s, which match no plugin or registered backend (use plugin:NAME or "
        "backend:NAME to say which is meant)",
        PLUGINS_ENV,
        DISABLE_ENV,
        ", ".join(repr(n) for n in names),
    )


def _unmatched(req: _Request, snap: RegistrySnapshot) -> tuple[str, ...]:
    names = req.policy.unmatched((r.name for r in snap.records), (e.name for e in snap.entries))
    if names:
        _warn_unmatched(names)
    return names


def _decide(req: _Request, snap: RegistrySnapshot) -> Selection:
    unmatched = _unmatched(req, snap)
    judged = [_judge(entry, req) for entry in snap.entries]
    of = {j.name: j for j in judged}
    for n, place in enumerate(ranked(req.spec, req.platform, snap.entries), start=1):
        of[place.entry.name].place, of[place.entry.name].placed_by = n, place.by
    if req.explicit is not None:
        match = of.get(req.explicit)
        if match is None:
            raise _unknown(req, snap)
        order = [match]
    else:
        order = sorted(
            (j for j in judged if not j.reasons and j.place is not None),
            key=lambda j: j.place or 0,
        )
    winner: tuple[_Judged, _Winner] | None = None
    for cand in order:
        if cand.reasons:
            break
        outcome = _try_winner(cand, req)
        if isinstance(outcome, Reason):
            cand.reasons.append(outcome)
            logger.warning("attention backend %s passed over: %s", cand.name, outcome)
            continue
        winner = (cand, outcome)
        break
    if winner is None:
        raise _no_winner(req, judged, order, snap, unmatched)
    chosen, (bound, details, canary) = winner
    candidates = [_candidate(j, j is chosen, req.platform) for j in judged]
    order_of = {"selected": 0, "eligible": 1, "not ranked": 2, "rejected": 3}
    candidates.sort(key=lambda c: (order_of[c.verdict], c.place or len(judged) + 1))
    return Selection(
        backend=bound,
        name=chosen.name,
        spec=req.spec,
        platform=req.platform,
        has_kv_cache=req.has_kv_cache,
        need_rope_kv_cache=req.flag,
        flag_given=req.flag_given,
        source=req.source,
        candidates=tuple(candidates),
        details=details,
        plugins=snap.records,
        policy=req.policy,
        strict=req.strict,
        canary=canary,
        policy_unmatched=unmatched,
        cuda_graph=req.cuda_graph,
    )


def _no_winner(
    req: _Request,
    judged: list[_Judged],
    order: list[_Judged],
    snap: RegistrySnapshot,
    unmatched: tuple[str, ...],
) -> NoBackendError:
    """The error of a decision without a winner, its record attached."""
    reasons: list[tuple[str, list[Reason]]]
    if req.explicit is not None:
        refused = order[0].reasons
        text = (
            f"backend {req.explicit!r} was chosen explicitly ({req.source}) but cannot serve "
            "this request; it is not swapped for another:\n"
            + "\n".join(f"  - {r}" for r in refused)
        )
        reasons = [(req.explicit, refused)]
    elif not judged:
        text, reasons = _nothing_registered(req, snap, unmatched)
    else:
        head = (
            "no backend serves this request: this path serves no-KV-cache prefill only, and a "
            "KV cache is present (use the engine's KV-cache attention path)"
            if req.has_kv_cache
            else f"no backend serves {_spec_line(req.spec)} on {req.platform}"
        )
        text = head + ":\n" + "\n".join(_failure_lines(judged, req.platform))
        reasons = [(j.name, j.reasons) for j in judged]
    record = _failed_record(req, judged, snap, unmatched, text)
    return NoBackendError(text, reasons, record=record)


def _candidate(j: _Judged, selected: bool, plat: Platform) -> Candidate:
    verdict: Verdict
    reasons = tuple(j.reasons)
    if selected:
        verdict = "selected"
    elif reasons:
        verdict = "rejected"
    elif j.place is None:
        verdict = "not ranked"
        reasons = (Reason(ReasonCode.NOT_RANKED, unplaced_reason(j.entry, plat)),)
    else:
        verdict = "eligible"
    assumed = j.entry.capabilities.requires if plat.assumed else ()
    return Candidate(j.name, j.entry.plugin, verdict, j.place, j.placed_by, reasons, assumed)
