"""Third-party plugins for real: discovery through installed metadata, the versioned API, the
environment's allow/block lists, registering versus being chosen, and strict start-up mode."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
import attn_backends.deploy
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends import testing
from tests.plugin_site import PluginSite, open_site
from tests.static_plugin import StaticPlugin

EXAMPLE = Path(__file__).resolve().parents[1] / "plugins" / "example-backend"
EXAMPLE_DIST = ("attn-backends-example", "0.1.0")
EXAMPLE_ENTRY_POINTS = {"example-matmul": "attn_backends_example.plugin"}
SPEC = ab.AttentionSpec(8, 2, 64, torch.float16, causal=True, rope=ab.RopeSpec(1e4))
ENV_VARS = (
    "ATTN_BACKEND",
    "ATTN_BACKENDS_PLUGINS",
    "ATTN_BACKENDS_DISABLE",
    "ATTN_BACKENDS_STRICT",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    yield from open_site(tmp_path, monkeypatch)


@pytest.fixture
def example_site(site: PluginSite, monkeypatch: pytest.MonkeyPatch) -> PluginSite:
    """The example distribution 'installed': its package importable, its metadata on the path."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    name, version = EXAMPLE_DIST
    site.add_dist(name, EXAMPLE_ENTRY_POINTS, version)
    return site


def test_the_site_metadata_matches_the_example_pyproject() -> None:
    text = (EXAMPLE / "pyproject.toml").read_text()
    name, version = EXAMPLE_DIST
    assert f'name = "{name}"\nversion = "{version}"\n' in text
    lines = "".join(f'{k} = "{v}"\n' for k, v in EXAMPLE_ENTRY_POINTS.items())
    assert f"[project.entry-points.attn_backends]\n{lines}" in text


def _sdpa_registry() -> ab.deploy.Registry:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    return reg


def _record(reg: ab.deploy.Registry, name: str) -> ab.deploy.PluginRecord:
    return next(r for r in reg.records() if r.name == name)


def _candidate(sel: ab.Selection, name: str) -> ab.Candidate:
    return next(c for c in sel.candidates if c.name == name)


def test_example_distribution_is_discovered_through_its_metadata(example_site: PluginSite) -> None:
    reg = ab.deploy.Registry()
    records = reg.load_entry_points()
    rec = _record(reg, "example-matmul")
    assert rec in records
    assert rec.status == "loaded"
    assert rec.backends == ("example-matmul",)
    assert "attn_backends_example.plugin (attn-backends-example 0.1.0)" in rec.source
    entry = reg.get("example-matmul")
    assert entry is not None
    assert entry.plugin == "example-matmul"
    assert _record(reg, "torch-sdpa").status == "loaded"


def test_without_the_metadata_the_example_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))  # importable, but not installed: no entry point
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    assert reg.get("example-matmul") is None
    assert reg.get("torch-sdpa") is not None


def test_installing_a_plugin_never_changes_the_default_choice(example_site: PluginSite) -> None:
    with_example = ab.deploy.Registry()
    with_example.load_entry_points()
    without = ab.deploy.Registry()  # the same installation, minus the example
    without.load_entry_points(policy=ab.deploy.PluginPolicy(disable=frozenset({"example-matmul"})))
    assert without.get("example-matmul") is None
    for platform in ("cpu", "cuda:sm90", "rocm:gfx942"):
        chosen = ab.select(SPEC, platform=platform, registry=with_example)
        baseline = ab.select(SPEC, platform=platform, registry=without)
        assert chosen.name != "example-matmul"
        assert chosen.fingerprint() == baseline.fingerprint()
        cand = _candidate(chosen, "example-matmul")
        assert cand.verdict == "not ranked"
        assert [r.code for r in cand.reasons] == [ab.ReasonCode.NOT_RANKED]
        assert "example-matmul (plugin example-matmul)" in chosen.explain()
        assert "no row of the ranking table nor a plugin placement for" in cand.reasons[0].message
        assert "chosen only when named" in chosen.explain()


