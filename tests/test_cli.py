"""The ``attn-backends`` command: list, explain (text, JSON, dry run), check, help, version, and
every user mistake ending in one line on stderr with exit status 2."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch
from attn_backends_builtin import torch_sdpa
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

import attn_backends as ab
from attn_backends.cli import EXIT_PIPE_CLOSED, main
from attn_backends.deploy import Registry, get_registry, reset_registry
from attn_backends.reference import TOLERANCE
from tests.static_plugin import StaticPlugin


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("ATTN_BACKEND", "ATTN_BACKENDS_STRICT", "ATTN_BACKENDS_DISABLE"):
        monkeypatch.delenv(var, raising=False)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(text):
    """Parse as any strict JSON reader would: NaN and Infinity are not JSON."""

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_explain_cpu_default(capsys):
    code, out, _ = run(capsys, "explain", "--preset", "qwen3-embedding-0.6b", "--device", "cpu")
    assert code == 0
    assert "selected: torch-sdpa (by ranking)" in out
    assert "decided by: row " in out and ": torch-sdpa on cpu (" in out
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
    record = strict_json(out)
    assert record["selected"] == "torch-sdpa"
    assert record["platform"]["assumed"] is True
    assert record["spec"]["causal"] is False and record["spec"]["dtype"] == "float16"
    assert record["spec"]["num_kv_heads"] == 12  # no preset: MHA


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
    spec = strict_json(out)["spec"]
    assert code == 0
    assert spec["rope"] == {"theta": 1e6, "rotary_dim": 64, "interleaved": True}
    assert spec["use_logn_attn"] is True and spec["logn_base"] == 8192


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # Each flag replaces one field; every other field keeps the preset's value.
        (
            ["--preset", "bert-base", "--heads", "8", "--kv-heads", "8"],
            {"num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "causal": False, "rope": None},
        ),
        (
            ["--preset", "qwen3-embedding-0.6b", "--heads", "32"],
            {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "causal": True},
        ),
        (["--preset", "short", "--no-rope"], {"rope": None, "num_kv_heads": 8}),
        (
            ["--preset", "short", "--rope-theta", "10000"],
            {"rope": {"theta": 10000.0, "rotary_dim": 128, "interleaved": False}},
        ),
        (["--preset", "bert-base", "--causal", "--dtype", "fp32"], {"causal": True}),
        (["--preset", "bert-base", "--head-dim", "128"], {"head_dim": 128, "num_heads": 12}),
    ],
    ids=["heads-and-kv", "heads-keeps-kv", "no-rope", "theta", "mask-dtype", "head-dim"],
)
def test_a_preset_flag_replaces_that_field_only(capsys, flags, expected):
    code, out, err = run(capsys, "explain", *flags, "--platform", "cpu", "--json")
    assert code == 0, err
    spec = strict_json(out)["spec"]
    assert {key: spec[key] for key in expected} == expected


def test_explain_kv_cache_fails_with_reason(capsys):
    code, _, err = run(capsys, "explain", "--preset", "bert-base", "--kv-cache", "--device", "cpu")
    assert code == 1
    assert "NoBackendError" in err and "no-KV-cache prefill only" in err


def test_explicit_backend_that_does_not_fit_is_a_no_not_a_usage_error(capsys):
    code, out, err = run(
        capsys, "explain", "--preset", "short", "--backend", "trt", "--device", "cpu"
    )
    assert (code, out) == (1, "")
    assert "NoBackendError" in err and "trt" in err and "[platform]" in err


def test_list_shows_backends_and_capabilities(capsys):
    code, out, _ = run(capsys, "list", "--json", "--device", "cpu")
    assert code == 0
    data = strict_json(out)
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
    data = strict_json(out)
    assert code == 0
    assert data["status"] == "passed"
    assert data["relative_error"] < data["tolerance"]


class _Blows(TorchSdpaBackend):
    """Right shape and dtype, every value NaN: the canary's relative error is not finite."""

    name = "blows-up"

    def attend(self, views, plan):  # the plan type is the base class's to declare
        return torch.full(views.q.shape, float("nan"), dtype=plan.spec.output_dtype)


