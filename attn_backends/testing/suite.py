"""`NoCachePrefillConformance`: the mixin test class behind ``pytest --attn-backend NAME``.

Subclass it and set ``backend_names`` to bind it to backends; the cases are generated from each
backend's declared capabilities at collection time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from .._contract import QKVInput
from .._errors import NoBackendError
from .._params import FMHAParams
from .._platform import Platform, detect_platform, parse_platform
from .._reference import TOLERANCE, reference_attention, relative_error
from .._registry import Registry, get_registry
from .._selector import select
from .._spec import AttentionSpec
from .cases import ConformanceCase, RefusalCase, conformance_cases, refusal_cases

PAD_VALUE = 1.0e4
"""Padding rows hold this: a kernel that reads them produces a visibly wrong output."""


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


@dataclass(frozen=True, eq=False)
class PreparedInput:
    """The buffer handed to ``forward``, a pristine copy, and what must survive unchanged."""

    qkv: QKVInput
    packed: torch.Tensor
    pristine: torch.Tensor
    backing: torch.Tensor
    backing_pristine: torch.Tensor


def make_qkv(case: ConformanceCase, device: torch.device | str, seed: int) -> PreparedInput:
    """Random packed QKV for a case (values ~N(0, 1), never zeros), in the case's input form."""
    spec = case.spec
    tokens = sum(case.lengths)
    rows = tokens + case.padding_rows
    gen = torch.Generator().manual_seed(seed)
    width = spec.qkv_width
    extra = 24 if case.form == "strided" else 0
    backing = torch.randn(rows, width + 2 * extra, generator=gen, dtype=torch.float32)
    backing[tokens:] = PAD_VALUE
    backing = backing.to(device=device, dtype=spec.dtype)
    packed = backing[:, extra : extra + width] if extra else backing
    qkv: QKVInput = packed
    if case.form == "tuple-none":
        qkv = (packed, None, None)
    elif case.form == "tuple-empty":
        empty = torch.empty(0, device=device, dtype=spec.dtype)
        qkv = (packed, empty, empty)
    return PreparedInput(qkv, packed, packed.clone(), backing, backing.clone())


def run_case(
    backend: str,
    case: ConformanceCase,
    device: torch.device | str,
    registry: Registry | None = None,
    platform: Platform | None = None,
) -> float:
    """Run one case through the public API and return its relative error.

    Skips (``pytest.skip``) when the backend refuses the spec, asserting everything else: the
    output, the untouched V columns, padding rows and neighbouring columns.
    """
    spec = case.spec
    try:
        sel = select(
            spec, backend=backend, platform=platform or detect_platform(device), registry=registry
        )
    except NoBackendError as exc:
        pytest.skip(
            f"{backend} refuses {case.id}: "
            + "; ".join(str(r) for _, rs in exc.reasons for r in rs)
        )
    params = FMHAParams.from_lengths(
        case.lengths, device=device, padded_rows=sum(case.lengths) + case.padding_rows
    )
    data = make_qkv(case, device, _seed(f"{backend}/{case.id}"))
    plan = sel.backend.prepare(params)
    if case.expect_fused is not None:
        fused = plan.preprocess == "fused"
        assert fused == case.expect_fused, (
            f"lengths up to {max(case.lengths)}: expected "
            f"{'fused RoPE' if case.expect_fused else 'the separate pass'}, plan has "
            f"preprocess={plan.preprocess}"
        )
    out = sel.backend.forward(data.qkv, plan)
    tokens = params.token_q_num
    assert tuple(out.shape) == (tokens, spec.q_width)
    assert out.dtype == spec.output_dtype
    assert out.device == data.packed.device
    ref = reference_attention(data.pristine, spec, params)
    err = relative_error(out, ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g} >= {TOLERANCE[spec.dtype]}"
    _check_untouched(spec, data, tokens)
    if plan.preprocess == "fused":
        assert torch.equal(data.packed, data.pristine), "fused RoPE must leave the input as it was"
    return err


