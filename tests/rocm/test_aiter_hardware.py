"""``aiter-asm`` and ``aiter-nonasm`` on a real ROCm GPU with amd-aiter installed.

Not yet run on ROCm hardware. Skipped at collection elsewhere (root conftest.py, ``rocm``
marker). Run on an MI300/MI350 host:

    python -m pytest -q tests/rocm -rs

The first call of each aiter kernel variant compiles it (minutes); later runs reuse the build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from attn_backends_builtin import _aiter_common

import attn_backends as ab
from attn_backends.deploy import clear_selection_cache, get_registry
from attn_backends.reference import TOLERANCE, relative_error
from attn_backends.testing import NoCachePrefillConformance

pytestmark = pytest.mark.rocm

NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
LENGTHS = (5, 17, 1, 300, 64)


class TestAiterConformanceOnRocm(NoCachePrefillConformance):
    """The shipped suite on this GPU; a backend that refuses this arch skips with its reasons."""

    backend_names = ("aiter-asm", "aiter-nonasm")


def _platform() -> ab.Platform:
    return ab.detect_platform("cuda")


def _run(
    backend: str,
    spec: ab.AttentionSpec,
    scales: tuple[float, float, float] | None = None,
    *,
    host_scales: bool = False,
) -> float:
    """One forward on the GPU; returns the relative error against the float64 reference."""
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cuda", padded_rows=sum(LENGTHS) + 5)
    gen = torch.Generator().manual_seed(7)
    real = torch.randn(params.rows, spec.qkv_width, generator=gen)
    fp8_scales = None
    if scales is not None:
        real[:, : spec.q_width] /= scales[0]
        real[:, spec.q_width : spec.q_width + spec.kv_width] /= scales[1]
        real[:, spec.q_width + spec.kv_width :] /= scales[2]
        fp8_scales = (
            ab.Fp8Scales(*scales)
            if host_scales
            else ab.Fp8Scales(*(torch.tensor(s, device="cuda") for s in scales))
        )
    packed = real.to(device="cuda", dtype=spec.dtype)
    pristine = packed.clone()
    selection = ab.select(spec, backend=backend, platform=_platform())
    plan = selection.backend.prepare(params)
    out = selection.backend.forward(packed, plan, fp8_scales=fp8_scales)
    torch.cuda.synchronize()
    assert out.shape == (params.token_q_num, spec.q_width) and out.dtype == spec.output_dtype
    ref = ab.reference_attention(pristine, spec, params, fp8_scales=fp8_scales)
    return relative_error(out, ref)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("host_scales", [False, True], ids=["tensor-scales", "float-scales"])
def test_fp8_per_tensor_matches_reference(causal, host_scales):
    arch = _platform().arch or ""
    if arch not in NATIVE_FP8:
        pytest.skip(f"aiter has no FP8 attention kernels for {arch}")
    dtype = NATIVE_FP8[arch]
    spec = ab.AttentionSpec(16, 4, 128, dtype, causal=causal)
    err = _run("aiter-nonasm", spec, scales=(0.05, 0.2, 0.5), host_scales=host_scales)
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("aiter-asm", torch.bfloat16), ("aiter-nonasm", torch.float16), ("aiter-nonasm", None)],
)
def test_the_installed_aiter_is_bound_by_its_own_parameter_lists(backend, dtype):
    """What prepare read from this aiter: its version, and the ops' lists from their source."""
    arch = _platform().arch or ""
    dtype = dtype if dtype is not None else NATIVE_FP8.get(arch)
    if dtype is None:
        pytest.skip(f"aiter has no FP8 attention kernels for {arch}")
    spec = ab.AttentionSpec(16, 4, 128, dtype, causal=True)
    selection = ab.select(spec, backend=backend, platform=_platform())
    plan = selection.backend.prepare(ab.FMHAParams.from_lengths(LENGTHS, device="cuda"))
    kernel = plan.kernel
    assert isinstance(kernel, _aiter_common.AiterPlan)
    binding = kernel.binding
    assert binding.aiter_version != "unknown"
    ops = ("mha_varlen_fwd", "fmha_v3_varlen_fwd")
    assert binding.read_from == (
        "aiter/ops/mha.py" if binding.entry in ops else "inspect.signature"
    )
    details = selection.backend.describe(_platform())
    assert binding.aiter_version in details["aiter_signature"]


@pytest.mark.parametrize(
    ("backend", "dtype", "entry"),
    [
        ("aiter-asm", torch.bfloat16, "fmha_v3_varlen_fwd"),
        ("aiter-nonasm", torch.bfloat16, "mha_varlen_fwd"),
        ("aiter-nonasm", torch.float16, "mha_varlen_fwd"),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_each_backend_launches_its_own_aiter_entry(monkeypatch, backend, dtype, entry, causal):
    """The real aiter function is wrapped: exactly the declared entry runs, and is right."""
    import aiter  # only here: importing aiter needs ROCm

    spec = ab.AttentionSpec(16, 4, 128, dtype, causal=causal)
    entry_of = get_registry().get(backend)
    assert entry_of is not None
    reasons = entry_of.backend.supports(spec, _platform())
    if reasons:
        pytest.skip(f"{backend} refuses this GPU: " + "; ".join(str(r) for r in reasons))
    real: Callable[..., Any] = getattr(aiter, entry)
    calls: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(entry)
        return real(*args, **kwargs)

    monkeypatch.setattr(aiter, entry, spy)
    clear_selection_cache()
    err = _run(backend, spec)
    assert calls == [entry]
    assert err < TOLERANCE[dtype]