@pytest.fixture
def blowing_registry():
    reg = Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_Blows), name="vendor-blows-up")
    reset_registry(reg)
    yield reg
    reset_registry()


@pytest.mark.usefixtures("blowing_registry")
def test_check_json_stays_json_when_the_error_is_not_finite(capsys):
    code, out, _ = run(
        capsys,
        "check",
        "--preset",
        "bert-base",
        "--backend",
        "blows-up",
        "--device",
        "cpu",
        "--json",
    )
    assert code == 1
    data = strict_json(out)
    assert data["status"] == "failed"
    assert data["relative_error"] is None
    assert data["relative_error_not_finite"] == "inf"
    assert data["tolerance"] == TOLERANCE[torch.bfloat16]
    code, out, _ = run(
        capsys, "check", "--preset", "bert-base", "--backend", "blows-up", "--device", "cpu"
    )
    assert code == 1
    assert out.startswith("MISMATCH: blows-up:") and "relative error inf" in out


# --- every mistake: one line on stderr, exit 2, nothing on stdout, no traceback ---------------

MISTAKES = {
    "dtype": (["explain", "--preset", "short", "--dtype", "int8"], ["--dtype", "'int8'", "bf16"]),
    "device-name": (["explain", "--preset", "short", "--device", "banana"], ["'banana'", "cpu"]),
    "device-kind": (["explain", "--preset", "short", "--device", "mps"], ["'mps'", "cuda:<index>"]),
    "device-no-cuda": (
        ["explain", "--preset", "short", "--device", "cuda"],
        ["--device", "no CUDA device", "--device cpu", "--platform cuda:sm90"],
    ),
    "check-device-no-cuda": (
        ["check", "--preset", "short", "--device", "cuda:0"],
        ["no CUDA device", "--device cpu"],
    ),
    "list-device": (["list", "--device", "banana"], ["--device", "'banana'"]),
    "platform": (["explain", "--preset", "short", "--platform", "mars"], ["'mars'", "cuda:sm90"]),
    "platform-arch": (["list", "--platform", "cuda"], ["--platform", "cuda:sm90"]),
    "device-and-platform": (
        ["explain", "--preset", "short", "--device", "cpu", "--platform", "cpu"],
        ["--platform", "--device", "one of them"],
    ),
    "preset": (["explain", "--preset", "nope"], ["--preset", "'nope'", "bert-base"]),
    "backend": (
        ["explain", "--preset", "short", "--backend", "nope"],
        ["--backend 'nope'", "torch-sdpa", "attn-backends list"],
    ),
    "no-spec": (["explain"], ["--preset", "--heads and --head-dim"]),
    "only-heads": (["check", "--heads", "8"], ["--preset", "--head-dim"]),
    "heads-zero": (["explain", "--heads", "0", "--head-dim", "64"], ["--heads", "> 0", "0"]),
    "heads-text": (["explain", "--heads", "x", "--head-dim", "64"], ["--heads", "integer", "'x'"]),
    "head-dim-negative": (["explain", "--heads", "8", "--head-dim", "-64"], ["--head-dim"]),
    "heads-huge": (
        ["check", "--heads", "100000000000000000000000", "--head-dim", "64"],
        ["--heads", "from 1 to 1024", "100000000000000000000000"],
    ),
    "kv-heads-huge": (
        ["check", "--heads", "8", "--kv-heads", "2048", "--head-dim", "64"],
        ["--kv-heads", "from 1 to 1024"],
    ),
    "head-dim-huge": (
        ["check", "--heads", "2", "--head-dim", "65536"],
        ["--head-dim", "from 1 to 1024", "65536"],
    ),
    "kv-heads": (
        ["explain", "--heads", "8", "--kv-heads", "3", "--head-dim", "64"],
        ["--heads 8", "--kv-heads 3", "dividing 8"],
    ),
    "preset-heads": (
        ["explain", "--preset", "bert-base", "--heads", "8"],
        ["--heads 8", "12 KV heads of preset bert-base", "--kv-heads"],
    ),
    "preset-kv-heads": (
        ["explain", "--preset", "short", "--kv-heads", "3"],
        ["16 query heads of preset short", "--kv-heads 3"],
    ),
    "theta-small": (["explain", "--preset", "short", "--rope-theta", "0.5"], ["--rope-theta"]),
    "theta-nan": (["explain", "--preset", "short", "--rope-theta", "nan"], ["finite"]),
    "theta-inf": (["explain", "--preset", "short", "--rope-theta", "inf"], ["finite"]),
    "rotary-odd": (["explain", "--preset", "short", "--rotary-dim", "3"], ["--rotary-dim", "even"]),
    "rotary-wide": (
        ["explain", "--preset", "short", "--rotary-dim", "256"],
        ["--rotary-dim 256", "128 head dim of preset short", "at most 128"],
    ),
    "rotary-without-rope": (
        ["explain", "--preset", "bert-base", "--rotary-dim", "32"],
        ["--rotary-dim", "preset bert-base has none", "--rope-theta"],
    ),
    "interleaved-without-rope": (
        ["explain", "--heads", "8", "--head-dim", "64", "--interleaved"],
        ["--interleaved", "has none", "--rope-theta"],
    ),
    "no-rope-contradiction": (
        ["explain", "--preset", "short", "--no-rope", "--rope-theta", "1e4"],
        ["--no-rope contradicts --rope-theta"],
    ),
    "odd-head-dim-rope": (
        ["explain", "--heads", "4", "--head-dim", "65", "--rope-theta", "1e4"],
        ["--head-dim 65", "--rotary-dim"],
    ),
    "logn-base": (["explain", "--preset", "short", "--logn-base", "1"], ["--logn-base", ">= 2"]),
    "seed": (["check", "--preset", "short", "--seed", "-1"], ["--seed", ">= 0"]),
    "causal-and-bidirectional": (
        ["explain", "--preset", "short", "--causal", "--bidirectional"],
        ["--bidirectional", "--causal", "not both"],
    ),
    "kv-flag-value": (
        ["explain", "--preset", "short", "--need-rope-kv-cache", "maybe"],
        ["--need-rope-kv-cache", "'maybe'"],
    ),
    "kv-flag-contradiction": (
        ["explain", "--preset", "short", "--need-rope-kv-cache", "false", "--device", "cpu"],
        ["--need-rope-kv-cache false", "skip RoPE", "Leave the flag unset"],
    ),
    "check-platform": (
        ["check", "--preset", "short", "--platform", "cuda:sm90"],
        ["--platform does not apply to check", "--device", "explain --platform"],
    ),
    "list-spec-flag": (["list", "--preset", "short"], ["--preset", "list", "check and explain"]),
    "list-seed": (["list", "--seed", "3"], ["--seed does not apply to list", "check"]),
    "verbose-after-command": (
        ["explain", "--preset", "short", "-v"],
        ["-v", "before the command"],
    ),
    "unknown-option": (["explain", "--fp8"], ["no option --fp8", "explain --help"]),
    "positional": (["explain", "short"], ["'short'", "options only"]),
    "no-command": ([], ["give a command", "list", "explain", "check", "warmup"]),
    "unknown-command": (["lst"], ["'lst'", "list"]),
    "abbreviation": (["explain", "--pres", "short"], ["--pres"]),
    "bench-is-no-command": (["bench"], ["invalid choice: 'bench'", "'warmup'"]),
}


