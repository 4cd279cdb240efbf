"""The plugin host cannot be hijacked or hung.

Each fault below is one plugin doing something wrong while it loads or registers: raising any
kind of exception, calling back into the registry, never returning, declaring malformed
capabilities or ranks, or trying to stand in for a built-in backend. For every one the test
checks that the fault is recorded against that plugin alone and that ``select()`` still chooses
torch-sdpa, explicitly and by default, and computes the right numbers. A RoPE pass belongs to
the plugin that brings it: checked with it, installed only if it loads, withdrawn with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import attn_backends_builtin.aiter
import attn_backends_builtin.flashinfer
import attn_backends_builtin.headwise
import attn_backends_builtin.trt
import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
import attn_backends.deploy
import attn_backends.errors
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends import cli
from attn_backends._backend import _validation
from attn_backends._path import _preprocess, _rope_passes
from attn_backends._select import _isolation
from tests.plugin_site import PluginSite, open_site
from tests.static_plugin import StaticPlugin

# Imported up front so that loading the built-ins under a short test timeout never waits on disk.
BUILTIN_MODULES = (
    attn_backends_builtin.aiter,
    attn_backends_builtin.flashinfer,
    attn_backends_builtin.headwise,
    attn_backends_builtin.trt,
    torch_sdpa,
)
SPEC = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(1e4))
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugin-guide.md"
SHORT_TIMEOUT = 1.0
"""Seconds a hanging plugin is given in the tests; the built-ins, imported above, need far less."""
ENV_VARS = (
    "ATTN_BACKEND",
    "ATTN_BACKENDS_PLUGINS",
    "ATTN_BACKENDS_DISABLE",
    "ATTN_BACKENDS_STRICT",
    "ATTN_BACKENDS_PLUGIN_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    ab.deploy.reset_registry()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    yield from open_site(tmp_path, monkeypatch)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """``plugin_host_gate.RELEASE``: a hanging plugin waits on it; set when the test ends."""
    release = threading.Event()
    module = types.ModuleType("plugin_host_gate")
    module.RELEASE = release  # type: ignore[attr-defined]  # a module built for the test
    monkeypatch.setitem(sys.modules, "plugin_host_gate", module)
    yield release
    release.set()


def _record(reg: ab.deploy.Registry, name: str) -> ab.deploy.PluginRecord:
    return next(r for r in reg.records() if r.name == name)


def _sdpa_still_works(reg: ab.deploy.Registry) -> None:
    """torch-sdpa (the built-in class) is chosen by default and explicitly, with right numbers."""
    for backend in (None, "torch-sdpa"):
        sel = ab.select(SPEC, device="cpu", backend=backend, registry=reg)
        assert sel.name == "torch-sdpa"
        assert type(sel.backend) is torch_sdpa.TorchSdpaBackend
        assert sel.candidates[0].name == "torch-sdpa"
    params = ab.FMHAParams.from_lengths([3, 9], device="cpu")
    qkv = torch.randn(12, SPEC.qkv_width, generator=torch.Generator().manual_seed(0))
    ref = ab.reference_attention(qkv, SPEC, params)
    out = sel.backend.forward(qkv.clone(), sel.backend.prepare(params))
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[torch.float32]


def _contained(
    reg: ab.deploy.Registry, capsys: pytest.CaptureFixture[str], plugin: str, error: str
) -> None:
    """The plugin is recorded as failed with ``error``; nothing else is disturbed."""
    rec = _record(reg, plugin)
    assert rec.status == "failed"
    assert rec.error is not None
    assert error in rec.error
    assert rec.backends == ()
    _sdpa_still_works(reg)
    assert error in ab.select(SPEC, device="cpu", registry=reg).explain()
    ab.deploy.reset_registry(reg)
    assert cli.main(["list", "--platform", "cpu"]) == 0
    assert error in capsys.readouterr().out


def _finishes(work: Callable[[], ab.deploy.Registry], within: float = 60.0) -> ab.deploy.Registry:
    """Run ``work`` in a thread; fail (instead of hanging the suite) if it deadlocks."""
    out: list[ab.deploy.Registry] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # handed to the test thread, whatever it is
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), "loading the plugins deadlocked"
    if errors:
        pytest.fail(f"loading let {type(errors[0]).__name__} escape: {errors[0]}")
    return out[0]


def _default_registry() -> ab.deploy.Registry:
    ab.deploy.reset_registry()
    return _finishes(ab.deploy.get_registry)


def _loaded(reg: ab.deploy.Registry, policy: ab.deploy.PluginPolicy) -> ab.deploy.Registry:
    """``reg`` after loading the entry points under ``policy`` (in a thread, see `_finishes`)."""

    def load() -> ab.deploy.Registry:
        reg.load_entry_points(policy=policy)
        return reg

    return _finishes(load)


# ---- faults while a plugin loads: its import and its hook ---------------------------------------

_RAISE_ODD = 'raise type("VendorAbort", (BaseException,), {})("odd base exception")'
_REENTRY_SPEC = "ab.AttentionSpec(4, 4, 32, torch.float32, causal=True)"

LOAD_FAULTS: dict[str, tuple[str, str]] = {
    "generator-exit": ('raise GeneratorExit("vendor generator closed")', "GeneratorExit"),
    "system-exit": ('raise SystemExit("vendor gave up")', "SystemExit: vendor gave up"),
    "pytest-skip": (
        'import pytest; pytest.skip("no vendor device", allow_module_level=True)',
        "Skipped: no vendor device",
    ),
    "pytest-fail": ('import pytest; pytest.fail("vendor self-test")', "Failed: vendor self-test"),
    "odd-base-exception": (_RAISE_ODD, "VendorAbort: odd base exception"),
    "get-registry": (
        "import attn_backends as ab; ab.deploy.get_registry()",
        "ReentrantRegistryError: get_registry() was called by a plugin while it was being loaded",
    ),
    "select": (
        f"import attn_backends as ab, torch; ab.select({_REENTRY_SPEC})",
        "ReentrantRegistryError: select() was called by a plugin",
    ),
    "reset-registry": (
        "import attn_backends as ab; ab.deploy.reset_registry()",
        "ReentrantRegistryError: reset_registry() was called by a plugin",
    ),
}
"""Statement a plugin runs (at import or in its hook) -> text its record must hold."""


def _plugin_source(where: str, statement: str) -> str:
    if where == "import":
        return statement + "\n"
    return (
        "from attn_backends.plugin import hookimpl\n\n"
        "@hookimpl\n"
        "def attn_backends_register(host_api_version):\n"
        f"    {statement}\n"
    )


@pytest.mark.parametrize("where", ["import", "hook"])
@pytest.mark.parametrize("fault", sorted(LOAD_FAULTS))
def test_a_plugin_fault_while_loading_is_contained(
    site: PluginSite, capsys: pytest.CaptureFixture[str], fault: str, where: str
) -> None:
    statement, error = LOAD_FAULTS[fault]
    site.add_module("faulty_plugin", _plugin_source(where, statement))
    site.add_dist("vendor-faulty", {"faulty": "faulty_plugin"})
    reg = _default_registry()
    _contained(reg, capsys, "faulty", error)
    if where == "import":
        assert (_record(reg, "faulty").error or "").startswith("import failed: ")


HANGS = {
    "import": "import failed: import of hang_plugin did not finish within",
    "hook": "hook of plugin hang did not finish within",
}
"""Where a plugin waits forever -> text its record must hold."""


@pytest.mark.parametrize("where", sorted(HANGS))
def test_a_plugin_that_never_returns_is_given_up_on(
    site: PluginSite,
    capsys: pytest.CaptureFixture[str],
    gate: threading.Event,
    where: str,
) -> None:
    statement = "import plugin_host_gate; plugin_host_gate.RELEASE.wait()"
    site.add_module("hang_plugin", _plugin_source(where, statement))
    site.add_dist("vendor-hang", {"hang": "hang_plugin"})
    only = ab.deploy.PluginPolicy(allow=frozenset({"torch-sdpa", "hang"}))
    reg = _loaded(ab.deploy.Registry(plugin_timeout=SHORT_TIMEOUT), only)
    _contained(reg, capsys, "hang", f"{HANGS[where]} {SHORT_TIMEOUT:g} s")
    assert "$ATTN_BACKENDS_PLUGIN_TIMEOUT" in (_record(reg, "hang").error or "")


def test_the_plugin_timeout_comes_from_the_environment(
    site: PluginSite, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.add_module("hang_plugin", "import plugin_host_gate; plugin_host_gate.RELEASE.wait()\n")
    site.add_dist("vendor-hang", {"hang": "hang_plugin"})
    monkeypatch.setenv("ATTN_BACKENDS_PLUGIN_TIMEOUT", "0.75")
    reg = _loaded(ab.deploy.Registry(), ab.deploy.PluginPolicy())
    assert "did not finish within 0.75 s" in (_record(reg, "hang").error or "")
    assert _record(reg, "torch-sdpa").status == "loaded"


@pytest.mark.parametrize("raw", ["soon", "-1", "0", "nan", "inf"])
def test_a_bad_timeout_setting_warns_and_keeps_the_default(
    raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        seconds = _isolation.timeout_from_env({"ATTN_BACKENDS_PLUGIN_TIMEOUT": raw})
    assert seconds == _isolation.DEFAULT_PLUGIN_TIMEOUT
    assert f"ATTN_BACKENDS_PLUGIN_TIMEOUT={raw!r} is not a positive number" in caplog.text
    assert _isolation.timeout_from_env({"ATTN_BACKENDS_PLUGIN_TIMEOUT": " 2.5 "}) == 2.5
    assert _isolation.timeout_from_env({}) == _isolation.DEFAULT_PLUGIN_TIMEOUT


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), float("inf"), True, "5"])
def test_a_bad_timeout_argument_is_refused(bad: object) -> None:
    with pytest.raises(ab.errors.InvalidArgumentError, match="plugin_timeout must be"):
        ab.deploy.Registry(plugin_timeout=bad)  # type: ignore[arg-type]  # the wrong types on purpose


@pytest.mark.parametrize("where", ["import", "hook"])
def test_keyboard_interrupt_aborts_loading_and_leaves_the_registry_as_it_was(
    site: PluginSite, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    site.add_module("interrupt_plugin", _plugin_source(where, "raise KeyboardInterrupt"))
    site.add_dist("zz-vendor-interrupt", {"interrupt": "interrupt_plugin"})  # loads last
    reg = ab.deploy.Registry()
    reg.register_plugin(StaticPlugin(_backend("kept-backend")), name="kept")  # not ranked
    before = reg.snapshot()
    with pytest.raises(KeyboardInterrupt):
        reg.load_entry_points(policy=ab.deploy.PluginPolicy())
    after = reg.snapshot()
    assert after.entries == before.entries, "backends loaded before the interrupt were kept"
    assert after.records == before.records
    assert after.generation != before.generation, "the selection cache would not notice"
    reg.load_entry_points(policy=ab.deploy.PluginPolicy(disable=frozenset({"plugin:interrupt"})))
    assert _record(reg, "torch-sdpa").status == "loaded", "loading again found leftovers"
    _sdpa_still_works(reg)
    ab.deploy.reset_registry()
    with pytest.raises(KeyboardInterrupt):
        ab.deploy.get_registry()
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "plugin:interrupt")
    _sdpa_still_works(ab.deploy.get_registry())


# ---- malformed declarations: refused at registration, that backend alone -----------------------

_EAGER = abp.Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
CPU = ab.parse_platform("cpu")


def _tampered(value: object, **fields: object) -> object:
    """A copy of a frozen declaration with fields set past its constructor, as a buggy plugin
    could build it (dataclasses check no field types)."""
    copy = dataclasses.replace(value)  # type: ignore[type-var]  # any dataclass instance
    for name, field_value in fields.items():
        object.__setattr__(copy, name, field_value)
    return copy


class _OnClass:
    """A class attribute computed on every read, from the class as from an instance (a
    ``property`` computes nothing when read from the class)."""

    def __init__(self, read: Callable[[], object]) -> None:
        self.read = read

    def __get__(self, instance: object, owner: type | None = None) -> object:
        return self.read()


def _raises() -> object:
    raise RuntimeError("vendor table not loaded")


def _backend(name: object, caps: object = _EAGER) -> type[torch_sdpa.TorchSdpaBackend]:
    """A torch-sdpa subclass declaring ``name`` and ``capabilities`` as given (even broken)."""
    cls = type(
        "VendorBackend", (torch_sdpa.TorchSdpaBackend,), {"name": name, "capabilities": caps}
    )
    return cast("type[torch_sdpa.TorchSdpaBackend]", cls)


def _candidate(sel: ab.Selection, name: str) -> ab.Candidate:
    return next(c for c in sel.candidates if c.name == name)


class _Offers:
    """An in-process plugin whose hook returns the manifest it was given."""

    def __init__(self, manifest: abp.PluginManifest) -> None:
        self.manifest = manifest

    @abp.hookimpl
    def attn_backends_register(self, host_api_version: str) -> abp.PluginManifest:
        return self.manifest


DECLARATION_FAULTS: dict[str, tuple[object, object, str]] = {
    "head-dims-int": (
        "vendor",
        _tampered(_EAGER, head_dims=16),
        "capabilities.head_dims must be a frozenset of int or None, got int",
    ),
    "head-dims-str": (
        "vendor",
        _tampered(_EAGER, head_dims=frozenset({"64"})),
        "capabilities.head_dims must be a frozenset of int or None; it holds str",
    ),
    "platforms-set": (
        "vendor",
        _tampered(_EAGER, platforms={"cpu"}),
        "capabilities.platforms must be a frozenset of str, got set",
    ),
    "platform-unknown": (
        "vendor",
        _tampered(_EAGER, platforms=frozenset({"cpu", "tpu"})),
        "capabilities.platforms holds tpu; use cpu, cuda, rocm",
    ),
    "dtypes-str": (
        "vendor",
        _tampered(_EAGER, dtypes=frozenset({"float32"})),
        "capabilities.dtypes must be a frozenset of dtype; it holds str",
    ),
    "min-sm-str": ("vendor", _tampered(_EAGER, min_sm="80"), "capabilities.min_sm must be an int"),
    "flag-str": ("vendor", _tampered(_EAGER, gqa="yes"), "capabilities.gqa must be True or False"),
    "feature-flag-str": (
        "vendor",
        _tampered(_EAGER, features=(_tampered(abp.WindowSupport(), right="yes"),)),
        "capabilities.features[window].right must be True or False, got 'yes'",
    ),
    "requires-str": (
        "vendor",
        _tampered(_EAGER, requires="flashinfer"),
        "capabilities.requires must be a tuple of import names",
    ),
    "capabilities-dict": (
        "vendor",
        {"platforms": ["cpu"]},
        "capabilities must be a Capabilities, not dict",
    ),
    "capabilities-property-raises": (
        "vendor",
        _OnClass(_raises),
        "raised while being inspected: RuntimeError: vendor table not loaded",
    ),
    "name-int": (42, _EAGER, "VendorBackend.name must be a str, got int"),
    "name-empty": ("", _EAGER, "VendorBackend.name '' must be 1-100 letters"),
    "name-comma": ("a,b", _EAGER, "VendorBackend.name 'a,b' must be 1-100 letters"),
    "name-property-raises": (
        _OnClass(_raises),
        _EAGER,
        "raised while being inspected: RuntimeError: vendor table not loaded",
    ),
}
"""Backend name and capabilities a plugin declares -> text its record must hold."""


@pytest.mark.parametrize("fault", sorted(DECLARATION_FAULTS))
def test_a_malformed_declaration_refuses_that_backend_alone(
    capsys: pytest.CaptureFixture[str], fault: str
) -> None:
    name, caps, error = DECLARATION_FAULTS[fault]
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_backend(name, caps)), name="vendor")
    assert [e.name for e in reg.entries()] == ["torch-sdpa"]
    _contained(reg, capsys, "vendor", error)


def test_one_bad_backend_of_a_plugin_leaves_its_good_ones() -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    bad = _backend("vendor-bad", _tampered(_EAGER, head_dims=16))
    first = abp.Placement("vendor-good", before="torch-sdpa", platform="cpu")
    plugin = StaticPlugin(bad, _backend("vendor-good"), placements=[first])
    record = reg.register_plugin(plugin, name="vendor")
    assert record.status == "loaded"
    assert record.backends == ("vendor-good",)
    assert "backend 'vendor-bad' (VendorBackend) refused: capabilities.head_dims" in (
        record.error or ""
    )
    assert ab.select(SPEC, device="cpu", registry=reg).name == "vendor-good"


# ---- malformed ranks: refused at registration, that rank alone ---------------------------------

RANK_FAULTS: dict[str, tuple[object, str]] = {
    "not-a-rank": ("vendor before torch-sdpa", "placements must hold Placement values, got str"),
    "not-its-backend": (
        abp.Placement("torch-sdpa", after="flex"),
        "torch-sdpa after flex: 'torch-sdpa' is not a backend this plugin registers",
    ),
    "before-and-after": (
        abp.Placement("vendor", before="torch-sdpa", after="flex"),
        "Placement('vendor') needs exactly one of before= and after=",
    ),
    "neither": (
        abp.Placement("vendor"),
        "Placement('vendor') needs exactly one of before= and after=",
    ),
    "next-to-itself": (
        abp.Placement("vendor", before="vendor"),
        "vendor before vendor: a backend cannot be placed next to itself",
    ),
    "platform-unknown": (
        abp.Placement("vendor", before="torch-sdpa", platform="gpu"),  # type: ignore[arg-type]
        "vendor before torch-sdpa on gpu: platform must be one of cpu, cuda, rocm or None",
    ),
    "anchor-name": (
        abp.Placement("vendor", after="a,b"),
        "vendor after a,b: the backend it is placed next to: name 'a,b' must be 1-100 letters",
    ),
    "anchor-not-str": (
        abp.Placement("vendor", before=42),  # type: ignore[arg-type]
        "vendor before 42: the backend it is placed next to: name must be a str, got int",
    ),
    "note-not-str": (
        abp.Placement("vendor", before="torch-sdpa", note=3),  # type: ignore[arg-type]
        "Placement('vendor').note must be a str",
    ),
}
"""A rank a plugin declares -> the problem its record must hold after ``placement refused: ``."""


@pytest.mark.parametrize("fault", sorted(RANK_FAULTS))
def test_a_malformed_rank_is_refused_alone(fault: str) -> None:
    bad, error = RANK_FAULTS[fault]
    good = abp.Placement("vendor-good", after="torch-sdpa", platform="cpu")
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    plugin = StaticPlugin(_backend("vendor"), _backend("vendor-good"), placements=[bad, good])  # type: ignore[list-item]
    record = reg.register_plugin(plugin, name="vendor")
    assert record.status == "loaded"
    assert record.backends == ("vendor", "vendor-good")
    assert f"placement refused: {error}" in (record.error or "")
    entry = reg.get("vendor")
    assert entry is not None and entry.placements == ()
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    vendor = _candidate(sel, "vendor")
    assert (vendor.verdict, vendor.place) == ("not ranked", None)
    assert [r.code for r in vendor.reasons] == [ab.ReasonCode.NOT_RANKED]
    placed = _candidate(sel, "vendor-good")
    assert (placed.verdict, placed.place) == ("eligible", 2), "the plugin's good rank still holds"
    assert f"placement refused: {error}" in sel.explain()
    assert ab.select(SPEC, device="cpu", backend="vendor", registry=reg).name == "vendor"
    _sdpa_still_works(reg)


# ---- the manifest's API version and what it registers --------------------------------------------


def test_a_manifest_for_plugin_api_1_is_incompatible(capsys: pytest.CaptureFixture[str]) -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    old = abp.PluginManifest("1.0", backends=[cast("abp.BackendClass", _backend("old-vendor"))])
    record = reg.register_plugin(_Offers(old), name="old")
    assert record.status == "incompatible"
    assert record.backends == () and reg.get("old-vendor") is None
    error = record.error or ""
    assert "built for plugin API 1.0" in error and "needs plugin API 2.0" in error
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert "old: incompatible: built for plugin API 1.0" in sel.explain()
    _sdpa_still_works(reg)
    ab.deploy.reset_registry(reg)
    assert cli.main(["list", "--platform", "cpu"]) == 0
    assert "needs plugin API 2.0" in capsys.readouterr().out


def test_an_instance_offered_under_api_2_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    bound = _backend("vendor-instance").bind(SPEC, CPU)
    manifest = abp.PluginManifest(abp.PLUGIN_API_VERSION, backends=[bound])  # type: ignore[list-item]
    reg.register_plugin(_Offers(manifest), name="vendor")
    assert reg.get("vendor-instance") is None
    _contained(
        reg,
        capsys,
        "vendor",
        "offered an instance of VendorBackend; plugin API 2.0 registers backend classes",
    )


# ---- declarations that go bad after registration: a reason, never a raw error ------------------
# (Ranks are read once, at registration, into the registry's entry: there is no rank to spoil
# afterwards.)

_SWITCH = {"broken": False}
"""Flipped by the test: the vendor backend's capabilities start raising."""