def test_explicit_choice_runs_the_example_against_the_reference(example_site: PluginSite) -> None:
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    sel = ab.select(SPEC, backend="example-matmul", device="cpu", registry=reg)
    assert sel.name == "example-matmul"
    assert sel.source == "explicit"
    params = ab.FMHAParams.from_lengths([7, 1, 20], device="cpu", padded_rows=30)
    qkv = torch.randn(30, SPEC.qkv_width, generator=torch.Generator().manual_seed(3)).half()
    ref = ab.reference_attention(qkv, SPEC, params)
    out = sel.backend.forward(qkv, sel.backend.prepare(params))
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[torch.float16]


def test_example_passes_the_conformance_suite(example_site: PluginSite) -> None:
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    entry = reg.get("example-matmul")
    assert entry is not None
    cases = testing.conformance_cases(entry.backend.capabilities)
    assert len(cases) >= 20
    for case in cases:
        err = testing.run_case("example-matmul", case, "cpu", registry=reg)
        assert err < ab.reference.TOLERANCE[case.spec.dtype], case.id


def test_incompatible_major_version_is_refused_naming_both(site: PluginSite) -> None:
    template = """
        from attn_backends.plugin import PluginManifest, hookimpl
        from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

        class Renamed(TorchSdpaBackend):
            name = "{name}"

        @hookimpl
        def attn_backends_register(host_api_version):
            return PluginManifest(api_version="{version}", backends=[Renamed])
    """
    site.add_module("future_api_plugin", template.format(name="future", version="3.0"))
    site.add_module("minor_api_plugin", template.format(name="minor", version="2.9"))
    site.add_dist(
        "vendor-api",
        {"future": "future_api_plugin", "minor": "minor_api_plugin"},
    )
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    future = _record(reg, "future")
    assert future.status == "incompatible"
    assert future.error is not None
    assert "3.0" in future.error
    assert abp.PLUGIN_API_VERSION in future.error
    assert reg.get("future") is None
    assert _record(reg, "minor").status == "loaded"  # same major version: accepted
    sel = ab.select(SPEC, platform="cpu", registry=reg)
    assert "future: incompatible: built for plugin API 3.0" in sel.explain()
    plugins = sel.to_dict()["plugins"]
    assert isinstance(plugins, list)
    assert {"name": "future", "status": "incompatible"} in [
        {"name": p["name"], "status": p["status"]} for p in plugins
    ]


def test_allow_list_loads_only_the_named_plugins(
    example_site: PluginSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    example_site.add_module("tracer_plugin", "import sys\nsys.modules['tracer_imported'] = sys\n")
    example_site.add_dist("vendor-tracer", {"tracer": "tracer_plugin"})
    monkeypatch.setenv("ATTN_BACKENDS_PLUGINS", " torch-sdpa, example-matmul ")
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    assert _record(reg, "torch-sdpa").status == "loaded"
    assert _record(reg, "example-matmul").status == "loaded"
    tracer = _record(reg, "tracer")
    assert tracer.status == "disabled"
    assert tracer.error == (
        "plugin 'tracer' is not in $ATTN_BACKENDS_PLUGINS=example-matmul,torch-sdpa"
    )
    assert "tracer_imported" not in sys.modules, "a plugin outside the allow list was imported"
    sel = ab.select(SPEC, platform="cpu", registry=reg)
    assert sel.to_dict()["policy"] == {
        "ATTN_BACKENDS_PLUGINS": ["example-matmul", "torch-sdpa"],
        "ATTN_BACKENDS_DISABLE": [],
    }
    text = sel.explain()
    assert "plugin policy: $ATTN_BACKENDS_PLUGINS=example-matmul,torch-sdpa" in text
    assert "plugins disabled:\n" in text
    assert "\n  tracer: plugin 'tracer' is not in $ATTN_BACKENDS_PLUGINS" in text
    with pytest.raises(ab.NoBackendError, match=r"plugins not loaded: .*tracer \(disabled"):
        ab.select(SPEC, backend="tracer", platform="cpu", registry=reg)


def test_disable_list_blocks_a_plugin_at_load(
    example_site: PluginSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "example-matmul")
    sys.modules.pop("attn_backends_example.plugin", None)
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    rec = _record(reg, "example-matmul")
    assert rec.status == "disabled"
    assert rec.error == "plugin 'example-matmul' is listed in $ATTN_BACKENDS_DISABLE"
    assert "attn_backends_example.plugin" not in sys.modules
    assert reg.get("example-matmul") is None


class _SecondChoice(torch_sdpa.TorchSdpaBackend):
    name = "second-choice"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float16, torch.float32})
    )


