"""flashinfer's kernel called with the argument list its plan fixed (`_flashinfer_direct`), on
the fake flashinfer, whose ``ragged_run`` reads its arguments where 0.7.x's ``run`` puts them.

The direct call runs only where its release was read and its first call equalled ``run`` bit
for bit; anything else (another release, logging on, an argument list that differs) keeps
``run``, with the same numbers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from attn_backends_builtin import _flashinfer_direct as flashinfer_direct
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin._flashinfer_direct import READ_RELEASES
from attn_backends_builtin.flashinfer import FlashinferBackend, FlashinferRopeBackend, RaggedPlan

import attn_backends as ab
from attn_backends.plugin import PrefillBackend
from attn_backends.testing import NoCachePrefillConformance
from tests.fakes.fake_flashinfer import FakeFlashinfer, install
from tests.test_nvidia_backends import SM90, check_numbers, packed_input, spec_of

RUN = "BatchPrefillWithRaggedKVCacheWrapper.run"
RAGGED = "ragged_run"
LENGTHS = (5, 0, 17, 1, 9)


@pytest.fixture(autouse=True)
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    monkeypatch.delenv("FLASHINFER_LOGLEVEL", raising=False)
    monkeypatch.delenv("FLASHINFER_TRACE_DUMP", raising=False)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashinfer:
    return install(monkeypatch, internals=True)


def _layers(
    backend: PrefillBackend, spec: ab.AttentionSpec, lengths: tuple[int, ...], layers: int
) -> None:
    """One batch's plan run by ``layers`` layers on fresh inputs, each against float64."""
    params, _ = packed_input(spec, lengths)
    plan = backend.prepare(params)
    for seed in range(layers):
        _, qkv = packed_input(spec, lengths, seed=seed + 1)
        check_numbers(backend.forward(qkv.clone(), plan), qkv, spec, params)


@pytest.mark.parametrize(
    "spec",
    [
        spec_of(torch.bfloat16, causal=True),
        spec_of(torch.float16, heads=(4, 4), dim=64, causal=False, softmax_scale=0.2),
        spec_of(
            torch.bfloat16, heads=(4, 2), dim=64, causal=True, window=ab.SlidingWindow.causal(3)
        ),
        spec_of(torch.bfloat16, heads=(4, 2), dim=64, causal=False, logit_softcap=20.0),
    ],
    ids=["gqa-causal", "mha-bidirectional-scale", "window", "softcap"],
)
def test_later_layers_call_the_kernel_directly_after_one_proof(fake, spec):
    backend = FlashinferBackend.bind(spec, SM90)
    _layers(backend, spec, LENGTHS, layers=3)
    # the first layer ran run and proved the direct call on its input; the others ran it alone
    assert len(fake.named(RUN)) == 1
    assert len(fake.named(RAGGED)) == 3
    # a later batch of the same kernel module is proved already: no run at all
    _layers(backend, spec, (4, 12), layers=2)
    assert len(fake.named(RUN)) == 1 and len(fake.named(RAGGED)) == 5
    # single token, and one sequence
    _layers(backend, spec, (1,), layers=1)
    _layers(backend, spec, (23,), layers=1)
    assert len(fake.named(RUN)) == 1


def test_the_direct_call_passes_the_plans_own_state(fake):
    spec = spec_of(torch.bfloat16, heads=(8, 2), dim=128, causal=True, softmax_scale=0.3)
    backend = FlashinferBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS)
    plan = backend.prepare(params)
    backend.forward(qkv.clone(), plan)
    backend.forward(qkv.clone(), plan)
    args = fake.named(RAGGED)[-1].args["args"]
    assert isinstance(plan.kernel, RaggedPlan)
    wrapper = plan.kernel.wrapper
    assert args[2] is wrapper._plan_info and args[6] is wrapper._qo_indptr_buf
    assert args[10] == 1 and args[12] == -1 and args[13] is True  # causal, no window, PDL
    assert args[21] == 0.3 and args[20] == 0.0  # the spec's scale, no soft cap
    out = args[8]
    assert out.dtype == torch.bfloat16 and out.shape == (32, 8, 128) and out.is_contiguous()


def test_fused_rope_reaches_the_direct_call(fake):
    spec = spec_of(rope=ab.RopeSpec(1e6))
    backend = FlashinferRopeBackend.bind(spec, SM90)
    _layers(backend, spec, (6, 3, 11), layers=2)  # short: fa2 with RoPE fused
    assert len(fake.named(RAGGED)) == 2
    assert fake.named(RAGGED)[-1].args["args"][23] == 1e6


def test_an_argument_list_that_differs_keeps_run_with_a_warning(fake, caplog):
    fake.ragged_order = "swapped"  # a release whose list puts the scale elsewhere
    spec = spec_of(torch.bfloat16, heads=(4, 2), dim=64, causal=True, softmax_scale=0.25)
    backend = FlashinferBackend.bind(spec, SM90)
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        _layers(backend, spec, LENGTHS, layers=3)
    assert len(fake.named(RAGGED)) == 1, "tried once, on the first layer"
    assert len(fake.named(RUN)) == 3
    assert any("differs from run's" in r.getMessage() for r in caplog.records)
    _layers(backend, spec, (4, 12), layers=2)  # the verdict holds for later batches
    assert len(fake.named(RAGGED)) == 1 and len(fake.named(RUN)) == 5