def _caps_until_broken() -> abp.Capabilities:
    if _SWITCH["broken"]:
        raise RuntimeError("vendor table unloaded")
    return _EAGER


def test_capabilities_that_start_raising_later_are_a_reason_for_that_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(_SWITCH, "broken", False)
    late = _backend("vendor-late", _OnClass(_caps_until_broken))
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    assert reg.register_plugin(StaticPlugin(late, first_on="cpu"), name="vendor").status == (
        "loaded"
    )
    assert ab.select(SPEC, device="cpu", registry=reg).name == "vendor-late"
    monkeypatch.setitem(_SWITCH, "broken", True)
    ab.deploy.clear_selection_cache()  # decisions are cached; the next one meets the spoilt backend
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    cand = _candidate(sel, "vendor-late")
    assert cand.verdict == "rejected"
    error = "supports() raised RuntimeError: vendor table unloaded"
    assert any(error in r.message for r in cand.reasons), cand.reasons
    with pytest.raises(ab.NoBackendError, match="not swapped"):
        ab.select(SPEC, device="cpu", registry=reg, backend="vendor-late")
    _sdpa_still_works(reg)


# ---- a plugin can never silently take over -------------------------------------------------------


class _ServesEverything(torch_sdpa.TorchSdpaBackend):
    """Claims every spec on every platform: the most a backend can say about itself."""

    name = "serves-everything"

    @classmethod
    def supports(cls, spec: ab.AttentionSpec, platform: ab.Platform) -> list[ab.Reason]:
        return []


