"""The one-model profiler writes a profile per path asked for, the graph runner's included, and
refuses a path it does not know."""

from __future__ import annotations

import pytest

pytest.importorskip("sentence_transformers")

from tests.script_support import load_script


def test_profiles_each_path_asked_for_and_only_those(tmp_path, capsys):
    profile = load_script("benchmarks/serving_profile.py")
    argv = ["--out", str(tmp_path), "--cpu-tiny", "--device", "cpu", "--workloads", "queries 1"]
    assert profile.main([*argv, "--encodes", "1", "--rows", "5", "--paths", "runner,padded"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "queries-1.padded.txt",
        "queries-1.runner.txt",
    ]
    runner = (tmp_path / "queries-1.runner.txt").read_text()
    assert "graph_runner.py" in runner, "the runner's profile holds the runner's calls"
    printed = capsys.readouterr().out
    assert "queries 1 x 8..40 runner:" in printed and "packed:" not in printed


def test_an_unknown_path_is_refused_by_name(tmp_path, capsys):
    profile = load_script("benchmarks/serving_profile.py")
    with pytest.raises(SystemExit):
        profile.main(["--out", str(tmp_path), "--paths", "padded,graphs"])
    assert "--paths takes padded, packed, runner; got 'padded,graphs'" in capsys.readouterr().err
