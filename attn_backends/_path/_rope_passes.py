"""The table of separate RoPE/logn passes: the core's own, and those plugins bring.

A plugin declares its passes in its `PluginManifest` (``rope_passes=[...]``). The registry
checks each one while it loads the plugin, in the plugin's thread: a malformed pass (ranks that
are not ``(platform kind, int)`` pairs, a ``refusal`` that raises on a plain RoPE spec) refuses
that plugin, and only it. Once the plugin has loaded, its passes are installed here on its
behalf, and they are withdrawn with it: a plugin that fails leaves none behind, and neither
does a registry replaced by `reset_registry`, a load undone by an interrupt, or a plugin whose
every backend was evicted. A pass whose ``refusal`` raises later, on some other spec, is judged
unable to serve that spec: one bad pass never makes RoPE specs unservable.

`register_rope_pass` is the older way in. Called by plugin code while the plugin loads (at
import, or in its hook), the pass is held for that plugin exactly as a manifest entry is, with a
`DeprecationWarning`; called by the host process itself (tests, an engine's own pass), it is
installed for the life of the process.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar, get_args

from .._values._errors import SpecError
from .._values._platform import PlatformKind, parse_platform

if TYPE_CHECKING:
    import torch

    from .._values._params import FMHAParams
    from .._values._platform import Platform
    from .._values._spec import AttentionSpec

PLATFORM_KINDS: tuple[PlatformKind, ...] = get_args(PlatformKind)
IN_KERNEL_NAMES = frozenset({"none", "fused"})
"""Preprocess modes that are not a pass (``_preprocess.IN_KERNEL``); no pass may take them."""
PROBE_PLATFORMS: dict[PlatformKind, str] = {
    "cpu": "cpu",
    "cuda": "cuda:sm90",
    "rocm": "rocm:gfx942",
}
"""Where a plugin's pass is asked about a plain RoPE spec at registration (dry-run platforms)."""

T = TypeVar("T")
SeparateApply = Callable[["torch.Tensor", "torch.Tensor", "AttentionSpec", "FMHAParams"], bool]
"""``(q, k, spec, params) -> bool``: a pass on separate Q and K tensors (`RopePass`)."""


@dataclass(frozen=True)
class RopePass:
    """One implementation of the separate in-place RoPE/logn pass, and where it ranks.

    ``apply`` rotates the Q|K columns of the valid rows of the packed buffer in place and
    returns True, or returns False, having written nothing, for a buffer it cannot take (the
    torch pass then serves that call).
    """

    name: str
    ranks: tuple[tuple[PlatformKind, int], ...]
    """Platform kinds served and the rank on each: higher is tried first."""
    note: str
    """The evidence for the ranks (a measurement, a policy)."""
    refusal: Callable[[AttentionSpec, Platform], str | None]
    """Why the pass cannot serve a spec on a platform (None: it can)."""
    apply: Callable[[torch.Tensor, AttentionSpec, FMHAParams], bool]
    apply_separate: SeparateApply | None = None
    """The same pass on separate ``q`` ``[rows, Hq, D]`` and ``k`` ``[rows, Hkv, D]`` (heads
    dense in a row, rows strided), in place on their valid rows; False, having written nothing,
    for tensors it cannot take. None: separate input goes through the torch pass."""

    def rank(self, kind: PlatformKind) -> int | None:
        return next((r for k, r in self.ranks if k == kind), None)


Owner = tuple[int, str]
"""Who holds an installed pass: (registry serial, plugin name)."""
IN_PROCESS_OWNER: Owner = (-1, "in process")
"""The host process itself (`register_rope_pass` outside plugin loading)."""


@dataclass
class _Held:
    original: RopePass
    """The object the plugin gave (so that giving it again is recognised)."""
    guarded: RopePass
    """The same pass with its ``refusal`` guarded: what the choice of a pass sees."""
    owners: set[Owner] = field(default_factory=set)


_lock = threading.Lock()
_core: dict[str, RopePass] = {}
_held: dict[str, _Held] = {}
_generation = 0


def _bump() -> None:
    global _generation
    _generation += 1


def table_generation() -> int:
    """Changes whenever a pass is installed or withdrawn: cached choices of a pass key on it."""
    with _lock:
        return _generation


def set_core_passes(*passes: RopePass) -> None:
    """The core's own passes (``native``, ``torch``), always present, never guarded."""
    with _lock:
        for core in passes:
            _core[core.name] = core
        _bump()