class _PlacedBeforeFlashinfer(_ServesEverything):
    name = "before-flashinfer"


TAKEOVER_SPECS = (
    SPEC,
    ab.AttentionSpec(8, 8, 64, torch.float16, causal=False),
    ab.AttentionSpec(8, 2, 128, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6)),
    ab.AttentionSpec(4, 4, 32, torch.float8_e4m3fn, causal=False),
)
"""Specs torch-sdpa serves on the CPU, and one (FP8) that no built-in serves there."""


def _candidates_of(
    spec: ab.AttentionSpec, platform: str, reg: ab.deploy.Registry
) -> dict[str, str]:
    """Backend -> verdict for the default choice (none selected when nothing fits)."""
    try:
        sel = ab.select(spec, platform=platform, registry=reg)
    except ab.NoBackendError as exc:
        record = exc.record
    else:
        return {c.name: c.verdict for c in sel.candidates}
    assert record is not None
    rows = record["candidates"]
    assert isinstance(rows, list)
    return {str(c["name"]): str(c["verdict"]) for c in rows}


def test_a_plugin_can_never_silently_take_over(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _loaded(ab.deploy.Registry(), ab.deploy.PluginPolicy())
    placed = abp.Placement("before-flashinfer", before="flashinfer")
    plugin = StaticPlugin(_ServesEverything, _PlacedBeforeFlashinfer, placements=[placed])
    assert reg.register_plugin(plugin, name="vendor").error is None
    for spec in TAKEOVER_SPECS:
        for platform in ("cpu", "cuda:sm80", "cuda:sm90", "rocm:gfx942"):
            verdicts = _candidates_of(spec, platform, reg)
            assert verdicts["serves-everything"] == "not ranked", (spec, platform)
        cpu = _candidates_of(spec, "cpu", reg)
        assert cpu["before-flashinfer"] == "not ranked", spec
    sel = ab.select(SPEC, platform="cpu", registry=reg)
    reason = _candidate(sel, "before-flashinfer").reasons[0]
    assert reason.code == ab.ReasonCode.NOT_RANKED
    assert "placed next to flashinfer, which is not in line for this request on cpu" in (
        reason.message
    )
    # named, it runs; placed, it stands where its rank says, where flashinfer is in line
    assert ab.select(SPEC, device="cpu", backend="serves-everything", registry=reg).name == (
        "serves-everything"
    )
    monkeypatch.setenv("ATTN_BACKEND", "serves-everything")
    assert ab.select(SPEC, device="cpu", registry=reg).source == "environment"
    monkeypatch.delenv("ATTN_BACKEND")
    gpu = ab.select(TAKEOVER_SPECS[1], platform="cuda:sm90", registry=reg)
    assert gpu.name == "before-flashinfer"
    mine, theirs = _candidate(gpu, "before-flashinfer").place, _candidate(gpu, "flashinfer").place
    assert mine is not None and theirs == mine + 1
    assert f"decided by: plugin placement: {placed.describe()}" in gpu.explain()


# ---- impostors: a built-in name cannot be taken -------------------------------------------------

_IMPOSTOR = """
import torch
from attn_backends.plugin import Capabilities, PluginManifest, Placement, hookimpl
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

class Impostor(TorchSdpaBackend):  # keeps the name torch-sdpa
    capabilities = Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))

@hookimpl
def attn_backends_register(host_api_version):
    return PluginManifest("2.0", [Impostor], placements=[Placement("torch-sdpa", before="flex")])
"""


def test_a_distribution_sorting_first_cannot_replace_a_builtin(
    site: PluginSite, capsys: pytest.CaptureFixture[str]
) -> None:
    site.add_module("impostor_plugin", _IMPOSTOR)
    site.add_dist("aaa-impostor", {"aaa": "impostor_plugin"})  # sorts before attn-backends
    reg = _default_registry()
    entry = reg.get("torch-sdpa")
    assert entry is not None
    assert entry.builtin
    assert entry.plugin == "torch-sdpa"
    assert entry.origin.startswith("attn-backends ")
    _contained(reg, capsys, "aaa", "backend name 'torch-sdpa' is taken by plugin torch-sdpa")
    error = _record(reg, "aaa").error or ""
    assert f"({entry.origin})" in error, "the record names the built-in's distribution"
    assert "offered by aaa-impostor 1.0" in error, "the record names the impostor's distribution"


def test_a_plugin_cannot_reuse_a_builtin_plugin_name(site: PluginSite) -> None:
    site.add_module("impostor_plugin", _IMPOSTOR)
    site.add_dist("aaa-impostor", {"torch-sdpa": "impostor_plugin"})
    reg = _default_registry()
    records = [r for r in reg.records() if r.name == "torch-sdpa"]
    assert [r.status for r in records] == ["loaded", "failed"]
    assert "aaa-impostor" in records[1].source
    assert "already registered" in (records[1].error or "")
    _sdpa_still_works(reg)


def test_a_builtin_name_stays_reserved_when_the_builtin_is_disabled(site: PluginSite) -> None:
    site.add_module("impostor_plugin", _IMPOSTOR)
    site.add_dist("aaa-impostor", {"aaa": "impostor_plugin"})
    reg = ab.deploy.Registry()
    reg.load_entry_points(policy=ab.deploy.PluginPolicy(disable=frozenset({"plugin:torch-sdpa"})))
    assert _record(reg, "torch-sdpa").status == "disabled"
    assert reg.get("torch-sdpa") is None
    assert "backend name 'torch-sdpa' is kept for the built-in plugin torch-sdpa" in (
        _record(reg, "aaa").error or ""
    )
    with pytest.raises(ab.NoBackendError, match="unknown backend backend='torch-sdpa'"):
        ab.select(SPEC, device="cpu", backend="torch-sdpa", registry=reg)


def test_a_builtin_takes_its_name_back_from_an_earlier_in_process_plugin() -> None:
    reg = ab.deploy.Registry()
    early = reg.register_plugin(StaticPlugin(_backend("torch-sdpa")), name="early")
    assert early.status == "loaded"
    reg.load_entry_points(policy=ab.deploy.PluginPolicy(allow=frozenset({"torch-sdpa"})))
    entry = reg.get("torch-sdpa")
    assert entry is not None
    assert entry.builtin
    record = _record(reg, "early")
    assert record.status == "failed"
    assert record.backends == ()
    assert "backend 'torch-sdpa' removed: the name belongs to a built-in backend" in (
        record.error or ""
    )
    _sdpa_still_works(reg)


class _Shifty(torch_sdpa.TorchSdpaBackend):
    name = "shifty"
    capabilities = _EAGER


def test_a_backend_that_renames_itself_after_registration_is_not_confused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_Shifty, first_on="cpu"), name="vendor")
    monkeypatch.setattr(_Shifty, "name", "torch-sdpa")
    assert [e.name for e in reg.entries()] == ["torch-sdpa", "shifty"]
    sel = ab.select(SPEC, device="cpu", registry=reg)
    shifty = _candidate(sel, "shifty")
    assert shifty.verdict == "rejected"
    assert "binding made a backend named 'torch-sdpa', not 'shifty'" in shifty.reasons[0].message
    _sdpa_still_works(reg)