def _check_untouched(spec: AttentionSpec, data: PreparedInput, tokens: int) -> None:
    v_cols = slice(spec.q_width + spec.kv_width, spec.qkv_width)
    assert torch.equal(data.packed[:, v_cols], data.pristine[:, v_cols]), "V columns were written"
    assert torch.equal(data.packed[tokens:], data.pristine[tokens:]), "padding rows were written"
    if spec.rope is None and not spec.use_logn_attn:
        assert torch.equal(data.packed, data.pristine), "input changed without RoPE/logn"
    width = data.backing.shape[1]
    extra = (width - spec.qkv_width) // 2
    if extra:
        outside = torch.cat((data.backing[:, :extra], data.backing[:, -extra:]), dim=1)
        before = torch.cat(
            (data.backing_pristine[:, :extra], data.backing_pristine[:, -extra:]), dim=1
        )
        assert torch.equal(outside, before), "columns outside the QKV slice were written"


class NoCachePrefillConformance:
    """Mixin test class: set ``backend_names`` (or pass ``--attn-backend``) and collect."""

    backend_names: ClassVar[Sequence[str]] = ()
    device: ClassVar[str | None] = None
    """Device to run on; ``None`` means ``--attn-device`` or the accelerator when present."""
    platform: ClassVar[Platform | None] = None
    """Platform to select for; ``None`` means the one detected for the device. Set it to run a
    backend through fakes (e.g. a ROCm backend over a fake library on CPU tensors)."""

    @classmethod
    def _names(cls, config: pytest.Config) -> list[str]:
        names = list(cls.backend_names)
        if not names:
            names = list(config.getoption("attn_backend", default=None) or [])
        return names

    @classmethod
    def _device(cls, config: pytest.Config) -> str:
        chosen = cls.device or config.getoption("attn_device", default=None)
        if chosen:
            return str(chosen)
        return "cuda" if torch.cuda.is_available() else "cpu"

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        config = metafunc.config
        registry = get_registry()
        device = self._device(config)
        platform = self.platform or detect_platform(device)
        params: list[object] = []
        ids: list[str] = []
        for name in self._names(config):
            entry = registry.get(name)
            if entry is None:
                known = ", ".join(e.backend.name for e in registry.entries())
                raise pytest.UsageError(
                    f"--attn-backend {name!r} is not registered; known: {known}"
                )
            caps = entry.backend.capabilities
            if metafunc.function.__name__ == "test_numeric":
                for case in conformance_cases(caps):
                    params.append((name, case, device, platform))
                    ids.append(f"{name}-{case.id}")
            elif metafunc.function.__name__ == "test_refuses_undeclared":
                for refusal in refusal_cases(caps, platform):
                    params.append((name, refusal, platform))
                    ids.append(f"{name}-{refusal.id}")
            elif metafunc.function.__name__ == "test_refuses_kv_cache":
                params.append((name, caps))
                ids.append(name)
        if "conformance_case" in metafunc.fixturenames:
            metafunc.parametrize("conformance_case", params, ids=ids)

    def test_numeric(self, conformance_case: tuple[str, ConformanceCase, str, Platform]) -> None:
        name, case, device, platform = conformance_case
        run_case(name, case, device, platform=platform)

    def test_refuses_undeclared(self, conformance_case: tuple[str, RefusalCase, Platform]) -> None:
        name, refusal, platform = conformance_case
        entry = get_registry().get(name)
        assert entry is not None
        reasons = entry.backend.supports(refusal.spec, refusal.platform or platform)
        codes = {r.code for r in reasons}
        assert refusal.code in codes, f"expected a {refusal.code.value} reason, got {reasons}"
        assert all(r.message for r in reasons)

    def test_refuses_kv_cache(self, conformance_case: tuple[str, object]) -> None:
        name, _ = conformance_case
        spec = AttentionSpec(
            num_heads=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, causal=True
        )
        with pytest.raises(NoBackendError, match="no-KV-cache prefill only") as info:
            select(spec, backend=name, has_kv_cache=True, platform=parse_platform("cpu"))
        codes = {r.code.value for _, rs in info.value.reasons for r in rs}
        assert "kv_cache_present" in codes
