"""Many threads at once: one decision per request, and no lost or torn registry edit."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
import attn_backends.deploy
import attn_backends.plugin as abp
from tests.static_plugin import StaticPlugin
from tests.threads import in_threads

SPEC = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True)
THREADS = 16


@pytest.fixture(autouse=True)
def _busy_switching(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Switch threads as often as possible, so unlocked read-modify-write races show up."""
    for var in ("ATTN_BACKEND", "ATTN_BACKENDS_PLUGINS", "ATTN_BACKENDS_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class _Counting(torch_sdpa.TorchSdpaBackend):
    """torch-sdpa that counts ``prepare`` calls across all its bound instances."""

    name = "counting"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
    )
    prepared = 0
    lock = threading.Lock()

    def prepare(self, params: ab.FMHAParams) -> ab.PrefillPlan:
        with _Counting.lock:
            _Counting.prepared += 1
        return super().prepare(params)


def _renamed(name: str) -> type[torch_sdpa.TorchSdpaBackend]:
    return type(f"Backend_{name}", (torch_sdpa.TorchSdpaBackend,), {"name": name})


def test_concurrent_select_gives_one_decision_and_one_canary() -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_Counting, first_on="cpu"), name="counting")
    ab.deploy.clear_selection_cache()
    _Counting.prepared = 0
    results = in_threads(
        THREADS, lambda _: ab.select(SPEC, device="cpu", strict=True, registry=reg)
    )
    first = results[0]
    assert isinstance(first, ab.Selection)
    assert first.name == "counting"
    assert first.canary.status == "passed"
    assert all(r is first for r in results), "threads got different Selection objects"
    assert _Counting.prepared == 1, "the strict canary ran more than once"


def test_concurrent_registrations_are_neither_lost_nor_torn() -> None:
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    per_thread = 6
    writers = THREADS // 2

    def work(i: int) -> list[ab.Selection]:
        if i < writers:
            for j in range(per_thread):
                record = reg.register_plugin(StaticPlugin(_renamed(f"b{i}-{j}")), name=f"p{i}-{j}")
                assert record.status == "loaded"
            return []
        return [ab.select(SPEC, platform="cpu", registry=reg) for _ in range(per_thread)]

    results = in_threads(THREADS, work)
    entries = reg.entries()
    assert len(entries) == 1 + writers * per_thread
    assert sorted(e.order for e in entries) == list(range(len(entries))), "lost an order slot"
    assert len(reg.records()) == 1 + writers * per_thread
    for selections in results:
        assert isinstance(selections, list)
        for sel in selections:
            # each decision saw one consistent snapshot: a candidate per loaded backend
            assert len(sel.candidates) == sum(len(p.backends) for p in sel.plugins)


def test_racing_for_one_backend_name_leaves_exactly_one_owner() -> None:
    reg = ab.deploy.Registry()
    results = in_threads(
        THREADS, lambda i: reg.register_plugin(StaticPlugin(_renamed("racer")), name=f"racer-{i}")
    )
    records = [r for r in results if isinstance(r, ab.deploy.PluginRecord)]
    loaded = [r for r in records if r.status == "loaded"]
    assert len(loaded) == 1
    owner = reg.get("racer")
    assert owner is not None
    assert owner.plugin == loaded[0].name
    refused = [r for r in records if r.status == "failed"]
    assert len(refused) == THREADS - 1
    assert all(f"taken by plugin {owner.plugin}" in (r.error or "") for r in refused)