class _BindRaises(torch_sdpa.TorchSdpaBackend):
    name = "bind-raises"
    capabilities = _EAGER

    def __init__(self, spec: ab.AttentionSpec, platform: ab.Platform) -> None:
        raise RuntimeError("vendor context lost")


class _BindsOther(torch_sdpa.TorchSdpaBackend):
    name = "binds-other"
    capabilities = _EAGER

    def __new__(  # type: ignore[misc]  # makes another class: the fault under test
        cls, spec: ab.AttentionSpec, platform: ab.Platform
    ) -> torch_sdpa.TorchSdpaBackend:
        return torch_sdpa.TorchSdpaBackend(spec, platform)


class _BindsRenamed(torch_sdpa.TorchSdpaBackend):
    name = "binds-renamed"
    capabilities = _EAGER

    def __new__(cls, spec: ab.AttentionSpec, platform: ab.Platform) -> _BindsRenamed:
        return super().__new__(_Renamed)


class _Renamed(_BindsRenamed):
    """What `_BindsRenamed` makes: an instance of its own class, under another name."""

    name = "torch-sdpa"


BIND_FAULTS: dict[str, tuple[type[torch_sdpa.TorchSdpaBackend], str]] = {
    "raises": (_BindRaises, "binding raised RuntimeError: vendor context lost"),
    "other-class": (
        _BindsOther,
        "_BindsOther(spec, platform) returned a TorchSdpaBackend: a backend class must "
        "construct an instance of itself",
    ),
    "other-name": (_BindsRenamed, "binding made a backend named 'torch-sdpa', not 'binds-renamed'"),
}
"""A class whose ``cls(spec, platform)`` does not make the backend that was judged -> the
reason its candidate must carry."""


