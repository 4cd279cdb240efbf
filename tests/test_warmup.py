"""Warm-up at start-up: every per-batch path of each spec's backend runs once (so every kernel
module is built or loaded), in parallel, idempotent; the CLI command; and the one line that
announces a JIT module's first use instead of a silent stall."""

from __future__ import annotations

import logging

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin.flashinfer import FlashinferRopeBackend

import attn_backends as ab
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
    report = ab.warmup(["bge-m3", "short"], device="cpu", progress=lines.append, platform=SM90)
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
    assert len(lines) == 3 and lines[0].startswith("[1/3] ")
    again = ab.warmup("short", device="cpu", platform=SM90)
    assert [s.lengths for s in again.steps] == [(8, 3), (limit + 1, 2)]


@pytest.mark.parametrize("bad", [[], ["no-such-model"], [42]])
def test_bad_requests_are_named(bad):
    with pytest.raises(ab.ParamsError):
        ab.warmup(bad, device="cpu")


def test_an_unservable_spec_raises_the_selection_error():
    fp8_rope = ab.AttentionSpec(4, 4, 64, torch.float8_e4m3fn, causal=True, rope=ab.RopeSpec(1e4))
    with pytest.raises(ab.NoBackendError):
        ab.warmup(fp8_rope, device="cpu")


def test_the_command_prints_a_line_per_step(capsys):
    assert main(["warmup", "--preset", "bge-m3", "--preset", "short", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warming up bge-m3, short on cpu")
    assert out[1].startswith("[1/2] bge-m3: torch-sdpa") and out[-1].startswith("done in ")


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
