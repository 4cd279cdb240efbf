"""Warm-up at start-up: every per-batch path of each spec's backend runs once (so every kernel
module is built or loaded), in parallel, idempotent; the CLI command; and the one line that
announces a JIT module's first use instead of a silent stall."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin.flashinfer import FlashinferRopeBackend

import attn_backends as ab
import attn_backends.deploy
import attn_backends.errors
import attn_backends.plugin as abp
from attn_backends._select import _warmup
from attn_backends.cli import main
from tests.fakes.fake_flashinfer import FakeFlashinfer, install

SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
PLAN = "BatchPrefillWithRaggedKVCacheWrapper.plan"
RUN = "BatchPrefillWithRaggedKVCacheWrapper.run"


@pytest.fixture
def fake(monkeypatch) -> FakeFlashinfer:
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    monkeypatch.setattr(flashinfer_plugin, "_announced", set())
    return install(monkeypatch)


def test_every_per_batch_path_runs_once(fake):
    lines: list[str] = []
    report = ab.deploy.warmup(
        ["bge-m3", "short"], device="cpu", progress=lines.append, platform=SM90
    )
    limit = FlashinferRopeBackend.capabilities.fused_rope_max_seqlen
    assert limit is not None
    by_batch = {(s.spec, s.lengths): s for s in report.steps}
    assert set(by_batch) == {("bge-m3", (8, 3)), ("short", (8, 3)), ("short", (limit + 1, 2))}
    assert by_batch[("bge-m3", (8, 3))].backend == "flashinfer"
    assert by_batch[("short", (8, 3))].preprocess == "fused"
    assert by_batch[("short", (limit + 1, 2))].preprocess == "torch"  # the separate pass here
    modes = sorted(call.args["pos_encoding_mode"] for call in fake.named(PLAN))
    assert modes == ["NONE", "NONE", "ROPE_LLAMA"], "both kernels of flashinfer-rope were built"
    assert len(fake.named(RUN)) == 3
    step_lines = [line for line in lines if line.startswith("[") and "/3] " in line[:6]]
    assert len(step_lines) == 3 and step_lines[0].startswith("[1/3] ")
    assert [m.name for m in report.modules] == [
        "flashinfer fa3 bfloat16 d64 posenc=NONE",
        "flashinfer fa2 bfloat16 d128 posenc=ROPE_LLAMA",
        "flashinfer fa3 bfloat16 d128 posenc=NONE",
    ]
    assert lines[0] == "kernel modules: 3 (0 built, 0 to build, 3 unknown)", (
        "the fake has no JIT cache to ask: unknown, not claimed built"
    )
    again = ab.deploy.warmup("short", device="cpu", platform=SM90)
    assert [s.lengths for s in again.steps] == [(8, 3), (limit + 1, 2)]


@pytest.mark.parametrize("bad", [[], ["no-such-model"], [42]])
def test_bad_requests_are_named(bad):
    with pytest.raises(ab.errors.ParamsError):
        ab.deploy.warmup(bad, device="cpu")


def test_an_unservable_spec_raises_the_selection_error():
    fp8_rope = ab.AttentionSpec(4, 4, 64, torch.float8_e4m3fn, causal=True, rope=ab.RopeSpec(1e4))
    with pytest.raises(ab.NoBackendError):
        ab.deploy.warmup(fp8_rope, device="cpu")


def _module(
    name: str, cached: bool | None, cpu: float | None = 100.0, longest: float = 10.0
) -> abp.KernelModule:
    return abp.KernelModule(name, cached, cpu, longest, "/cache/jit")


def test_the_plan_says_where_the_cache_is_and_what_is_left_to_build():
    modules = [_module("a", True), _module("b", False, 600.0), _module("c", False, 200.0)]
    lines = _warmup.plan_lines(modules, 8, _warmup.estimate_build_seconds(modules, 8))
    assert lines[0] == "kernel cache: /cache/jit"
    assert lines[1] == "kernel modules: 3 (1 built, 2 to build); about 100 s with 8 compile jobs"
    assert lines[2:] == ["  built     a", "  to build  b", "  to build  c"]
    assert _warmup.estimate_build_seconds(modules, 8) == pytest.approx(100.0)
    assert _warmup.estimate_build_seconds([_module("a", True)], 8) == 0.0
    assert _warmup.estimate_build_seconds([_module("x", None, None)], 8) is None
    slow_object = [_module("fa3", False, 720.0, longest=95.0)]
    assert _warmup.estimate_build_seconds(slow_object, 16) == 95.0, "the slowest object bounds it"
    assert _warmup.plan_lines([], 8, 0.0) == [
        "no compiled kernel modules to build (the selected backends need none)"
    ]


def test_build_jobs_follow_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert _warmup.build_jobs() == 3
    monkeypatch.setenv("MAX_JOBS", "many")
    assert _warmup.build_jobs() >= 1


def test_a_long_step_reports_progress_while_it_runs(monkeypatch):
    real = _warmup._run

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(_warmup, "_run", slow)
    lines: list[str] = []
    ab.deploy.warmup("bge-m3", device="cpu", progress=lines.append, tick_seconds=0.05)
    bars = [line for line in lines if line.startswith("[") and "steps done" in line]
    assert bars, f"no progress line while the step ran: {lines}"
    assert bars[0].endswith("0/1 steps done")
    assert lines[-1].startswith("[1/1] bge-m3: torch-sdpa")


def test_the_progress_bar_fills_with_time_against_the_estimate():
    assert _warmup.progress_bar(30.0, 60.0, 1, 4) == (
        "[##########..........] 30 s of about 60 s, 1/4 steps done"
    )
    assert _warmup.progress_bar(600.0, 60.0, 3, 4).startswith("[####################] 10.0 min")
    assert _warmup.progress_bar(5.0, None, 2, 4) == "[##########..........] 5 s, 2/4 steps done"


def test_the_command_prints_a_line_per_step(capsys):
    assert main(["warmup", "--preset", "bge-m3", "--preset", "short", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warming up bge-m3, short on cpu")
    assert out[1] == "no compiled kernel modules to build (the selected backends need none)"
    steps = sorted(line.split("] ", 1)[1].split(",")[0] for line in out[2:4])
    assert steps == ["bge-m3: torch-sdpa", "short: torch-sdpa"], out  # in the order they finish
    assert out[2].startswith("[1/2] ") and out[-1].startswith("done in ")


def test_a_jit_module_announces_its_first_use_once(fake, caplog):
    spec = ab.AttentionSpec(8, 2, 64, torch.bfloat16, causal=True)
    backend = ab.select(spec, backend="flashinfer", platform=SM90).backend
    params = ab.FMHAParams.from_lengths((5, 9), device="cpu")
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        backend.prepare(params)
        backend.prepare(params)
    lines = [r.getMessage() for r in caplog.records if "first use of JIT module" in r.getMessage()]
    assert len(lines) == 1
    assert "fa3 bfloat16 d64 posenc=NONE" in lines[0] and "attn-backends warmup" in lines[0]


def test_a_failing_step_is_raised_after_the_others_finish(monkeypatch):
    real = _warmup._run

    def flaky(name, *args, **kwargs):
        if name == "short":
            raise ab.errors.BackendFailure("short: kernel build failed")
        time.sleep(0.05)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_warmup, "_run", flaky)
    lines: list[str] = []
    with pytest.raises(ab.errors.BackendFailure, match="short: kernel build failed"):
        ab.deploy.warmup(["bge-m3", "short"], device="cpu", progress=lines.append)
    assert any(line.startswith("[1/2] bge-m3: torch-sdpa") for line in lines), lines


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_workers", "4"), ("max_workers", 0), ("max_workers", True), ("tick_seconds", 0)],
)
def test_bad_options_are_named_errors(option, value):
    with pytest.raises(ab.errors.InvalidArgumentError, match=rf"warmup\({option}=\.\.\.\)"):
        ab.deploy.warmup("bge-m3", device="cpu", **{option: value})


def test_a_whole_request_is_warmed_up_as_asked():
    fp32 = ab.AttentionSpec(4, 4, 64, torch.float32, causal=True)
    report = ab.deploy.warmup(ab.SelectRequest(fp32, backend="flex"), device="cpu")
    assert {step.backend for step in report.steps} == {"flex"}
    assert report.device == "cpu"
    with pytest.raises(ab.NoBackendError, match="cuda_graph"):
        ab.deploy.warmup(ab.SelectRequest(fp32, cuda_graph=True), device="cpu")
