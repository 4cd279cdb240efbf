"""Every text model class of the installed transformers: its own attention or a named refusal.

One test per class (`catalogue.zoo`), fp32, and a bf16 subset: the class's outcome is
``match`` (every input form within the class's measured tolerance) or ``refused`` (a named
attn_backends error on some form, the others matching). A wrong result or any other exception
fails the test. A class the shrinker cannot make tiny is skipped with its reason (and listed
as "not built" in the table). The negative controls break the integration on purpose (a window
one key wider, a dropped chunk, a doubled scale) and the comparison must see it.

On a GPU machine, ``ZOO_DEVICE=cuda ZOO_BF16_ALL=1 ZOO_HEAD_DIM=64 pytest tests/zoo -k
test_bf16`` runs every class in bf16 on cuda with heads of 64 (the size the flashinfer kernels
serve), so the backends the selector picks there are the ones proven.

``ZOO_RESULTS=path`` writes the outcomes as JSON at the end of the session; ``render_table.py``
turns that file into docs/hf-zoo.md, and `test_checked_in_table_agrees` compares the table with
the outcomes this session computed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import attn_backends as ab
from attn_backends.integrations import _hf_call
from tests.zoo import catalogue, harness, render_table

BF16_SUBSET = (
    "BertModel",
    "LlamaModel",
    "Qwen3Model",
    "MistralModel",
    "Gemma2Model",
    "Gemma3TextModel",
    "ModernBertModel",
    "GPT2Model",
)
ZOO = {e.class_name: e for e in catalogue.zoo()}
_RESULTS: dict[tuple[str, torch.dtype], harness.ClassResult] = {}


def _result(class_name: str, dtype: torch.dtype) -> harness.ClassResult:
    """One run per class and dtype per session: the controls and the table reuse it."""
    key = (class_name, dtype)
    if key not in _RESULTS:
        _RESULTS[key] = harness.run_class(ZOO[class_name], dtype)
    return _RESULTS[key]


@pytest.fixture(scope="session", autouse=True)
def _write_results() -> Iterator[None]:
    yield
    target = os.environ.get("ZOO_RESULTS")
    if target:
        ordered = sorted(_RESULTS.values(), key=lambda r: (r.dtype != "float32", r.class_name))
        rows = [r.to_json() for r in ordered]
        Path(target).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


def _check(result: harness.ClassResult) -> None:
    if result.outcome == "not built":
        pytest.skip(f"not built: {result.reason}")
    assert result.outcome in ("match", "refused"), f"{result.outcome}: {result.reason}"


@pytest.mark.parametrize("class_name", sorted(ZOO))
def test_fp32(class_name):
    _check(_result(class_name, torch.float32))


BF16_CLASSES = sorted(ZOO) if os.environ.get("ZOO_BF16_ALL") == "1" else BF16_SUBSET
"""``ZOO_BF16_ALL=1`` runs every class in bf16 (on a GPU, with ``ZOO_DEVICE=cuda``)."""


@pytest.mark.parametrize("class_name", [c for c in BF16_CLASSES if c in ZOO])
def test_bf16(class_name):
    _check(_result(class_name, torch.bfloat16))


def test_a_class_whose_default_config_fails_is_run_not_excluded():
    """Another transformers version may ship a config whose defaults do not validate (seen:
    a required sub-config left None): the catalogue must not fail at collection, nor hide
    the class as not applicable; the zoo runs it and its build reports why it failed."""

    class Model:
        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("not called")

    class BrokenConfig:
        sub_configs = None

        def __init__(self):
            raise TypeError("Field 'text_encoder' expected dict, got NoneType")

    assert catalogue._exclusion("broken", Model, BrokenConfig) is None


def test_every_class_is_in_the_zoo_or_excluded_by_a_rule():
    entries = catalogue.entries()
    assert len(entries) > 400  # the installed transformers' base classes, not a hand list
    assert len({e.class_name for e in entries}) == len(entries)
    assert all(e.excluded is None or e.excluded.strip() for e in entries)
    for name in ("BertModel", "LlamaModel", "MPNetModel", "BloomModel", "Gemma3TextModel"):
        assert name in ZOO
    for name, why in (
        ("ViTModel", "no text input"),
        ("MambaModel", "no attention layer"),
        ("T5Model", "encoder-decoder"),
        ("LlavaModel", "multimodal"),
    ):
        excluded = next(e for e in entries if e.class_name == name).excluded
        assert excluded is not None
        assert excluded.startswith(why)


# --- negative controls: a broken integration must be seen ----------------------------------


def _spec_changed(monkeypatch: pytest.MonkeyPatch, change) -> None:
    real = _hf_call.layer_spec
    monkeypatch.setattr(_hf_call, "layer_spec", lambda *a, **k: change(real(*a, **k)))


def _served_forms(class_name: str) -> list[str]:
    result = _result(class_name, torch.float32)
    if result.outcome != "match":
        pytest.skip(f"{class_name} is {result.outcome} here: {result.reason}")
    return [k for k, r in result.forms.items() if r.status == "match"]


def _errors_with_control(
    class_name: str, monkeypatch: pytest.MonkeyPatch, change
) -> dict[str, harness.FormResult]:
    """The forms the class serves, run again (fresh model, same weights) with the spec
    changed; the class's own result and tolerance are computed before the change."""
    served = _served_forms(class_name)
    tolerance = _result(class_name, torch.float32).tolerance
    assert tolerance is not None
    _spec_changed(monkeypatch, change)
    built = harness.build(ZOO[class_name], torch.float32)
    return {
        k: harness.run_form(built, f, tolerance)
        for k, f in harness.forms(built).items()
        if k in served
    }


