"""The alternating A/B prints one JSON line per workload; ``--floor`` adds the packed encode with
the library's hooks free where that is exact (one text, plain attention), and says why not
elsewhere."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("sentence_transformers")

from tests.script_support import load_script

ARGS = ["--cpu-tiny", "--device", "cpu", "--rounds", "1", "--repeats", "1", "--floor"]


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def test_the_floor_is_timed_on_one_text_and_not_on_several(capsys):
    ab = load_script("benchmarks/serving_ab.py")
    assert ab.main([*ARGS, "--model", "bge-m3", "--workloads", "queries 1,queries 8"]) == 0
    one, eight = _lines(capsys)
    assert one["workload"].startswith("queries 1 ") and eight["workload"].startswith("queries 8")
    assert one["floor_ms"] > 0 and len(one["rounds_ms"]["floor"]) == 1
    assert one["floor_over_padded"] == round(one["floor_ms"] / one["padded_ms"], 3)
    assert eight["floor_ms"] is None and "several texts" in eight["no_floor"]
    assert "floor" not in eight["rounds_ms"]


def test_no_floor_where_plain_attention_is_not_the_models(capsys):
    """The tiny EmbeddingGemma's sliding window is shorter than its query: plain SDPA would
    compute another attention, so the floor is refused with the cosine that showed it."""
    ab = load_script("benchmarks/serving_ab.py")
    assert ab.main([*ARGS, "--model", "embeddinggemma", "--workloads", "queries 1"]) == 0
    (line,) = _lines(capsys)
    assert line["floor_ms"] is None and "min cosine" in line["no_floor"]
    assert line["packed_ms"] > 0 and "floor" not in line["rounds_ms"]
