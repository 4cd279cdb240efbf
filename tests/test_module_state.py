"""Process-wide caches: each reset empties its cache (the next call computes again), and the
locks guarding them lose nothing when threads use them at once.

Each test works on fresh copies of the state it fills (monkeypatch) and puts back what it
withdraws; caches that only cost a recomputation (choices of a pass, whole-rows layouts) are
simply cleared.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from attn_backends_builtin import _aiter_binding, _flashinfer_direct, _flashinfer_jit, flex, trt
from attn_backends_builtin import flashinfer as fi
from attn_backends_builtin._flashinfer_common import CompletionMarker, StreamBuffers
from attn_backends_builtin._flex_kernel import CompileState

import attn_backends as ab
from attn_backends._path import _preprocess, _rope_passes
from attn_backends._values import _platform
from attn_backends.integrations import (
    _hf_call,
    _hf_mask,
    _hf_models,
    _layout,
    _packed,
    _registered,
)
from attn_backends.integrations import transformers as hf
from tests.threads import in_threads

THREADS = 4
CALLS = 200
CPU = torch.device("cpu")
SPEC = ab.AttentionSpec(4, 2, 64, torch.float16, causal=True)


def run_threads(work: Callable[[int], object]) -> None:
    """``work(thread index)`` on `THREADS` threads released together."""
    in_threads(THREADS, work, timeout=30)


def finishes(action: Callable[[], None]) -> bool:
    """Whether ``action`` returns within seconds on another thread (a deadlock would not)."""
    worker = threading.Thread(target=action, daemon=True)
    worker.start()
    worker.join(timeout=5)
    return not worker.is_alive()


class Counter:
    """A stand-in that counts its calls and returns a new object each time."""

    def __init__(self, result: Callable[[], object] = object) -> None:
        self.calls = 0
        self._result = result
        self._lock = threading.Lock()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        with self._lock:
            self.calls += 1
        return self._result()


# ---------------------------------------------------------------- the core's caches


def test_required_libraries_reset_stops_probing_them(monkeypatch):
    monkeypatch.setattr(_platform, "_required", set(_platform._required))
    _platform.note_required_libraries(["zz_not_installed"])
    assert ("zz_not_installed", None) in _platform.detect_platform("cpu").libraries
    _platform.clear_required_libraries()
    assert "zz_not_installed" not in dict(_platform.detect_platform("cpu").libraries)


def test_preprocess_reset_chooses_again(monkeypatch):
    choose = Counter(lambda: _preprocess.PreprocessChoice("torch", "counted"))
    monkeypatch.setattr(_preprocess, "choose_preprocess", choose)
    spec = ab.AttentionSpec(4, 2, 64, torch.float16, causal=True, rope=ab.RopeSpec(1e4))
    platform = ab.Platform(kind="cpu")
    _preprocess.clear_preprocess_cache()
    try:
        for _ in range(2):
            _preprocess.resolve_preprocess(spec, platform, False)
        assert choose.calls == 1
        _preprocess.clear_preprocess_cache()
        _preprocess.resolve_preprocess(spec, platform, False)
        assert choose.calls == 2
    finally:
        _preprocess.clear_preprocess_cache()


def test_host_pass_reset_withdraws_what_the_host_registered():
    host = _rope_passes.IN_PROCESS_OWNER
    held = [h.original for h in _rope_passes._held.values() if host in h.owners]
    extra = _rope_passes.RopePass(
        name="zz-state-test",
        ranks=(("cpu", 1),),
        note="a test pass",
        refusal=lambda spec, platform: None,
        apply=lambda packed, spec, params: False,
    )
    try:
        _rope_passes.register_rope_pass(extra)
        before = _rope_passes.table_generation()
        assert _rope_passes.find_rope_pass("zz-state-test") is not None
        _rope_passes.clear_host_passes()
        assert _rope_passes.find_rope_pass("zz-state-test") is None
        assert _rope_passes.table_generation() > before, "cached choices must see the change"
        assert _rope_passes.find_rope_pass("torch") is not None, "the core's passes stay"
    finally:
        _rope_passes.clear_host_passes()
        assert _rope_passes.install(host, held) is None


# ---------------------------------------------------------------- transformers integration


class _Config:
    pass


class _Model:
    checks = 0

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        cls.checks += 1
        return False


def test_model_caches_reset_asks_transformers_again(monkeypatch):
    monkeypatch.setattr(_hf_models, "_classes", {})
    monkeypatch.setattr(_hf_models, "_bypassers", {})
    find = Counter(lambda: (_Model,))
    monkeypatch.setattr(_hf_models, "_find_model_classes", find)
    monkeypatch.setattr(_Model, "checks", 0)
    for _ in range(2):
        assert _hf_models.model_name(_Config()) == "_Model"
        assert _hf_models._bypassing(_Config) == "_Model"
    assert (find.calls, _Model.checks) == (1, 1)
    _hf_models.clear_model_caches()
    assert _hf_models._bypassing(_Config) == "_Model"
    assert (find.calls, _Model.checks) == (2, 2)


def test_model_caches_reset_reads_config_classes_again(monkeypatch):
    monkeypatch.setattr(_hf_models, "_beyond_instance", {})
    pytest.importorskip("transformers")
    from transformers import BertConfig

    config = BertConfig()
    assert _hf_models._text_config(config) is config is config.get_text_config()
    assert BertConfig in _hf_models._beyond_instance
    _hf_models.clear_model_caches()
    assert _hf_models._beyond_instance == {}


def test_model_caches_reset_reads_the_attention_tables_again(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(_hf_models, "_classes", {})
    monkeypatch.setattr(_hf_models, "_bypassers", {})
    module = tmp_path / "models" / "zz" / "modeling_zz.py"
    module.parent.mkdir(parents=True)
    module.write_text("ZZ_ATTENTION_CLASSES = {\n}\n")
    monkeypatch.setattr(_hf_models, "_tables_found", [("cached", "TABLE")])
    monkeypatch.setattr(transformers, "__file__", str(tmp_path / "__init__.py"))
    assert _hf_models._attention_tables() == [("cached", "TABLE")]
    _hf_models.clear_model_caches()
    assert _hf_models._attention_tables() == [
        ("transformers.models.zz.modeling_zz", "ZZ_ATTENTION_CLASSES")
    ]


def test_decisions_reset_forgets_and_logs_again(monkeypatch, caplog):
    monkeypatch.setattr(_hf_call, "_decided", {})
    found = cast(Any, types.SimpleNamespace(name="zz-backend"))
    module = torch.nn.Identity()
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        for _ in range(2):
            _hf_call._log_decision(found, SPEC, CPU, None, module)
        assert hf.decisions() == [found]
        hf.clear_decisions()
        assert hf.decisions() == []
        _hf_call._log_decision(found, SPEC, CPU, None, module)
    assert sum("served by zz-backend" in r.getMessage() for r in caplog.records) == 2


class _Backend:
    def __init__(self) -> None:
        self.prepare = Counter()


def _selection(backend: _Backend) -> Any:
    return types.SimpleNamespace(backend=backend)


def test_layout_cache_reset_prepares_again():
    backend = _Backend()
    hf.clear_layout_cache()
    layout = _layout.full_rows(2, 8, CPU)
    assert _layout.full_rows(2, 8, CPU) is layout, "whole rows are shared across batches"
    plan = hf._plan_for(layout, _selection(backend), SPEC)
    assert hf._plan_for(_layout.full_rows(2, 8, CPU), _selection(backend), SPEC) is plan
    assert backend.prepare.calls == 1
    hf.clear_layout_cache()
    fresh = _layout.full_rows(2, 8, CPU)
    assert fresh is not layout
    assert hf._plan_for(fresh, _selection(backend), SPEC) is not plan
    assert backend.prepare.calls == 2


def test_plans_of_a_shared_layout_are_one_per_spec_across_threads():
    backend = _Backend()
    _layout.full_rows.cache_clear()  # a layout no earlier test prepared plans on
    layout = _layout.full_rows(2, 8, CPU)
    specs = [ab.AttentionSpec(2 * n, 2, 64, torch.float16, causal=True) for n in range(1, 11)]
    seen: list[dict[int, object]] = [{} for _ in range(THREADS)]

    def work(index: int) -> None:
        for call in range(CALLS):
            k = call % len(specs)
            plan = hf._plan_for(layout, _selection(backend), specs[k])
            assert seen[index].setdefault(k, plan) is plan, "a spec's plan changed"

    run_threads(work)
    assert len(layout.plans) == len(specs)
    for k, spec in enumerate(specs):
        stored = layout.plans[(id(backend), spec)][1]
        assert all(s[k] is stored for s in seen), "every thread uses the stored plan"


def test_marked_functions_reset_and_die_with_their_function(monkeypatch):
    monkeypatch.setattr(_registered, "_OURS", weakref.WeakSet())

    def attention() -> None: ...

    _registered.mark_ours(attention)
    assert _registered._is_ours(attention)
    _registered.clear_ours()
    assert not _registered._is_ours(attention)
    _registered.mark_ours(attention)
    del attention
    gc.collect()
    assert len(_registered._OURS) == 0, "a dropped function leaves no id behind"
    assert not _registered._is_ours(_Unhashable()), "an unhashable callable is not ours"


class _Unhashable:
    def __eq__(self, other: object) -> bool:  # and so no __hash__
        return self is other

    def __call__(self) -> None: ...


def test_marking_functions_from_threads_loses_none(monkeypatch):
    monkeypatch.setattr(_registered, "_OURS", weakref.WeakSet())
    made: list[list[Callable[[], None]]] = [[] for _ in range(THREADS)]

    def work(index: int) -> None:
        for _ in range(CALLS):

            def function() -> None: ...

            made[index].append(function)
            _registered.mark_ours(function)

    run_threads(work)
    assert len(_registered._OURS) == THREADS * CALLS
    assert all(_registered._is_ours(f) for fs in made for f in fs)


def test_mask_requests_get_distinct_serials_and_newest_is_the_last():
    tokens: list[list[tuple[torch.Tensor, Any]]] = [[] for _ in range(THREADS)]

    def work(index: int) -> None:
        for _ in range(CALLS):
            token = _hf_mask.guard(torch.zeros(1), "m")
            request = types.SimpleNamespace(serial=0)
            _hf_mask.record(token, cast(Any, request))
            tokens[index].append((token, request))

    run_threads(work)
    serials = [r.serial for pairs in tokens for _, r in pairs]
    assert len(set(serials)) == THREADS * CALLS
    assert _hf_mask.newest_serial() == max(serials)
    assert all(_hf_mask.request_of(t) is r for pairs in tokens for t, r in pairs)


def test_a_request_lives_on_its_guard_only():
    """The request is found on the guard the hook returned, by that tensor alone: another
    tensor (the guard's base, a plain tensor) has none, and nothing global keeps it alive."""
    base = torch.zeros(1)
    token = _hf_mask.guard(base, "m")
    request = _hf_mask.MaskRequest("m", 1, 1, torch.device("cpu"), None)
    _hf_mask.record(token, request)
    assert _hf_mask.request_of(token) is request
    assert _hf_mask.request_of(base) is None
    assert _hf_mask.request_of(torch.zeros(1)) is None
    kept = weakref.ref(request)
    del token, request
    gc.collect()
    assert kept() is None


def test_a_tensor_dying_under_the_tracked_lock_does_not_deadlock():
    tracked: _packed._Tracked[int] = _packed._Tracked()

    def die_under_the_lock() -> None:
        boundaries = torch.zeros(1)
        tracked.put(boundaries, 1)
        with tracked._lock:
            del boundaries

    assert finishes(die_under_the_lock)
    assert tracked._items == {}


# ---------------------------------------------------------------- the built-in plugins


def test_flashinfer_reset_empties_workspaces_pool_and_announcements(monkeypatch, caplog):
    monkeypatch.setattr(fi, "WORKSPACES", StreamBuffers(64))
    monkeypatch.setattr(fi, "POOL", fi.WrapperPool())
    monkeypatch.setattr(fi, "_announced", set())
    monkeypatch.setattr(_flashinfer_direct, "_verdicts", {"a kernel module": True})
    monkeypatch.setattr(_flashinfer_direct, "_said", {"a reason"})
    built = Counter()
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithRaggedKVCacheWrapper = built  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)

    key: fi.PoolKey = (CPU, 0, "fa2")
    workspace = fi.WORKSPACES.get((CPU, 0))
    assert fi.WORKSPACES.get((CPU, 0)) is workspace
    wrapper = object()
    fi.POOL.give_back(key, wrapper, CompletionMarker(CPU))
    assert fi.POOL.lease(key, workspace) is wrapper, "an idle wrapper is reused"
    fi.POOL.give_back(key, wrapper, CompletionMarker(CPU))
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        for _ in range(2):
            fi.announce_first_use(_flashinfer_jit.ROPE_MODULE)
        fi.clear_caches()
        fi.announce_first_use(_flashinfer_jit.ROPE_MODULE)
    assert sum("first use of JIT module" in r.getMessage() for r in caplog.records) == 2
    assert fi.WORKSPACES.get((CPU, 0)) is not workspace
    assert fi.POOL.idle(key) == 0
    assert fi.POOL.lease(key, workspace) is not wrapper
    assert built.calls == 1, "after the reset a wrapper is built anew"
    assert _flashinfer_direct._verdicts == {} and _flashinfer_direct._said == set(), (
        "the direct call is proved again after the reset"
    )