def _shape_problems(candidate: object) -> list[str]:
    """What is malformed about a pass as declared; empty when it can be ranked and called."""
    if not isinstance(candidate, RopePass):
        return [f"a RoPE pass must be a RopePass, got {type(candidate).__name__}"]
    problems: list[str] = []
    name: object = candidate.name
    if not isinstance(name, str) or not name or name in IN_KERNEL_NAMES:
        problems.append(f"a RoPE pass cannot be named {name!r}")
    ranks: object = candidate.ranks
    if not isinstance(ranks, tuple) or not ranks:
        problems.append(
            f"RoPE pass {name!r}: ranks must be a non-empty tuple of (platform kind, int) pairs, "
            f"got {ranks!r}"
        )
    else:
        kinds = []
        for pair in ranks:
            ok = isinstance(pair, tuple) and len(pair) == 2
            kind, rank = pair if ok else (None, None)
            if not ok or kind not in PLATFORM_KINDS or type(rank) is not int:
                problems.append(
                    f"RoPE pass {name!r}: rank {pair!r} is not a (platform kind, int) pair "
                    f"(kinds: {', '.join(PLATFORM_KINDS)})"
                )
            kinds.append(kind)
        if len(set(kinds)) != len(kinds):
            problems.append(f"RoPE pass {name!r}: a platform kind is ranked twice")
    if not isinstance(candidate.note, str):
        problems.append(f"RoPE pass {name!r}: note must be a str")
    if not callable(candidate.refusal):
        problems.append(f"RoPE pass {name!r}: refusal must be callable")
    if not callable(candidate.apply):
        problems.append(f"RoPE pass {name!r}: apply must be callable")
    if candidate.apply_separate is not None and not callable(candidate.apply_separate):
        problems.append(f"RoPE pass {name!r}: apply_separate must be callable or None")
    return problems


def _probe_problem(candidate: RopePass) -> str | None:
    """Ask the pass about a plain RoPE spec on each platform it ranks: it must answer with a
    reason or None, not raise (else every RoPE spec there would fail to resolve)."""
    import torch

    from .._values._spec import AttentionSpec, RopeSpec

    spec = AttentionSpec(8, 8, 64, torch.float16, causal=True, rope=RopeSpec(10000.0))
    for kind, _ in candidate.ranks:
        platform = parse_platform(PROBE_PLATFORMS[kind])
        try:
            answer: object = candidate.refusal(spec, platform)
        except Exception as exc:
            return (
                f"RoPE pass {candidate.name!r}: refusal() raised {type(exc).__name__}: {exc} "
                f"for a plain RoPE spec on {platform}"
            )
        if answer is not None and not isinstance(answer, str):
            return (
                f"RoPE pass {candidate.name!r}: refusal() returned {type(answer).__name__}, "
                "not a reason (str) or None"
            )
    return None


def rope_pass_problems(candidate: object) -> list[str]:
    """Every reason ``candidate`` cannot join the table (empty: it can), its probe included.

    Runs plugin code (``refusal``): the registry calls it in the plugin's thread.
    """
    problems = _shape_problems(candidate)
    if problems or not isinstance(candidate, RopePass):
        return problems
    probe = _probe_problem(candidate)
    return [probe] if probe is not None else []


def _guard(rope_pass: RopePass) -> RopePass:
    """The pass with a ``refusal`` that turns an exception into a reason not to use it."""
    declared = rope_pass.refusal

    def refusal(spec: AttentionSpec, platform: Platform) -> str | None:
        try:
            answer: object = declared(spec, platform)
        except Exception as exc:
            return f"refusal() raised {type(exc).__name__}: {exc}"
        if answer is None or isinstance(answer, str):
            return answer
        return f"refusal() returned {type(answer).__name__}, not a reason (str) or None"

    return replace(rope_pass, refusal=refusal)


def _taken(rope_pass: RopePass) -> str | None:
    """Why ``rope_pass.name`` is not free for this object; call under ``_lock``."""
    if rope_pass.name in _core:
        return f"a RoPE pass named {rope_pass.name!r} is already registered (by the core)"
    held = _held.get(rope_pass.name)
    if held is not None and held.original is not rope_pass:
        owners = ", ".join(sorted(name for _, name in held.owners))
        return f"a RoPE pass named {rope_pass.name!r} is already registered (by {owners})"
    return None


