"""The contract's host-time benchmark checks the backend's output first and splits each call's
host time into the kernel, the cut a hand-written engine pays too, and the contract."""

from __future__ import annotations

import json

import pytest

from tests.script_support import load_script


def _load():
    return load_script("benchmarks/contract_host.py")


def test_reports_the_parts_of_a_call_after_checking_the_output(capsys):
    bench = _load()
    args = ["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    assert bench.main([*args, "--lengths", "5,3", "--calls", "20", "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "torch-sdpa" and report["heads"] == [4, 2, 16]
    assert report["relative_error"] < 1e-4
    parts = report["host_us"]
    assert set(parts) == {"forward_packed", "forward_separate", "attend", "cut_and_rows"}
    assert all(v > 0 for v in parts.values()), parts
    base = parts["attend"] + parts["cut_and_rows"]
    assert report["contract_us_packed"] == pytest.approx(parts["forward_packed"] - base, abs=0.02)


def test_a_wrong_kernel_is_reported_and_not_timed(capsys, monkeypatch):
    bench = _load()
    from attn_backends_builtin import torch_sdpa

    real = torch_sdpa.TorchSdpaBackend.attend
    monkeypatch.setattr(
        torch_sdpa.TorchSdpaBackend, "attend", lambda self, views, plan: real(self, views, plan) * 2
    )
    args = ["--device", "cpu", "--heads", "2", "--head-dim", "16", "--lengths", "4"]
    assert bench.main(args) == 1
    captured = capsys.readouterr()
    assert "relative error" in captured.err and captured.out == ""


@pytest.mark.parametrize("lengths", ["0", "a,b", ""])
def test_bad_lengths_are_refused_by_argparse(lengths):
    bench = _load()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--lengths", lengths])
    assert exc.value.code == 2