@pytest.mark.parametrize("fault", sorted(BIND_FAULTS))
def test_binding_must_make_the_judged_backend(fault: str) -> None:
    cls, error = BIND_FAULTS[fault]
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(cls, first_on="cpu"), name="vendor")
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    assert type(sel.backend) is torch_sdpa.TorchSdpaBackend
    assert sel.candidates[0].name == sel.name
    other = _candidate(sel, cls.name)
    assert other.verdict == "rejected"
    assert other.place == 1, "it was first in line, and passed over"
    assert error in other.reasons[0].message
    with pytest.raises(ab.NoBackendError, match="not swapped") as info:
        ab.select(SPEC, device="cpu", registry=reg, backend=cls.name)
    assert error in str(info.value)
    strict = ab.select(SPEC, device="cpu", registry=reg, strict=True)
    assert strict.name == "torch-sdpa"


IMPOSTOR_CASES = (
    test_a_distribution_sorting_first_cannot_replace_a_builtin,
    test_a_plugin_cannot_reuse_a_builtin_plugin_name,
    test_a_builtin_name_stays_reserved_when_the_builtin_is_disabled,
    test_a_builtin_takes_its_name_back_from_an_earlier_in_process_plugin,
    test_a_backend_that_renames_itself_after_registration_is_not_confused,
    test_binding_must_make_the_judged_backend,
)