def test_a_failing_direct_call_keeps_run(fake, monkeypatch, caplog):
    monkeypatch.setattr("tests.fakes.fake_flashinfer.RAGGED_RUN_ARITY", 28)  # another arity
    spec = spec_of(torch.float16, heads=(4, 4), dim=64, causal=False)
    backend = FlashinferBackend.bind(spec, SM90)
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        _layers(backend, spec, LENGTHS, layers=2)
    assert len(fake.named(RUN)) == 2
    assert any("raised TypeError" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "setting",
    [
        ("version", "0.7.5"),
        ("env", "FLASHINFER_LOGLEVEL", "1"),
        ("env", "FLASHINFER_TRACE_DUMP", "1"),
        ("internals", False),
    ],
    ids=["unread-release", "api-logging", "trace-dump", "no-private-state"],
)
def test_run_stays_where_the_direct_call_is_not_known(monkeypatch, caplog, setting):
    fake = install(monkeypatch, internals=setting[0] != "internals")
    if setting[0] == "version":
        monkeypatch.setattr(sys.modules["flashinfer"], "__version__", setting[1])
    elif setting[0] == "env":
        monkeypatch.setenv(setting[1], setting[2])
    spec = spec_of(torch.bfloat16, causal=True)
    backend = FlashinferBackend.bind(spec, SM90)
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        _layers(backend, spec, LENGTHS, layers=2)
        _layers(backend, spec, (4, 12), layers=1)
    assert len(fake.named(RUN)) == 3 and not fake.named(RAGGED)
    said = [r.getMessage() for r in caplog.records if "not the direct ragged_run" in r.getMessage()]
    assert len(said) == 1, "why run stays is said once per process"
    expected = {"version": "0.7.5", "env": setting[1], "internals": "lacks"}[setting[0]]
    assert expected in said[0]


class TestConformanceWithTheDirectCall(NoCachePrefillConformance):
    """The shipped suite through both flashinfer backends, the direct call in use."""

    backend_names = ("flashinfer", "flashinfer-rope")
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = SM90

    @pytest.fixture(autouse=True)
    def _fake_flashinfer(self, monkeypatch):
        install(monkeypatch, internals=True)


def test_a_call_that_may_not_read_the_device_leaves_the_proof_to_a_later_one(fake, monkeypatch):
    """Under CUDA-graph capture or torch's sync debug mode the comparison would read the
    device: such a call runs ``run`` alone, and the next call that may read proves the
    direct call."""
    readable = iter([False, False, True])
    monkeypatch.setattr(flashinfer_direct, "_may_read", lambda device: next(readable))
    spec = spec_of(torch.bfloat16, causal=True)
    backend = FlashinferBackend.bind(spec, SM90)
    _layers(backend, spec, LENGTHS, layers=4)
    # two layers ran run alone, the third ran run and proved the direct call, the fourth ran
    # it alone
    assert len(fake.named(RUN)) == 3
    assert len(fake.named(RAGGED)) == 2


# The installed flashinfer, where there is one: its release and its run's list. Read from the
# package's files, not imported (importing it needs its CUDA loader).

HEAD = [
    "self._float_workspace_buffer",
    "self._int_workspace_buffer",
    "self._plan_info",
    "q",
    "k",
    "v",
    "self._qo_indptr_buf",
    "self._kv_indptr_buf",
    "out",
    "lse",
    "mask_mode",
    "TensorLayout[self._kv_layout].value",
    "window_left",
    "enable_pdl",
]
TAIL = [
    "self._custom_mask_buf",
    "self._mask_indptr_buf",
    "_get_cache_alibi_slopes_buf(q.shape[1], self.device)",
    "self._prefix_len_ptr",
    "self._token_pos_in_items_ptr",
    "self._max_item_len_ptr",
    "logits_soft_cap",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "self._token_pos_in_items_len",
    "k_sf",
    "v_sf",
]
"""``ragged_run``'s arguments as the read releases' ``run`` writes them (`_built` follows it)."""


def ragged_run_lists(source: str) -> tuple[list[str], list[str]]:
    """The two lists ``BatchPrefillWithRaggedKVCacheWrapper.run`` builds for ``ragged_run``
    without a JIT variant, as source expressions."""

    start = source.index("class BatchPrefillWithRaggedKVCacheWrapper")
    run = source[start:]
    head = re.search(r"run_args = \[(.*?)\n\s*\]", run, re.S)
    tail = re.search(r"run_args \+= \[(.*?)\n\s*\]", run, re.S)
    assert head is not None and tail is not None, "run builds no ragged_run list here"

    def items(text: str) -> list[str]:  # one per line (an item may hold a comma)
        return [line.strip().rstrip(",") for line in text.splitlines() if line.strip()]

    return items(head.group(1)), items(tail.group(1))


def test_the_installed_flashinfer_builds_the_list_the_direct_call_builds():
    try:
        release = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flashinfer is not installed")
    found = importlib.util.find_spec("flashinfer")
    assert found is not None and found.origin is not None
    source = (Path(found.origin).parent / "prefill.py").read_text()
    head, tail = ragged_run_lists(source)
    assert (head, tail) == (HEAD, TAIL), (
        f"flashinfer {release}'s run passes ragged_run another list: read it and change "
        "_flashinfer_direct._built (the per-module proof keeps run meanwhile)"
    )
    assert release in READ_RELEASES, (
        f"flashinfer {release} builds the list the direct call builds; add it to READ_RELEASES "
        "once its GPU test passes (plans call run meanwhile)"
    )
