"""The engine plugins without an engine: their registration never breaks the engine, their
state is what ``attn-backends list`` shows, and the layer they share is exact."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import attn_backends as ab
from attn_backends.cli import main
from attn_backends.errors import IntegrationError
from attn_backends.integrations import _engine_plugins as plugins
from attn_backends.integrations._engine_layer import EngineBatch, EngineLayer, LayerShape
from tests.engine_support import assert_matches_reference, projection


@pytest.fixture(autouse=True)
def _forget_outcomes():
    plugins._outcomes.clear()
    yield
    plugins._outcomes.clear()


@pytest.mark.parametrize(
    ("version", "admitted"),
    [("0.33.0", True), ("0.34.1.dev4+g0abc", True), ("0.35.0", False), ("0.32.9", False)],
)
def test_tested_range_of_vllm(version, admitted):
    assert plugins.ENGINES["vllm"].admits(version) is admitted


def test_a_missing_engine_registers_nothing(monkeypatch, caplog):
    monkeypatch.setattr(plugins, "installed_version", lambda engine: None)
    called: list[int] = []

    def register() -> str:
        called.append(1)
        return "x"

    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        assert not plugins.guarded("vllm", register)
    assert called == []
    assert "vllm is not installed" in caplog.text


def test_an_untested_engine_release_registers_nothing(monkeypatch):
    monkeypatch.setattr(plugins, "installed_version", lambda engine: "0.40.0")
    called: list[int] = []

    def register() -> str:
        called.append(1)
        return "x"

    assert not plugins.guarded("vllm", register)
    assert called == []
    (row,) = [r for r in plugins.engine_plugins() if r.engine == "vllm"]
    assert row.state == "version untested"
    assert "0.40.0 is outside the tested range >=0.33,<0.35" in row.detail


def test_a_failing_registration_is_recorded_not_raised(monkeypatch):
    """The engine loads its plugins at startup: an error here must not take it down."""
    monkeypatch.setattr(plugins, "installed_version", lambda engine: "0.34.0")

    def broken() -> str:
        raise ImportError("no module named vllm.v1.attention.backends.registry")

    assert not plugins.guarded("vllm", broken)
    (row,) = [r for r in plugins.engine_plugins() if r.engine == "vllm"]
    assert row.state == "failed"
    assert "ImportError: no module named" in row.detail


def test_list_shows_each_engine_plugin(capsys):
    assert main(["list", "--json"]) == 0
    engines = {e["engine"]: e for e in json.loads(capsys.readouterr().out)["engines"]}
    assert set(engines) == {"vllm", "sglang"}
    # this checkout's metadata carries the entry point each engine reads at startup
    assert engines["vllm"]["entry_point"] is True
    assert engines["sglang"]["entry_point"] is True
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "engine plugins" in text and "vllm:" in text and "sglang:" in text


def test_engine_layer_matches_float64_on_padded_rows():
    proj = projection((5, 0, 3), 4, 2, 16, pad=4, seed=1)
    batch = EngineBatch.from_lengths([5, 0, 3], "cpu")
    proj.lengths = (5, 3)  # the empty request an engine pads with holds no token
    layer = EngineLayer(LayerShape(4, 2, 16, softmax_scale=0.25), engine="test")
    out = torch.full((proj.qkv.shape[0], 64), float("nan"))
    layer.run(batch, proj.q, proj.k, proj.v, out)
    spec = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False, softmax_scale=0.25)
    assert_matches_reference(out, proj, spec)


def test_engine_layer_plans_once_per_batch_and_spec():
    batch = EngineBatch.from_lengths([4, 4], "cpu")
    layer = EngineLayer(LayerShape(2, 2, 16, softmax_scale=0.25), engine="test")
    proj = projection((4, 4), 2, 2, 16)
    out = torch.empty(8, 32)
    for _ in range(3):
        layer.run(batch, proj.q, proj.k, proj.v, out)
    assert len(batch.plans) == 1


def test_engine_layer_refuses_short_inputs_and_wrong_outputs():
    batch = EngineBatch.from_lengths([4, 4], "cpu")
    layer = EngineLayer(LayerShape(2, 2, 16, softmax_scale=0.25), engine="test")
    proj = projection((4, 3), 2, 2, 16)
    with pytest.raises(IntegrationError, match="holds 8 tokens but the layer was given"):
        layer.run(batch, proj.q, proj.k, proj.v, torch.empty(7, 32))
    proj = projection((4, 4), 2, 2, 16)
    with pytest.raises(IntegrationError, match="output buffer"):
        layer.run(batch, proj.q, proj.k, proj.v, torch.empty(8, 16))


def test_an_engine_batch_without_tokens_is_refused():
    with pytest.raises(IntegrationError, match="no token"):
        EngineBatch.from_lengths([0, 0], "cpu")