# ---- third-party libraries are probed on real hardware ------------------------------------------


def _needs_vendor_lib(requires: str) -> type[torch_sdpa.TorchSdpaBackend]:
    caps = dataclasses.replace(_EAGER, requires=(requires,))
    return _backend("vendor-kernels", caps)


def test_a_library_a_backend_requires_is_probed(site: PluginSite) -> None:
    site.add_module("my_vendor_kernels", "raise RuntimeError('probing imported me')\n")
    site.add_dist("my-vendor-kernels", {}, version="2.1")
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    plugin = StaticPlugin(_needs_vendor_lib("my_vendor_kernels"), first_on="cpu")
    reg.register_plugin(plugin, name="vendor")
    assert reg.required_libraries() == ("my_vendor_kernels",)
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "vendor-kernels"
    assert not sel.platform.assumed
    assert sel.platform.library_version("my_vendor_kernels") == "2.1"
    assert "my_vendor_kernels" not in sys.modules, "probing imported the library"
    for platform in (
        ab.detect_platform("cpu", extra_libraries=["my_vendor_kernels"]),
        ab.detect_platform("cpu"),  # as `attn-backends list` and the conformance suite see it
    ):
        assert platform.library_version("my_vendor_kernels") == "2.1"


@pytest.mark.parametrize("requires", ["absent_vendor_kernels", "absent_vendor_kernels.ops"])
def test_a_missing_library_is_still_a_reason(requires: str) -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_needs_vendor_lib(requires), first_on="cpu"), name="vendor")
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    vendor = _candidate(sel, "vendor-kernels")
    assert [r.code for r in vendor.reasons] == [ab.ReasonCode.LIBRARY_MISSING]


def test_probing_a_dotted_name_or_a_broken_finder_never_imports_or_raises(
    site: PluginSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.add_module("my_vendor_pkg", "raise RuntimeError('probing imported me')\n")

    class _BrokenFinder:
        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> None:
            if name == "broken_vendor_lib":
                raise RuntimeError("finder crashed")
            return None

    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(), *sys.meta_path])
    platform = ab.detect_platform("cpu", extra_libraries=("my_vendor_pkg.ops", "broken_vendor_lib"))
    assert platform.has_library("my_vendor_pkg.ops")
    assert platform.library_version("my_vendor_pkg.ops") == "unknown"
    assert not platform.has_library("broken_vendor_lib")
    assert "my_vendor_pkg" not in sys.modules


# ---- the figures the guide states ---------------------------------------------------------------


CAPABILITY_FLAGS = (
    "gqa",
    "causal",
    "bidirectional",
    "needs_contiguous",
    "fused_rope",
    "cuda_graph",
)
FEATURE_FLAGS = (
    (abp.WindowSupport, "right"),
    (abp.AlibiSupport, "bidirectional"),
    (abp.AlibiSupport, "custom_slopes"),
    (abp.AlibiSupport, "with_softcap"),
    (abp.Fp8Support, "preprocess"),
)


@pytest.mark.parametrize("flag", CAPABILITY_FLAGS)
def test_every_capability_flag_must_be_a_bool(flag):
    problems = _validation.capability_problems(_tampered(_EAGER, **{flag: "yes"}))
    assert problems == [f"capabilities.{flag} must be True or False, got 'yes'"]


@pytest.mark.parametrize(("support", "flag"), FEATURE_FLAGS)
def test_every_feature_limit_must_be_a_bool(support, flag):
    caps = _tampered(_EAGER, features=(_tampered(support(), **{flag: "yes"}),))
    problems = _validation.capability_problems(caps)
    assert problems == [
        f"capabilities.features[{support.feature}].{flag} must be True or False, got 'yes'"
    ]


@pytest.mark.parametrize(
    ("features", "problem"),
    [
        ([abp.WindowSupport()], "capabilities.features must be a tuple of FeatureSupport values"),
        (("window",), "capabilities.features[0] must be one of AlibiSupport, "),
        ((abp.FeatureSupport(),), "capabilities.features[0] must be one of "),
        (
            (abp.WindowSupport(), abp.WindowSupport(right=False)),
            "capabilities.features lists WindowSupport twice",
        ),
    ],
    ids=["list", "str", "base-class", "twice"],
)
def test_feature_declarations_are_checked(features, problem):
    problems = _validation.capability_problems(_tampered(_EAGER, features=features))
    assert len(problems) == 1 and problems[0].startswith(problem), problems


# ---- RoPE passes belong to their plugin ---------------------------------------------------------

_ZZ_ROPE = """
import attn_backends as ab
import attn_backends.plugin as abp

def _double(packed, spec, params):
    packed.mul_(2.0)  # wrong on purpose: a pass that must never run
    return True

ZZ = abp.RopePass("zz-vendor-rope", (("cpu", 1000),), "vendor", lambda s, p: None, _double)
"""