@pytest.mark.parametrize(("argv", "fragments"), MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_is_one_line_and_exit_2(monkeypatch, capsys, argv, fragments):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("attn-backends: error: ")
    for fragment in fragments:
        assert fragment in err


def test_a_cuda_index_past_the_last_device(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = run(capsys, "explain", "--preset", "short", "--device", "cuda:2")
    assert code == 2
    assert err == (
        "attn-backends: error: argument --device: 'cuda:2': this machine has 2 CUDA device(s), "
        "cuda:0 to cuda:1; pick one of those\n"
    )


def test_an_unknown_backend_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("ATTN_BACKEND", "nope")
    code, _, err = run(capsys, "explain", "--preset", "short", "--device", "cpu")
    assert code == 2
    assert err.count("\n") == 1
    assert "ATTN_BACKEND='nope' (from the environment)" in err and "unset ATTN_BACKEND" in err
    # An explicit --backend wins over the environment, as in `select`.
    code, out, _ = run(
        capsys, "explain", "--preset", "short", "--device", "cpu", "--backend", "torch-sdpa"
    )
    assert code == 0 and "selected: torch-sdpa (by explicit)" in out


@pytest.mark.parametrize("command", [[], ["list"], ["explain"], ["check"], ["warmup"]])
def test_help(capsys, command):
    code, out, err = run(capsys, *command, "--help")
    assert (code, err) == (0, "")
    assert out.startswith("usage: attn-backends")


def test_check_offers_no_option_it_refuses(capsys):
    assert main(["check", "--help"]) == 0
    assert "--platform" not in capsys.readouterr().out.replace("explain --platform", "")


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert (code, err) == (0, "")
    assert out == f"attn-backends {importlib.metadata.version('attn-backends')}\n"
    assert out == f"attn-backends {ab.__version__}\n"


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "attn_backends.cli", *argv]


def test_a_real_process_warns_about_nothing():
    """NumPy is a declared dependency: torch's "Failed to initialize NumPy" never shows."""
    result = subprocess.run(_cli("--version"), capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert "NumPy" not in result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("attn-backends ")


@pytest.mark.parametrize(
    ("argv", "unbuffered"),
    [
        (["explain", "--preset", "short", "--platform", "cpu"], "0"),
        (["explain", "--help"], "1"),
    ],
    ids=["output-buffered", "help-unbuffered"],
)
def test_a_pipe_closed_early_is_quiet(argv, unbuffered):
    """The reader is gone before anything is written (like `| head` that already quit):
    exit 141, no traceback, no "Exception ignored" at interpreter shutdown; the same whether
    stdout is buffered (written at the end) or not (each write fails at once)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered == "1":
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            _cli(*argv), stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, check=False
        )
    finally:
        os.close(write_end)
    assert result.returncode == EXIT_PIPE_CLOSED
    assert "Traceback" not in result.stderr
    assert "BrokenPipe" not in result.stderr
    assert "Exception ignored" not in result.stderr


# Window, soft-cap, ALiBi and RoPE-scaling flags.


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--preset", "short", "--window", "4095,0"],
            {"window": {"left": 4095, "right": 0}, "num_kv_heads": 8},
        ),
        (
            ["--preset", "bert-base", "--window", "64,64", "--alibi"],
            {"window": {"left": 64, "right": 64}, "alibi": {"slopes": "bloom"}, "causal": False},
        ),
        (["--preset", "short", "--logit-softcap", "50"], {"logit_softcap": 50.0}),
        (
            ["--preset", "short", "--chunk-size", "8192", "--window", "4095,0"],
            {"chunk_size": 8192, "window": {"left": 4095, "right": 0}},
        ),
        (
            ["--preset", "short", "--rope-scaling", '{"rope_type": "linear", "factor": 4}'],
            {"rope": {"theta": 1e6, "rotary_dim": 128, "interleaved": False}},
        ),
    ],
    ids=["causal-window", "bidirectional-window-alibi", "softcap", "chunk", "rope-scaling"],
)
@pytest.mark.usefixtures("flex_registry")
def test_feature_flags_replace_their_field_only(capsys, flags, expected):
    code, out, err = run(capsys, "explain", *flags, "--platform", "cpu", "--json")
    assert code == 0, err
    spec = strict_json(out)["spec"]
    rope = spec["rope"]
    if rope is not None:
        rope = {k: v for k, v in rope.items() if k != "scaling"}
    assert {key: (rope if key == "rope" else spec[key]) for key in expected} == expected


def test_rope_scaling_is_read_as_transformers_reads_the_dict(capsys):
    parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    code, out, err = run(
        capsys,
        "explain",
        *("--preset", "short", "--rope-scaling", json.dumps(parameters)),
        *("--max-position-embeddings", "32768", "--platform", "cpu", "--json"),
    )
    assert code == 0, err
    expected = ab.RopeScaling.from_hf(parameters, max_position_embeddings=32768).to_dict()
    assert strict_json(out)["spec"]["rope"]["scaling"] == expected


@pytest.fixture
def flex_registry():
    from attn_backends_builtin import flex

    reg = Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(flex, name="flex")
    reset_registry(reg)
    yield reg
    reset_registry()


@pytest.mark.usefixtures("flex_registry")
def test_softcap_flag_selects_flex_on_cpu_and_its_canary_passes(capsys):
    flags = ("--heads", "4", "--head-dim", "32", "--dtype", "fp32", "--logit-softcap", "20")
    code, out, err = run(capsys, "explain", *flags, "--device", "cpu", "--json")
    assert code == 0, err
    assert strict_json(out)["selected"] == "flex"
    code, out, err = run(capsys, "check", *flags, "--window", "3,0", "--alibi", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("OK: flex")


@pytest.mark.usefixtures("flex_registry")
def test_chunk_flag_is_served_on_cpu_and_named_in_explain(capsys):
    flags = ("--heads", "4", "--head-dim", "32", "--dtype", "fp32", "--chunk-size", "4")
    code, out, err = run(capsys, "explain", *flags, "--device", "cpu")
    assert code == 0, err
    assert "chunk 4" in out and "torch-sdpa" in out
    code, out, err = run(capsys, "check", *flags, "--logit-softcap", "20", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("OK: flex")


FEATURE_MISTAKES = {
    "window-format": (["--window", "4"], ["--window", "LEFT,RIGHT"]),
    "window-negative": (["--window", "4,-1"], ["--window", ">= 0"]),
    "window-right-causal": (
        ["--window", "4,4"],
        ["--window 4,4", "causal mask of preset short", "--window 4,0", "--bidirectional"],
    ),
    "window-right-causal-flag": (
        ["--causal", "--window", "2,1"],
        ["--window 2,1", "--causal hides", "--window 2,0"],
    ),
    "softcap-zero": (["--logit-softcap", "0"], ["--logit-softcap", "> 0"]),
    "chunk-zero": (["--chunk-size", "0"], ["--chunk-size", "from 1 to 2147483647", "'0'"]),
    "chunk-past-bound": (["--chunk-size", str(2**31)], ["--chunk-size", "from 1 to 2147483647"]),
    "chunk-text": (["--chunk-size", "4k"], ["--chunk-size", "'4k'"]),
    "softcap-text": (["--logit-softcap", "big"], ["--logit-softcap", "'big'"]),
    "rope-scaling-not-json": (["--rope-scaling", "{factor: 4}"], ["--rope-scaling", "not JSON"]),
    "rope-scaling-not-object": (["--rope-scaling", "[4]"], ["--rope-scaling", "JSON object"]),
    "rope-scaling-type": (
        ["--rope-scaling", '{"rope_type": "ntk"}'],
        ["--rope-scaling", "'ntk'", "yarn"],
    ),
    "rope-scaling-dynamic": (
        ["--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'],
        ["--rope-scaling", "max_position_embeddings", "--max-position-embeddings N"],
    ),
    "rope-scaling-no-rope": (
        ["--no-rope", "--rope-scaling", '{"rope_type": "linear", "factor": 2}'],
        ["--no-rope contradicts --rope-scaling"],
    ),
    "max-positions-alone": (
        ["--max-position-embeddings", "4096"],
        ["--max-position-embeddings", "only feeds --rope-scaling", "drop it"],
    ),
    "max-positions-unused": (
        [
            *("--rope-scaling", '{"rope_type": "linear", "factor": 2}'),
            *("--max-position-embeddings", "4096"),
        ],
        ["--max-position-embeddings 4096", "'linear'", "drop it"],
    ),
}


@pytest.mark.parametrize(
    ("flags", "fragments"), FEATURE_MISTAKES.values(), ids=FEATURE_MISTAKES.keys()
)
def test_a_feature_flag_mistake_is_one_line_and_exit_2(capsys, flags, fragments):
    code, out, err = run(capsys, "explain", "--preset", "short", *flags, "--platform", "cpu")
    assert (code, out) == (2, "")
    assert err.startswith("attn-backends: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err


def test_rope_scaling_without_rope_names_the_fix(capsys):
    scaling = '{"rope_type": "linear", "factor": 2}'
    code, _, err = run(
        capsys, "explain", "--preset", "bert-base", "--rope-scaling", scaling, "--platform", "cpu"
    )
    assert code == 2
    assert "--rope-scaling shapes RoPE" in err and "--rope-theta THETA" in err


# Values that look like options, an empty registry, records of a refusal, what list shows.


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--window", "-1,0"], ["argument --window", "both >= 0", "'-1,0'"]),
        (["--window", "-5"], ["argument --window", "expected LEFT,RIGHT"]),
        (["--logit-softcap", "-5"], ["argument --logit-softcap"]),
        (["--chunk-size", "-8"], ["argument --chunk-size", "'-8'"]),
    ],
)
def test_a_negative_value_is_read_and_refused_by_its_flag(capsys, flags, fragments):
    code, out, err = run(capsys, "explain", "--preset", "short", *flags, "--platform", "cpu")
    assert (code, out) == (2, "")
    assert err.startswith("attn-backends: error: ") and err.count("\n") == 1, err
    assert "expected one argument" not in err
    for fragment in fragments:
        assert fragment in err


def test_with_every_plugin_switched_off_the_error_says_why(monkeypatch, capsys):
    monkeypatch.setenv("ATTN_BACKENDS_PLUGINS", "none")
    reset_registry()
    try:
        code, out, err = run(capsys, "explain", "--preset", "short", "--platform", "cpu")
    finally:
        reset_registry()
    assert (code, out) == (1, "")
    assert "no backend is registered, because no plugin loaded one" in err
    assert "plugin torch-sdpa: disabled" in err and "$ATTN_BACKENDS_PLUGINS" in err


def test_explain_json_prints_the_record_when_nothing_fits(capsys):
    code, out, err = run(
        capsys, "explain", "--preset", "bert-base", "--kv-cache", "--platform", "cpu", "--json"
    )
    assert code == 1
    record = strict_json(out)
    assert record["selected"] is None and record["has_kv_cache"] is True
    assert record["error"]["type"] == "NoBackendError"
    sdpa = next(c for c in record["candidates"] if c["name"] == "torch-sdpa")
    assert sdpa["verdict"] == "rejected"
    assert "kv_cache_present" in {r["code"] for r in sdpa["reasons"]}
    assert "NoBackendError" in err


def _names_after(line: str) -> set[str]:
    return set(line.split(":", 1)[1].replace(",", " ").split())


def test_list_text_shows_every_declared_capability(capsys):
    code, out, _ = run(capsys, "list", "--platform", "cpu")
    assert code == 0
    blocks = out.split("\n\n")
    for entry in get_registry().entries():
        block = next(b for b in blocks if b.startswith(f"{entry.name}  ["))
        declared = entry.capabilities.to_dict()
        lines = [line.strip() for line in block.splitlines()]
        yes = _names_after(next(line for line in lines if line.startswith("declares:")))
        no = _names_after(next(line for line in lines if line.startswith("does not declare:")))
        for key, value in declared.items():
            if value is True:
                assert key in yes, (entry.name, key)
            elif value is False:
                assert key in no, (entry.name, key)
            elif value is not None:
                assert f"{key}: {value}" in lines, (entry.name, key)
    sdpa = next(b for b in blocks if b.startswith("torch-sdpa  ["))
    assert "features: {'window': {'right': True}, 'alibi': {'bidirectional': True" in sdpa
    flex = next(b for b in blocks if b.startswith("flex  ["))
    assert "'logit_softcap': {}" in flex and "'headwise': {}" in flex


def test_python_dash_m_runs_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "attn_backends", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("attn-backends ")


def test_short_output_into_a_pipe_read_after_the_command_ended_exits_0():
    """What ``attn-backends list | head -1`` does: the output fits the pipe's buffer, so it is
    written in full before the reader closes; 141 comes only when writing meets a closed pipe
    (`test_a_pipe_closed_early_is_quiet`)."""
    read_end, write_end = os.pipe()
    try:
        done = subprocess.run(_cli("list", "--platform", "cpu"), stdout=write_end, check=False)
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as reader:
        assert reader.readline().startswith("platform: cpu")
    assert done.returncode == 0
