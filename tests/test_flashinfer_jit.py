"""flashinfer's JIT modules as warm-up sees them: cache state asked of flashinfer's own build
spec, the cost estimate per kind, the cache location, and "unknown" (never "built") when
flashinfer cannot answer."""

from __future__ import annotations

import pytest
import torch
from attn_backends_builtin import _flashinfer_jit as jit
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin import trt as trt_plugin
from attn_backends_builtin._flashinfer_common import JitModule
from attn_backends_builtin.flashinfer import FlashinferBackend, FlashinferRopeBackend
from attn_backends_builtin.trt import TrtBackend

import attn_backends as ab
import attn_backends.plugin as abp

FA3 = JitModule("fa3", "bfloat16", 128)
FA2_ROPE = JitModule("fa2", "float16", 64, rope=True)


class _Spec:
    def __init__(self, compiled: bool) -> None:
        self.is_compiled = compiled


def test_the_prefill_key_is_flashinfers_module_key():
    assert jit.prefill_key(FA3) == (
        "fa3",
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        torch.int32,
        128,
        128,
        0,
        False,
        False,
        False,
    )
    assert jit.prefill_key(FA2_ROPE)[0] == "fa2" and jit.prefill_key(FA2_ROPE)[7] == 1


@pytest.mark.parametrize("compiled", [True, False])
def test_a_module_reports_flashinfers_cache_state_cost_and_location(monkeypatch, compiled):
    monkeypatch.setattr(jit, "jit_spec", lambda module: _Spec(compiled))
    monkeypatch.setattr(jit, "cache_dir", lambda: "/jit/cached_ops")
    module = jit.kernel_module(FA3)
    assert module == abp.KernelModule(
        "flashinfer fa3 bfloat16 d128 posenc=NONE", compiled, 720.0, 95.0, "/jit/cached_ops"
    )


def test_without_flashinfers_jit_api_the_state_is_unknown(monkeypatch):
    def missing(module):
        raise ModuleNotFoundError("No module named 'flashinfer.jit'")

    monkeypatch.setattr(jit, "jit_spec", missing)
    monkeypatch.setattr(jit, "cache_dir", missing)
    module = jit.kernel_module(FA2_ROPE)
    assert module.cached is None and module.cache_dir is None
    assert module.build_cpu_seconds == jit.BUILD_CPU_SECONDS["fa2"]


def test_backends_list_the_modules_of_every_per_batch_path(monkeypatch):
    monkeypatch.setattr(jit, "jit_spec", lambda module: _Spec(False))
    monkeypatch.setattr(jit, "cache_dir", lambda: "/jit")
    for plugin in (flashinfer_plugin, trt_plugin):
        monkeypatch.setattr(plugin, "device_sm", lambda device: 90)
    short = ab.AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6))
    cuda = torch.device("cuda")
    names = [m.name for m in FlashinferRopeBackend.kernel_modules(short, cuda)]
    assert names == [
        "flashinfer fa2 bfloat16 d128 posenc=ROPE_LLAMA",
        "flashinfer fa3 bfloat16 d128 posenc=NONE",
    ], "fused RoPE up to its length, the separate pass past it"
    assert [m.name for m in FlashinferBackend.kernel_modules(short, cuda)] == [
        "flashinfer fa3 bfloat16 d128 posenc=NONE"
    ]
    assert [m.name for m in TrtBackend.kernel_modules(short, cuda)] == [
        "flashinfer fmha_v2 PACKED_QKV bfloat16"
    ]


def test_off_cuda_there_is_nothing_to_build():
    spec = ab.AttentionSpec(4, 4, 64, torch.bfloat16, causal=False)
    assert FlashinferBackend.kernel_modules(spec, torch.device("cpu")) == ()
    assert abp.PrefillBackend.kernel_modules(spec, torch.device("cpu")) == ()


def test_a_devices_capability_is_asked_of_the_driver_once_per_index(monkeypatch):
    """`device_sm` runs for every batch's plan: the capability is read once per device index
    (the current device's for a device without one) and is None off CUDA."""
    from attn_backends_builtin import _flashinfer_common as common

    asked: list[int] = []

    def capability(index: int) -> tuple[int, int]:
        asked.append(index)
        return {0: (9, 0), 1: (8, 0)}[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    common._index_sm.cache_clear()
    try:
        assert common.device_sm(torch.device("cuda", 0)) == 90
        assert common.device_sm(torch.device("cuda")) == 80, "the current device's"
        assert common.device_sm(torch.device("cuda", 0)) == 90
        assert common.device_sm(torch.device("cuda", 1)) == 80
        assert common.device_sm(torch.device("cpu")) is None
        assert asked == [0, 1], "each index asked once"
    finally:
        common._index_sm.cache_clear()  # no fake capability outlives the test