def _rope_pass_names() -> set[str]:
    return {p.name for p in abp.rope_passes()}


def _runs_with_the_torch_pass(reg: ab.deploy.Registry) -> None:
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert dict(sel.details)["preprocess"] == "torch"
    _sdpa_still_works(reg)


@pytest.mark.parametrize(
    ("where", "how"),
    [("import", "register"), ("hook", "register"), ("hook", "manifest")],
)
def test_a_plugin_that_fails_leaves_no_rope_pass_behind(
    site: PluginSite, where: str, how: str
) -> None:
    give = "abp.register_rope_pass(ZZ)" if how == "register" else ""
    if where == "import":
        body = f"{_ZZ_ROPE}\n{give}\nraise ImportError('vendor library missing')\n"
    elif how == "register":
        body = (
            f"{_ZZ_ROPE}\n@abp.hookimpl\ndef attn_backends_register(host_api_version):\n"
            f"    {give}\n    raise ImportError('vendor library missing')\n"
        )
    else:  # a manifest whose only backend is refused: the plugin fails, its pass must go too
        body = (
            f"{_ZZ_ROPE}\n@abp.hookimpl\ndef attn_backends_register(host_api_version):\n"
            "    return abp.PluginManifest('2.0', backends=[object()], rope_passes=[ZZ])\n"
        )
    site.add_module("zz_vendor", body)
    site.add_dist("vendor-zz", {"zz": "zz_vendor"})
    deprecated = pytest.warns(DeprecationWarning, match=r"PluginManifest\(rope_passes")
    with deprecated if how == "register" else contextlib.nullcontext():
        reg = _default_registry()
    assert _record(reg, "zz").status == "failed"
    assert _record(reg, "zz").rope_passes == ()
    assert "zz-vendor-rope" not in _rope_pass_names()
    _runs_with_the_torch_pass(reg)


class _RopePlugin:
    """An in-process plugin offering a torch-sdpa twin and the given RoPE passes."""

    def __init__(self, *passes: object, backend: str = "vendor-sdpa") -> None:
        self.passes = passes
        self.backend = backend

    @abp.hookimpl
    def attn_backends_register(self, host_api_version: str) -> abp.PluginManifest:
        twin = cast(
            "abp.BackendClass",
            type("Twin", (torch_sdpa.TorchSdpaBackend,), {"name": self.backend}),
        )
        passes: list[abp.RopePass] = list(self.passes)  # type: ignore[arg-type]  # malformed on purpose
        return abp.PluginManifest(abp.PLUGIN_API_VERSION, backends=[twin], rope_passes=passes)


def _never_applied(packed: torch.Tensor, spec: ab.AttentionSpec, params: ab.FMHAParams) -> bool:
    raise AssertionError("this pass must never run")


def _fine(spec: ab.AttentionSpec, platform: ab.Platform) -> str | None:
    return None


def _refusal_raises(spec: ab.AttentionSpec, platform: ab.Platform) -> str | None:
    raise RuntimeError("vendor table corrupt")


def _answers_int(spec: ab.AttentionSpec, platform: ab.Platform) -> object:
    return 3


_GOOD = abp.RopePass("vendor-rope", (("cpu", 1000),), "vendor", _fine, _never_applied)

MALFORMED_PASSES: dict[str, tuple[object, str]] = {
    "float-rank": (
        dataclasses.replace(_GOOD, ranks=(("cpu", 1.5),)),  # type: ignore[arg-type]
        "('cpu', 1.5) is not a",
    ),
    "bool-rank": (dataclasses.replace(_GOOD, ranks=(("cpu", True),)), "('cpu', True) is not a"),
    "ranks-none": (
        dataclasses.replace(_GOOD, ranks=None),  # type: ignore[arg-type]
        "ranks must be a non-empty tuple",
    ),
    "unknown-kind": (
        dataclasses.replace(_GOOD, ranks=(("tpu", 1),)),  # type: ignore[arg-type]
        "('tpu', 1) is not a",
    ),
    "refusal-raises": (
        dataclasses.replace(_GOOD, refusal=_refusal_raises),
        "refusal() raised RuntimeError: vendor table corrupt",
    ),
    "refusal-answers-int": (
        dataclasses.replace(_GOOD, refusal=_answers_int),  # type: ignore[arg-type]
        "refusal() returned int",
    ),
    "separate-not-callable": (
        dataclasses.replace(_GOOD, apply_separate="rotate"),  # type: ignore[arg-type]
        "apply_separate must be callable or None",
    ),
    "in-kernel-name": (dataclasses.replace(_GOOD, name="fused"), "cannot be named 'fused'"),
    "core-name": (dataclasses.replace(_GOOD, name="torch"), "already registered (by the core)"),
    "not-a-pass": ("vendor-rope", "must be a RopePass, got str"),
}
"""A pass the registry must refuse (with its plugin) -> text the plugin's record holds."""


@pytest.mark.parametrize("fault", sorted(MALFORMED_PASSES))
def test_a_malformed_rope_pass_refuses_its_plugin_alone(fault: str) -> None:
    bad, error = MALFORMED_PASSES[fault]
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    before = _rope_pass_names()
    record = reg.register_plugin(_RopePlugin(bad), name="vendor")
    assert record.status == "failed"
    assert error in (record.error or "")
    assert record.backends == () and reg.get("vendor-sdpa") is None
    assert _rope_pass_names() == before
    _runs_with_the_torch_pass(reg)


@pytest.mark.parametrize("fault", ["float-rank", "ranks-none", "refusal-raises"])
def test_a_malformed_pass_registered_in_process_is_refused_and_rope_still_works(
    fault: str,
) -> None:
    bad, error = MALFORMED_PASSES[fault]
    with pytest.raises(ab.SpecError, match=re.escape(error)):
        abp.register_rope_pass(bad)  # type: ignore[arg-type]
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    _runs_with_the_torch_pass(reg)