def _second_choice() -> StaticPlugin:
    """`_SecondChoice`, ranked right after torch-sdpa on the CPU: the fallback."""
    after = abp.Placement("second-choice", after="torch-sdpa", platform="cpu", note="test fallback")
    return StaticPlugin(_SecondChoice, placements=[after])


def test_disabled_backend_is_a_rejected_candidate_and_env_keys_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = _sdpa_registry()
    reg.register_plugin(_second_choice(), name="vendor")
    assert ab.select(SPEC, platform="cpu", registry=reg).name == "torch-sdpa"
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "torch-sdpa")
    sel = ab.select(SPEC, platform="cpu", registry=reg)  # same registry, same cache
    assert sel.name == "second-choice"
    assert (
        sel.candidates[0].placed_by
        == "plugin placement: second-choice after torch-sdpa on cpu (test fallback)"
    )
    cand = _candidate(sel, "torch-sdpa")
    assert cand.verdict == "rejected"
    assert [r.code for r in cand.reasons] == [ab.ReasonCode.DISABLED]
    assert "rejected  torch-sdpa" in sel.explain()
    assert "[disabled] backend 'torch-sdpa' is listed in $ATTN_BACKENDS_DISABLE" in sel.explain()
    assert sel.to_dict()["policy"] == {
        "ATTN_BACKENDS_PLUGINS": None,
        "ATTN_BACKENDS_DISABLE": ["torch-sdpa"],
    }
    with pytest.raises(ab.NoBackendError, match=r"\[disabled\]") as info:
        ab.select(SPEC, backend="torch-sdpa", platform="cpu", registry=reg)
    assert info.value.reasons[0][1][0].code == ab.ReasonCode.DISABLED
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "vendor")  # a plugin name disables its backends
    assert ab.select(SPEC, platform="cpu", registry=reg).name == "torch-sdpa"
    monkeypatch.setenv("ATTN_BACKENDS_PLUGINS", "vendor")
    monkeypatch.delenv("ATTN_BACKENDS_DISABLE")
    assert ab.select(SPEC, platform="cpu", registry=reg).name == "second-choice"


def test_policy_parsing() -> None:
    policy = ab.deploy.PluginPolicy.from_env(
        {"ATTN_BACKENDS_PLUGINS": " a ,, b ", "ATTN_BACKENDS_DISABLE": "c,"}
    )
    assert policy.allow == frozenset({"a", "b"})
    assert policy.disable == frozenset({"c"})
    assert ab.deploy.PluginPolicy.from_env({"ATTN_BACKENDS_PLUGINS": "  "}).allow is None
    assert policy.plugin_refusal("a") is None
    assert policy.backend_refusal("c", "a") == "backend 'c' is listed in $ATTN_BACKENDS_DISABLE"
    assert policy.backend_refusal("x", "z") == "plugin 'z' is not in $ATTN_BACKENDS_PLUGINS=a,b"


def test_prefixes_say_whether_a_disabled_name_is_a_plugin_or_a_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = _sdpa_registry()
    reg.register_plugin(_second_choice(), name="vendor")
    cases = {
        "plugin:torch-sdpa": ("second-choice", "plugin 'torch-sdpa' is listed"),
        "backend:torch-sdpa": ("second-choice", "backend 'torch-sdpa' is listed"),
        "plugin:vendor": ("torch-sdpa", None),
        "backend:second-choice": ("torch-sdpa", None),
    }
    for listed, (winner, refusal) in cases.items():
        monkeypatch.setenv("ATTN_BACKENDS_DISABLE", listed)
        sel = ab.select(SPEC, platform="cpu", registry=reg)
        assert sel.name == winner, listed
        assert sel.policy_unmatched == ()
        if refusal is not None:
            assert refusal in _candidate(sel, "torch-sdpa").reasons[0].message
    for wrong_kind in ("backend:vendor", "plugin:second-choice"):
        monkeypatch.setenv("ATTN_BACKENDS_DISABLE", wrong_kind)
        sel = ab.select(SPEC, platform="cpu", registry=reg)
        assert sel.name == "torch-sdpa"
        assert _candidate(sel, "second-choice").verdict == "eligible", wrong_kind
        assert sel.policy_unmatched == (wrong_kind,)