def _assert_caught(controlled: dict[str, harness.FormResult]) -> None:
    """No form of the broken integration matches: the comparison sees a wrong result, or the
    integration's own mask check refuses the spec that no longer expresses the model's mask
    (it does for a wider window or a dropped chunk; the doubled scale, which no mask shows,
    is the control that the comparison alone must catch)."""
    assert controlled
    assert all(r.status in ("wrong", "refused") for r in controlled.values()), controlled


def _widened(spec: ab.AttentionSpec) -> ab.AttentionSpec:
    w = spec.window
    if w is None:
        return spec
    wider = ab.SlidingWindow(left=w.left + 1, right=w.right + 1 if w.right else w.right)
    return dataclasses.replace(spec, window=wider)


@pytest.mark.parametrize("class_name", ["MistralModel", "Gemma2Model", "ModernBertModel"])
def test_control_window_one_key_wider_is_wrong(class_name, monkeypatch):
    controlled = _errors_with_control(class_name, monkeypatch, _widened)
    _assert_caught(controlled)


def _chunk_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ab.AttentionSpec) if "chunk" in f.name]


def test_control_dropped_chunk_is_wrong(monkeypatch):
    fields = _chunk_fields()
    if not fields:
        pytest.skip("AttentionSpec has no chunk field: chunked attention can only be refused")
    controlled = _errors_with_control(
        "Llama4TextModel", monkeypatch, lambda s: dataclasses.replace(s, **dict.fromkeys(fields))
    )
    _assert_caught(controlled)


@pytest.mark.parametrize("class_name", ["BertModel", "LlamaModel"])
def test_control_doubled_scale_is_wrong(class_name, monkeypatch):
    controlled = _errors_with_control(
        class_name, monkeypatch, lambda s: dataclasses.replace(s, softmax_scale=2 * s.scale)
    )
    assert set(controlled) == set(harness.FORMS)
    assert all(r.status == "wrong" for r in controlled.values()), controlled  # the comparison


def test_checked_in_table_agrees():
    """The rows of docs/hf-zoo.md for the classes this session ran say what they computed."""
    table = render_table.read_rows(render_table.DOC)
    ran = {r.class_name: r for (_, dtype), r in _RESULTS.items() if dtype == torch.float32}
    if not ran:
        pytest.skip("no zoo class ran in this session")
    for name, result in ran.items():
        want = render_table.row_cells(result.to_json())
        assert table.get(name) == want, f"{name}: regenerate docs/hf-zoo.md (render_table.py)"
    for entry in catalogue.entries():
        if entry.excluded is not None:
            assert table.get(entry.class_name) == render_table.excluded_cells(entry)