def test_a_pass_whose_refusal_raises_later_is_a_refusal_of_that_spec() -> None:
    def picky(spec: ab.AttentionSpec, platform: ab.Platform) -> str | None:
        if spec.head_dim == 32:  # the registration probe asks about head dim 64
            raise RuntimeError("vendor cannot do d32")
        return None

    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    record = reg.register_plugin(
        _RopePlugin(dataclasses.replace(_GOOD, refusal=picky)), name="vendor"
    )
    assert (record.status, record.rope_passes) == ("loaded", ("vendor-rope",))
    ab.deploy.reset_registry(reg)  # the fixture's reset withdraws the pass
    sel = ab.select(SPEC, device="cpu", backend="torch-sdpa", registry=reg)
    details = dict(sel.details)
    assert details["preprocess"] == "torch"
    assert (
        "vendor-rope: refusal() raised RuntimeError: vendor cannot do d32"
        in (details["preprocess_fallback"])
    )
    _sdpa_still_works(reg)


def test_a_manifest_pass_is_installed_with_its_plugin_and_leaves_with_its_registry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    declines = dataclasses.replace(_GOOD, apply=lambda packed, spec, params: False)
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    record = reg.register_plugin(_RopePlugin(declines), name="vendor")
    assert (record.status, record.rope_passes) == ("loaded", ("vendor-rope",))
    assert record.to_dict()["rope_passes"] == ["vendor-rope"]
    ab.deploy.reset_registry(reg)
    sel = ab.select(SPEC, device="cpu", backend="torch-sdpa")
    assert dict(sel.details)["preprocess"] == "vendor-rope"
    _sdpa_still_works(reg)  # the pass declines every buffer: torch rotates, numbers stay right
    assert cli.main(["list", "--platform", "cpu"]) == 0
    assert "vendor: vendor-rope" in capsys.readouterr().out
    # a second plugin cannot take the name with another object
    impostor = dataclasses.replace(declines, note="impostor")
    taken = reg.register_plugin(_RopePlugin(impostor, backend="other-sdpa"), name="other")
    assert taken.status == "failed" and "already registered (by vendor)" in (taken.error or "")
    assert reg.get("other-sdpa") is None
    ab.deploy.reset_registry()
    assert "vendor-rope" not in _rope_pass_names()
    sel = ab.select(SPEC, device="cpu", backend="torch-sdpa", registry=reg)
    assert dict(sel.details)["preprocess"] == "torch", "a withdrawn pass is not chosen any more"


def test_no_pass_can_take_an_in_kernel_mode_name() -> None:
    assert _rope_passes.IN_KERNEL_NAMES == _preprocess.IN_KERNEL


def test_the_flashinfer_plugin_brings_its_pass_in_its_manifest() -> None:
    reg = _default_registry()
    assert _record(reg, "flashinfer").rope_passes == ("flashinfer",)
    assert "flashinfer" in _rope_pass_names()
    assert next(p for p in abp.rope_passes() if p.name == "flashinfer").rank("cuda") is not None


def test_an_interrupted_load_takes_its_rope_passes_back(site: PluginSite) -> None:
    site.add_module(
        "a_vendor",
        f"{_ZZ_ROPE}\n@abp.hookimpl\ndef attn_backends_register(host_api_version):\n"
        "    return abp.PluginManifest('2.0', backends=[], rope_passes=[ZZ])\n",
    )
    site.add_module("b_vendor", "raise KeyboardInterrupt\n")
    site.add_dist("a-vendor", {"a": "a_vendor"})
    site.add_dist("b-vendor", {"b": "b_vendor"})
    reg = ab.deploy.Registry()
    with pytest.raises(KeyboardInterrupt):
        reg.load_entry_points()
    assert reg.records() == [] and "zz-vendor-rope" not in _rope_pass_names()


# ---- the guide's examples run -------------------------------------------------------------------


def _guide_block(marker: str) -> str:
    """The one ```python block of the plugin guide that contains ``marker``."""
    blocks = [part.split("```", 1)[0] for part in GUIDE.read_text().split("```python\n")[1:]]
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"expected one python block with {marker!r}, found {len(found)}"
    return found[0]


def test_the_guides_placement_example_puts_the_backend_before_flashinfer_on_cuda_only() -> None:
    names: dict[str, object] = {"Placement": abp.Placement}
    exec(_guide_block("Placement("), names)
    placements = names["placements"]
    assert isinstance(placements, list) and len(placements) == 1
    placement = placements[0]
    assert isinstance(placement, abp.Placement)
    assert (placement.backend, placement.before, placement.platform) == (
        "my-vendor-fmha",
        "flashinfer",
        "cuda",
    )
    mine = _backend("my-vendor-fmha", torch_sdpa.TorchSdpaBackend.capabilities)
    reg = _loaded(ab.deploy.Registry(), ab.deploy.PluginPolicy())
    record = reg.register_plugin(StaticPlugin(mine, placements=placements), name="guide")
    assert (record.status, record.error) == ("loaded", None)
    spec = ab.AttentionSpec(8, 8, 64, torch.float16, causal=True)
    sel = ab.select(spec, platform="cuda:sm90", registry=reg)
    assert sel.name == "my-vendor-fmha"
    assert f"decided by: plugin placement: {placement.describe()}" in sel.explain()
    cpu = ab.select(spec, platform="cpu", registry=reg)
    assert cpu.name == "torch-sdpa", "never makes your backend the CPU default"
    assert _candidate(cpu, "my-vendor-fmha").verdict == "not ranked"


def test_the_guides_rope_pass_example_registers_with_its_plugin() -> None:
    module = types.ModuleType("guide_rope_plugin")
    module.__dict__.update(
        {name: getattr(ab, name) for name in ("AttentionSpec", "FMHAParams", "Platform")}
    )
    module.__dict__.update(
        RopePass=abp.RopePass,
        PluginManifest=abp.PluginManifest,
        hookimpl=abp.hookimpl,
        torch=torch,
        MyFmhaBackend=type("MyFmhaBackend", (torch_sdpa.TorchSdpaBackend,), {"name": "my-fmha"}),
    )
    exec(_guide_block("rope_passes=["), module.__dict__)
    reg = ab.deploy.Registry()
    record = reg.register_plugin(module, name="guide")
    assert (record.status, record.rope_passes, record.error) == (
        "loaded",
        ("my-vendor-rope",),
        None,
    )
    ab.deploy.reset_registry(reg)  # the fixture's reset withdraws the pass
    interleaved = ab.RopeSpec(1e4, interleaved=True)
    refusal = next(p for p in abp.rope_passes() if p.name == "my-vendor-rope").refusal
    assert refusal(dataclasses.replace(SPEC, rope=interleaved), ab.parse_platform("cuda:sm90")) == (
        "rotates rotate-half pairs only"
    )