def test_a_backend_prefix_leaves_the_plugin_loaded(example_site: PluginSite) -> None:
    reg = ab.deploy.Registry()
    reg.load_entry_points(policy=ab.deploy.PluginPolicy(disable=frozenset({"backend:torch-sdpa"})))
    assert _record(reg, "torch-sdpa").status == "loaded"
    assert reg.get("torch-sdpa") is not None


def test_a_listed_name_that_matches_nothing_is_warned_about_and_recorded(
    example_site: PluginSite,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = ab.deploy.Registry()
    reg.load_entry_points(policy=ab.deploy.PluginPolicy())
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "torch-spda,example-matmul")
    monkeypatch.setenv("ATTN_BACKENDS_PLUGINS", "torch-sdpa,exmaple-matmul,backend:torch-sdpa")
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        sel = ab.select(SPEC, platform="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    unmatched = ("backend:torch-sdpa", "exmaple-matmul", "torch-spda")
    assert sel.policy_unmatched == unmatched
    assert sel.to_dict()["policy_unmatched"] == list(unmatched)
    assert "(matching no plugin or backend: backend:torch-sdpa, exmaple-matmul, torch-spda)" in (
        sel.explain()
    )
    assert "'torch-spda'" in caplog.text
    assert "match no plugin or registered backend" in caplog.text
    policy = ab.deploy.PluginPolicy.from_env({"ATTN_BACKENDS_DISABLE": "a, plugin:b ,backend:c"})
    assert policy.unmatched(["a", "b"], ["c"]) == ()
    assert policy.unmatched(["c"], ["a", "b"]) == ("backend:c", "plugin:b")


def test_strict_mode_runs_a_canary_that_touches_nothing_shared() -> None:
    reg = _sdpa_registry()
    entry = reg.get("torch-sdpa")
    assert entry is not None
    rng = torch.get_rng_state()
    sel = ab.select(SPEC, device="cpu", strict=True, registry=reg)
    assert torch.equal(torch.get_rng_state(), rng), "the canary used the global generator"
    assert entry.backend is torch_sdpa.TorchSdpaBackend, "the registry holds the class"
    assert type(sel.backend) is torch_sdpa.TorchSdpaBackend and sel.backend.spec == SPEC
    assert sel.strict
    assert sel.canary.status == "passed"
    assert sel.canary.relative_error is not None
    assert sel.canary.relative_error < ab.reference.TOLERANCE[torch.float16]
    assert "strict: on; canary passed on cpu" in sel.explain()
    assert sel.to_dict()["canary"] == sel.canary.to_dict()
    relaxed = ab.select(SPEC, device="cpu", registry=reg)
    assert relaxed.canary.status == "off"
    assert relaxed.fingerprint() == sel.fingerprint()


def test_strict_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _sdpa_registry()
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "1")
    assert ab.select(SPEC, device="cpu", registry=reg).canary.status == "passed"
    assert ab.select(SPEC, device="cpu", registry=reg, strict=False).canary.status == "off"
    monkeypatch.setenv("ATTN_BACKENDS_STRICT", "off")
    assert ab.select(SPEC, device="cpu", registry=reg).canary.status == "off"


def test_strict_mode_skips_the_canary_on_a_dry_run_platform() -> None:
    sel = ab.select(SPEC, platform="cuda:sm90", strict=True, registry=_sdpa_registry())
    assert sel.canary.status == "skipped"
    assert "canary skipped: cuda:sm90 is a dry-run platform" in sel.explain()


def test_strict_canary_for_fp8_specs_uses_the_request_dtype() -> None:
    spec = ab.AttentionSpec(4, 4, 32, torch.float8_e4m3fn, causal=False)
    reg = _sdpa_registry()
    reg.register_plugin(StaticPlugin(_Fp8Sdpa), name="fp8")
    sel = ab.select(spec, backend="fp8-sdpa", device="cpu", strict=True, registry=reg)
    assert sel.canary.status == "passed", sel.canary.detail
    assert "float8_e4m3fn" in sel.canary.detail