def install(owner: Owner, passes: Sequence[RopePass]) -> str | None:
    """Install checked passes on ``owner``'s behalf, all or none; why not, else None.

    The same pass object may be held by several owners (two registries loading one plugin); it
    stays until the last of them withdraws.
    """
    names = [p.name for p in passes]
    if len(set(names)) != len(names):
        return f"RoPE passes named twice: {', '.join(sorted(names))}"
    with _lock:
        for candidate in passes:
            problem = _taken(candidate)
            if problem is not None:
                return problem
        for candidate in passes:
            held = _held.setdefault(candidate.name, _Held(candidate, _guard(candidate)))
            held.owners.add(owner)
        if passes:
            _bump()
    return None


def withdraw(owner: Owner) -> None:
    """Drop ``owner``'s hold on its passes; a pass nobody holds leaves the table."""
    _withdraw_where(lambda held: held == owner)


def withdraw_registry(serial: int) -> None:
    """Drop every hold of the registry with ``serial`` (replaced, or garbage)."""
    _withdraw_where(lambda held: held[0] == serial)


def clear_host_passes() -> None:
    """Withdraw the passes the host process gave `register_rope_pass`, which no registry owns
    and so no `reset_registry` takes back; a plugin's pass stays while its registry holds it."""
    withdraw(IN_PROCESS_OWNER)


def _withdraw_where(match: Callable[[Owner], bool]) -> None:
    with _lock:
        changed = False
        for name in list(_held):
            held = _held[name]
            dropped = {o for o in held.owners if match(o)}
            if dropped:
                held.owners -= dropped
                changed = True
            if not held.owners:
                del _held[name]
        if changed:
            _bump()


def rope_passes() -> tuple[RopePass, ...]:
    """Every pass in the table: the core's, then the plugins' (guarded) in install order."""
    with _lock:
        return (*_core.values(), *(held.guarded for held in _held.values()))


def find_rope_pass(name: str) -> RopePass | None:
    with _lock:
        core = _core.get(name)
        if core is not None:
            return core
        held = _held.get(name)
        return held.guarded if held is not None else None


def passes_for(kind: PlatformKind) -> tuple[RopePass, ...]:
    """The passes serving ``kind``, best rank first (ties by name, for a stable order)."""
    ranked: list[tuple[int, str, RopePass]] = []
    for candidate in rope_passes():
        rank = candidate.rank(kind)
        if rank is not None:
            ranked.append((-rank, candidate.name, candidate))
    return tuple(candidate for _, _, candidate in sorted(ranked, key=lambda x: x[:2]))


class _Collector(threading.local):
    """Passes given to `register_rope_pass` by plugin code on this thread while it loads."""

    passes: list[RopePass] | None = None


_collector = _Collector()


def collecting(fn: Callable[[], T]) -> tuple[T, tuple[RopePass, ...]]:
    """``fn()`` (plugin code), and the passes it gave `register_rope_pass` meanwhile: those
    belong to the plugin, and are installed only if it loads."""
    outer = _collector.passes
    _collector.passes = []
    try:
        value = fn()
        return value, tuple(_collector.passes)
    finally:
        _collector.passes = outer


def register_rope_pass(rope_pass: RopePass) -> None:
    """Add a separate RoPE/logn implementation (deprecated for plugins: declare it in the
    `PluginManifest` instead).

    Called while a plugin loads, the pass belongs to that plugin: checked and installed with
    it, never if it fails. Called by the host process, it is installed for the life of the
    process; its name becomes a preprocess mode shown in decision records. Registering the same
    object again is a no-op; a malformed pass, or another pass under a taken name, is a
    `SpecError`.
    """
    if not isinstance(rope_pass, RopePass):
        raise SpecError(f"register_rope_pass() takes a RopePass, got {type(rope_pass).__name__}")
    pending = _collector.passes
    if pending is not None:
        warnings.warn(
            "register_rope_pass() from plugin code is deprecated: list the pass in the plugin's "
            "PluginManifest(rope_passes=[...]) instead",
            DeprecationWarning,
            stacklevel=2,
        )
        pending.append(rope_pass)
        return
    problems = rope_pass_problems(rope_pass)
    if problems:
        raise SpecError("; ".join(problems))
    problem = install(IN_PROCESS_OWNER, (rope_pass,))
    if problem is not None:
        raise SpecError(problem)
