"""The ``attn-backends`` command: list, explain (text, JSON, dry run), check, help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attn_backends.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_cpu_default(capsys):
    code, out, _ = run(capsys, "explain", "--preset", "qwen3-embedding-0.6b", "--device", "cpu")
    assert code == 0
    assert "selected: torch-sdpa (by priority)" in out
    assert "heads 16/8 x 128, bfloat16, causal, rope theta=1e+06 rotate-half" in out


def test_explain_json_dry_run(capsys):
    code, out, _ = run(
        capsys,
        "explain",
        "--heads",
        "12",
        "--head-dim",
        "64",
        "--bidirectional",
        "--dtype",
        "fp16",
        "--platform",
        "cpu",
        "--json",
    )
    assert code == 0
    record = json.loads(out)
    assert record["selected"] == "torch-sdpa"
    assert record["platform"]["assumed"] is True
    assert record["spec"]["causal"] is False and record["spec"]["dtype"] == "float16"


def test_explain_flags_override_preset(capsys):
    code, out, _ = run(
        capsys,
        "explain",
        "--preset",
        "qwen3-embedding-0.6b",
        "--interleaved",
        "--rotary-dim",
        "64",
        "--logn-base",
        "8192",
        "--json",
        "--device",
        "cpu",
    )
    spec = json.loads(out)["spec"]
    assert code == 0
    assert spec["rope"] == {"theta": 1e6, "rotary_dim": 64, "interleaved": True}
    assert spec["use_logn_attn"] is True and spec["logn_base"] == 8192


def test_explain_kv_cache_fails_with_reason(capsys):
    code, _, err = run(capsys, "explain", "--preset", "bert-base", "--kv-cache", "--device", "cpu")
    assert code == 1
    assert "NoBackendError" in err and "no-KV-cache prefill only" in err


def test_explain_flag_off_with_rope_fails(capsys):
    code, _, err = run(
        capsys, "explain", "--preset", "short", "--need-rope-kv-cache", "false", "--device", "cpu"
    )
    assert code == 1
    assert "KVCacheFlagError" in err


def test_explain_needs_a_spec(capsys):
    with pytest.raises(SystemExit, match="--preset, or at least --heads"):
        main(["explain"])


def test_list_shows_backends_and_capabilities(capsys):
    code, out, _ = run(capsys, "list", "--json", "--device", "cpu")
    assert code == 0
    data = json.loads(out)
    sdpa = next(b for b in data["backends"] if b["name"] == "torch-sdpa")
    assert sdpa["available"] is True
    assert "bfloat16" in sdpa["capabilities"]["dtypes"]
    code, out, _ = run(capsys, "list", "--device", "cpu")
    assert "torch-sdpa  [available]" in out


def test_check_passes_on_reference(capsys):
    code, out, _ = run(capsys, "check", "--preset", "short", "--logn-base", "16", "--device", "cpu")
    assert code == 0
    assert out.startswith("OK: torch-sdpa: canary passed on cpu")
    code, out, _ = run(capsys, "check", "--preset", "bert-base", "--device", "cpu", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["status"] == "passed"
    assert data["relative_error"] < data["tolerance"]


def test_check_refuses_dry_run(capsys):
    with pytest.raises(SystemExit, match="--platform is for explain"):
        main(["check", "--preset", "short", "--platform", "cuda:sm90"])


@pytest.mark.parametrize("command", [[], ["list"], ["explain"], ["check"], ["bench"]])
def test_help(command):
    result = subprocess.run(
        [sys.executable, "-m", "attn_backends.cli", *command, "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert "usage: attn-backends" in result.stdout