def test_a_wrapper_given_back_under_the_pool_lock_does_not_deadlock():
    pool = fi.WrapperPool()
    key: fi.PoolKey = (CPU, 0, "fa2")

    def give_back_under_the_lock() -> None:
        with pool._lock:  # as when a plan's finalizer runs inside `lease`
            pool.give_back(key, object(), CompletionMarker(CPU))

    assert finishes(give_back_under_the_lock)
    assert pool.idle(key) == 1


def test_trt_reset_allocates_a_new_workspace(monkeypatch):
    monkeypatch.setattr(trt, "WORKSPACES", StreamBuffers(64))
    workspace = trt.WORKSPACES.get((CPU, 0))
    assert trt.WORKSPACES.get((CPU, 0)) is workspace
    trt.clear_caches()
    assert trt.WORKSPACES.get((CPU, 0)) is not workspace


def test_aiter_bindings_reset_reads_signatures_again(monkeypatch):
    monkeypatch.setattr(_aiter_binding, "_BOUND", {})
    bind = Counter()
    monkeypatch.setattr(_aiter_binding, "bind_entry", bind)

    def kernel() -> None: ...

    first = _aiter_binding.binding_for("mha_varlen_fwd", kernel)
    assert _aiter_binding.binding_for("mha_varlen_fwd", kernel) is first
    assert _aiter_binding.last_binding("mha_varlen_fwd") is first
    assert bind.calls == 1
    _aiter_binding.clear_bindings()
    assert _aiter_binding.last_binding("mha_varlen_fwd") is None
    assert _aiter_binding.binding_for("mha_varlen_fwd", kernel) is not first
    assert bind.calls == 2