class _Fp8Sdpa(torch_sdpa.TorchSdpaBackend):
    """torch-sdpa taught FP8 by dequantising the views: enough to exercise an FP8 canary."""

    name = "fp8-sdpa"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float8_e4m3fn})
    )

    def attend(self, views: abp.QKVViews, plan: ab.PrefillPlan) -> torch.Tensor:
        scales = views.fp8_scales
        assert scales is not None
        q = views.q.to(torch.float32) * scales.q
        k = views.k.to(torch.float32) * scales.k
        v = views.v.to(torch.float32) * scales.v
        return super().attend(abp.QKVViews(views.packed, q, k, v, None), plan)


class _RegressedSdpa(torch_sdpa.TorchSdpaBackend):
    """Declares float16 and float32 but its supports() refuses float32: a regression."""

    name = "regressed-sdpa"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float16, torch.float32})
    )

    @classmethod
    def extra_reasons(cls, spec: ab.AttentionSpec, platform: ab.Platform) -> list[ab.Reason]:
        if spec.dtype == torch.float32:
            return [ab.Reason(ab.ReasonCode.BACKEND_SPECIFIC, "float32 broke")]
        return []


def test_a_refused_generated_case_fails_but_a_missing_platform_skips() -> None:
    reg = _sdpa_registry()
    reg.register_plugin(StaticPlugin(_RegressedSdpa), name="regressed")
    entry = reg.get("regressed-sdpa")
    assert entry is not None
    cases = testing.conformance_cases(entry.capabilities)
    f32 = next(c for c in cases if c.spec.dtype == torch.float32)
    with pytest.raises(pytest.fail.Exception, match="which its capabilities declare"):
        testing.run_case("regressed-sdpa", f32, "cpu", registry=reg)
    f16 = next(c for c in cases if c.spec.dtype == torch.float16)
    assert testing.run_case("regressed-sdpa", f16, "cpu", registry=reg) < 1e-2
    gpu_only = ab.parse_platform("cuda:sm90")
    with pytest.raises(pytest.skip.Exception, match="cannot run here"):
        testing.run_case("regressed-sdpa", f16, "cpu", registry=reg, platform=gpu_only)


def _conformance_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pytest --attn-backend ...`` in a directory of its own, as a plugin author runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def test_a_conformance_run_that_checked_no_numbers_fails_loudly(tmp_path: Path) -> None:
    """flashinfer's suite on a CPU machine runs only refusal cases: that is not a pass."""
    done = _conformance_run(tmp_path, "--attn-backend", "flashinfer")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "flashinfer: 0 numeric case(s) compared with the float64 reference" in done.stdout
    assert "NO NUMBERS CHECKED for flashinfer" in done.stdout
    assert " failed" not in done.stdout.splitlines()[-1], "no test failed: the run itself does"


def test_a_refusals_only_run_can_be_asked_for_and_still_says_so(tmp_path: Path) -> None:
    done = _conformance_run(
        tmp_path,
        "--attn-backend",
        "flashinfer",
        "--attn-backend-allow-no-numbers",
        "-k",
        "refuses_kv_cache",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "NO NUMBERS CHECKED for flashinfer" in done.stdout
    assert "Allowed by --attn-backend-allow-no-numbers" in done.stdout


def test_a_conformance_run_that_checked_numbers_says_how_many(tmp_path: Path) -> None:
    done = _conformance_run(tmp_path, "--attn-backend", "torch-sdpa", "-k", "interleaved")
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(
        r"torch-sdpa: [1-9]\d* numeric case\(s\) compared with the float64", done.stdout
    )
    assert "NO NUMBERS CHECKED" not in done.stdout


def test_a_backend_whose_plugin_failed_to_import_is_named_with_the_error(
    site: PluginSite, tmp_path: Path
) -> None:
    """``pytest --attn-backend NAME`` for a plugin that does not import: one usage error that
    names the import error, before collection; no traceback, no "no numbers" banner."""
    site.add_module("broken_backend_plugin", "import a_kernel_library_that_is_not_installed\n")
    site.add_dist("broken-backend", {"broken": "broken_backend_plugin"})
    work = tmp_path / "work"
    work.mkdir()
    done = _conformance_run(work, "--attn-backend", "broken")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-3000:]
    out = done.stdout + done.stderr
    assert "--attn-backend 'broken' is not registered" in out
    assert "plugins that failed to load: broken (import failed:" in out
    assert "a_kernel_library_that_is_not_installed" in out
    assert "Traceback" not in out and "NO NUMBERS CHECKED" not in out
