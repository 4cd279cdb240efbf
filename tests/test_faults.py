"""One test per plugin fault: each is isolated, recorded, shown by ``list`` and ``explain``, and
the other backends keep working.

Loading faults go through real entry-point metadata (a tmp ``dist-info``); faults of a loaded
backend use in-process plugins registered with `Registry.register_plugin`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
import attn_backends.deploy
import attn_backends.errors
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends import cli
from tests.plugin_site import PluginSite, open_site
from tests.static_plugin import StaticPlugin

SPEC = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(1e4))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("ATTN_BACKEND", "ATTN_BACKENDS_PLUGINS", "ATTN_BACKENDS_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("ATTN_BACKENDS_STRICT", raising=False)
    yield
    ab.deploy.reset_registry()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    yield from open_site(tmp_path, monkeypatch)


def _loaded_with(site: PluginSite, name: str, module: str, source: str) -> ab.deploy.Registry:
    """Install one faulty plugin as a distribution and load the whole entry-point group."""
    site.add_module(module, source)
    site.add_dist(f"vendor-{name}", {name: module})
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    return reg


def _record(reg: ab.deploy.Registry, name: str) -> ab.deploy.PluginRecord:
    return next(r for r in reg.records() if r.name == name)


def _others_still_work(reg: ab.deploy.Registry) -> ab.Selection:
    """torch-sdpa is still loaded and selected, and computes the right numbers."""
    assert _record(reg, "torch-sdpa").status == "loaded"
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    params = ab.FMHAParams.from_lengths([3, 9], device="cpu")
    qkv = torch.randn(12, SPEC.qkv_width, generator=torch.Generator().manual_seed(0))
    ref = ab.reference_attention(qkv, SPEC, params)
    out = sel.backend.forward(qkv.clone(), sel.backend.prepare(params))
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[torch.float32]
    return sel


def _shown_by_list(
    reg: ab.deploy.Registry, capsys: pytest.CaptureFixture[str], *texts: str
) -> None:
    ab.deploy.reset_registry(reg)
    assert cli.main(["list", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    for text in texts:
        assert text in out


def _check_recorded(
    reg: ab.deploy.Registry, capsys: pytest.CaptureFixture[str], name: str, status: str, error: str
) -> None:
    rec = _record(reg, name)
    assert rec.status == status
    assert rec.error is not None
    assert error in rec.error
    assert rec.backends == ()
    assert reg.get(name) is None
    sel = _others_still_work(reg)
    assert f"  {name}: {status}: " in sel.explain()
    assert error in sel.explain()
    _shown_by_list(reg, capsys, name, error)


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("raise ImportError('needs libvendor.so.3')\n", "ImportError: needs libvendor.so.3"),
        ("def broken(:\n", "SyntaxError"),
        ("import sys\nsys.exit('vendor gave up')\n", "SystemExit: vendor gave up"),
    ],
    ids=["import-error", "syntax-error", "sys-exit"],
)
def test_plugin_that_fails_to_import(
    site: PluginSite, capsys: pytest.CaptureFixture[str], source: str, error: str
) -> None:
    reg = _loaded_with(site, "noimport", "noimport_plugin", source)
    _check_recorded(reg, capsys, "noimport", "failed", error)
    assert "import failed" in (_record(reg, "noimport").error or "")


def test_plugin_that_raises_in_its_hook(
    site: PluginSite, capsys: pytest.CaptureFixture[str]
) -> None:
    source = """
        from attn_backends.plugin import hookimpl

        @hookimpl
        def attn_backends_register(host_api_version):
            raise RuntimeError("license server unreachable")
    """
    reg = _loaded_with(site, "hookraise", "hookraise_plugin", source)
    _check_recorded(
        reg, capsys, "hookraise", "failed", "hook raised RuntimeError: license server unreachable"
    )


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        ("[TorchSdpaBackend]", "hook returned list, not a PluginManifest"),
        ("None", "hook returned NoneType, not a PluginManifest"),
        (
            "PluginManifest('2.0', [object()])",
            "offered an instance of object; plugin API 2.0 registers backend classes",
        ),
        (
            "PluginManifest('2.0', [int])",
            "int is not a backend class: it has no name",
        ),
        ("PluginManifest(1, [])", "api_version must be a str"),
    ],
    ids=["list", "none", "not-a-backend", "not-a-backend-class", "version-not-str"],
)
def test_plugin_hook_returns_the_wrong_type(
    site: PluginSite, capsys: pytest.CaptureFixture[str], returned: str, error: str
) -> None:
    source = f"""
        from attn_backends.plugin import PluginManifest, hookimpl
        from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

        @hookimpl
        def attn_backends_register(host_api_version):
            return {returned}
    """
    reg = _loaded_with(site, "wrongtype", "wrongtype_plugin", source)
    _check_recorded(reg, capsys, "wrongtype", "failed", error)


def test_plugin_that_takes_a_taken_name(
    site: PluginSite, capsys: pytest.CaptureFixture[str]
) -> None:
    source = """
        from attn_backends.plugin import PluginManifest, hookimpl
        from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

        class Impostor(TorchSdpaBackend):
            pass

        @hookimpl
        def attn_backends_register(host_api_version):
            return PluginManifest("2.0", [Impostor])
    """
    reg = _loaded_with(site, "impostor", "impostor_plugin", source)
    _check_recorded(
        reg, capsys, "impostor", "failed", "backend name 'torch-sdpa' is taken by plugin torch-sdpa"
    )
    entry = reg.get("torch-sdpa")
    assert entry is not None
    assert entry.plugin == "torch-sdpa"
    assert entry.backend is torch_sdpa.TorchSdpaBackend


def test_a_plugin_name_registered_twice_keeps_the_first() -> None:
    reg = ab.deploy.Registry()
    first = reg.register_plugin(torch_sdpa, name="torch-sdpa")
    again = reg.register_plugin(torch_sdpa, name="torch-sdpa-again")
    assert first.status == "loaded"
    assert again.status == "failed"
    assert again.error is not None
    assert "already registered" in again.error
    assert _others_still_work(reg).name == "torch-sdpa"


# ---- faults of a backend that registered fine -------------------------------------------------


_EAGER = abp.Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
"""What each faulty backend below declares; `_with` ranks it before torch-sdpa on the CPU."""


class _RaisesInPrepare(torch_sdpa.TorchSdpaBackend):
    name = "raises-in-prepare"
    capabilities = _EAGER

    def plan_kernel(
        self, spec: ab.AttentionSpec, params: ab.FMHAParams, *, fused_rope: bool
    ) -> NoReturn:
        raise RuntimeError("workspace allocation failed")


class _RaisesInForward(torch_sdpa.TorchSdpaBackend):
    name = "raises-in-forward"
    capabilities = _EAGER

    def attend(self, views: abp.QKVViews, plan: ab.PrefillPlan) -> torch.Tensor:
        raise ValueError("no kernel image for this device")


class _WrongNumbers(torch_sdpa.TorchSdpaBackend):
    """Right shape, right dtype, wrong values: only a numeric check can notice."""

    name = "wrong-numbers"
    capabilities = _EAGER

    def attend(self, views: abp.QKVViews, plan: ab.PrefillPlan) -> torch.Tensor:
        return views.v.repeat_interleave(plan.spec.group_size, dim=1).to(plan.spec.output_dtype)


def _with(backend: type[abp.PrefillBackend]) -> ab.deploy.Registry:
    """torch-sdpa and ``backend``, which ranks right before it on the CPU (so it is tried first)."""
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(backend, first_on="cpu"), name=f"vendor-{backend.name}")
    return reg


def _strict_passes_over(reg: ab.deploy.Registry, name: str, error: str) -> None:
    """Strict mode records the failed canary, takes torch-sdpa, and refuses an explicit choice."""
    sel = ab.select(SPEC, device="cpu", strict=True, registry=reg)
    assert sel.name == "torch-sdpa"
    assert sel.canary.status == "passed"
    cand = next(c for c in sel.candidates if c.name == name)
    assert cand.verdict == "rejected"
    assert [r.code for r in cand.reasons] == [ab.ReasonCode.CANARY_FAILED]
    assert error in cand.reasons[0].message
    text = sel.explain()
    assert f"rejected  {name}" in text
    assert "[canary_failed]" in text
    assert error in text
    with pytest.raises(ab.NoBackendError, match="canary_failed") as info:
        ab.select(SPEC, device="cpu", strict=True, backend=name, registry=reg)
    assert error in str(info.value)
    assert ab.select(SPEC, device="cpu", registry=reg).name == name  # not strict: no canary


@pytest.mark.parametrize(
    ("backend", "step", "cause"),
    [
        (_RaisesInPrepare, "plan_kernel", RuntimeError),
        (_RaisesInForward, "attend", ValueError),
    ],
    ids=["prepare", "forward"],
)
def test_backend_that_claims_support_then_raises(
    backend: type[abp.PrefillBackend], step: str, cause: type[Exception]
) -> None:
    reg = _with(backend)
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == backend.name
    params = ab.FMHAParams.from_lengths([4, 4], device="cpu")
    qkv = torch.randn(8, SPEC.qkv_width, generator=torch.Generator().manual_seed(1))
    with pytest.raises(
        ab.errors.BackendFailure, match=f"backend {backend.name} failed in {step}"
    ) as info:
        sel.backend.forward(qkv, sel.backend.prepare(params))
    assert isinstance(info.value.__cause__, cause)
    _strict_passes_over(
        reg, backend.name, f"BackendFailure: backend {backend.name} failed in {step}"
    )


def test_backend_that_returns_wrong_numbers() -> None:
    reg = _with(_WrongNumbers)
    _strict_passes_over(reg, "wrong-numbers", "differs from the float64 reference: relative error")
    sel = ab.select(SPEC, device="cpu", strict=True, registry=reg)
    reason = next(c for c in sel.candidates if c.name == "wrong-numbers").reasons[0]
    assert reason.got is not None
    assert float(reason.got) > ab.reference.TOLERANCE[torch.float32]


class _SupportsRaises(torch_sdpa.TorchSdpaBackend):
    name = "supports-raises"
    capabilities = _EAGER

    @classmethod
    def extra_reasons(cls, spec: ab.AttentionSpec, platform: ab.Platform) -> list[ab.Reason]:
        raise KeyError("device table")


class _BindRaises(torch_sdpa.TorchSdpaBackend):
    name = "bind-raises"
    capabilities = _EAGER

    def kernel_variant(self, spec: ab.AttentionSpec, platform: ab.Platform) -> object:
        raise RuntimeError("cannot query the kernel variant")


class _DescribeRaises(torch_sdpa.TorchSdpaBackend):
    name = "describe-raises"
    capabilities = _EAGER

    def describe(self, platform: ab.Platform) -> dict[str, str]:
        raise RuntimeError("cannot query the kernel variant")


@pytest.mark.parametrize(
    ("backend", "error"),
    [
        (_SupportsRaises, "supports() raised KeyError: 'device table'"),
        (_BindRaises, "binding raised RuntimeError: cannot query the kernel variant"),
        (_DescribeRaises, "describe() raised RuntimeError: cannot query the kernel variant"),
    ],
    ids=["supports", "bind", "describe"],
)
def test_backend_that_raises_while_being_judged(
    backend: type[abp.PrefillBackend], error: str
) -> None:
    reg = _with(backend)
    sel = ab.select(SPEC, device="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    cand = next(c for c in sel.candidates if c.name == backend.name)
    assert cand.verdict == "rejected"
    assert [r.code for r in cand.reasons] == [ab.ReasonCode.BACKEND_SPECIFIC]
    assert error in sel.explain()