def test_aiter_bindings_from_threads_lose_no_entry(monkeypatch):
    monkeypatch.setattr(_aiter_binding, "_BOUND", {})
    monkeypatch.setattr(_aiter_binding, "bind_entry", Counter())
    entries: tuple[_aiter_binding.EntryPoint, ...] = (
        "fmha_v3_varlen_fwd",
        "mha_varlen_fwd",
        "flash_attn_varlen_fp8_pertensor_func",
    )

    def kernel() -> None: ...

    def work(index: int) -> None:
        for call in range(CALLS):
            entry = entries[(call + index) % len(entries)]
            assert _aiter_binding.binding_for(entry, kernel) is not None

    run_threads(work)
    assert set(_aiter_binding._BOUND) == set(entries)
    assert all(_aiter_binding._BOUND[e][0] is kernel for e in entries)


def test_flex_reset_tries_the_compiled_kernel_again(monkeypatch):
    monkeypatch.setattr(flex, "COMPILE_STATE", CompileState())
    flex.COMPILE_STATE.record_failure("RuntimeError: no compiler")
    assert (flex.COMPILE_STATE.failures, flex.COMPILE_STATE.last_error) == (
        1,
        "RuntimeError: no compiler",
    )
    flex.clear_caches()
    assert (flex.COMPILE_STATE.failures, flex.COMPILE_STATE.last_error) == (0, None)


def test_flex_failures_from_threads_are_all_counted():
    state = CompileState()

    def work(index: int) -> None:
        for _ in range(CALLS):
            state.record_failure(f"thread {index}")

    run_threads(work)
    assert state.failures == THREADS * CALLS
    assert state.last_error is not None and state.last_error.startswith("thread ")
    assert state == CompileState(THREADS * CALLS, state.last_error), "the lock is not compared"
