"""`NoCachePrefillConformance`: the mixin test class behind ``pytest --attn-backend NAME``.

Subclass it and set ``backend_names`` to bind it to backends; the cases are generated from each
backend's declared capabilities at collection time.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from .._backend._protocol import CudaGraphPrefill
from .._backend._reference import TOLERANCE, reference_attention, relative_error
from .._path._contract import QKVInput
from .._path._graph import GraphBucket
from .._path._preprocess import is_separate
from .._path._untouched import unexpected_writes
from .._select._registry import Registry, get_registry
from .._select._selector import Selection, SelectRequest, select, select_request
from .._values._errors import NoBackendError
from .._values._params import FMHAParams
from .._values._platform import Platform, detect_platform, parse_platform
from .._values._reasons import ReasonCode
from .._values._spec import AttentionSpec
from .cases import (
    ConformanceCase,
    RefusalCase,
    base_case,
    conformance_cases,
    graph_case,
    refusal_cases,
)
from .graphs import capture_graph

PAD_VALUE = 1.0e4
"""Padding rows hold this: a kernel that reads them produces a visibly wrong output."""
INTERLEAVED_LENGTHS = (7, 1, 19)
"""The second batch of the interleaved-plans case: other lengths, so plans cannot agree."""
GRAPH_BATCHES = ((5, 17, 1, 32), (40,), (3, 0, 9, 2, 11, 8), (96,))
"""Batches replayed through one bucket (96 rows, 6 sequences): varlen, one sequence, the most
sequences with an empty one, and a batch that fills every row."""


def unregistered_message(name: str, registry: Registry) -> str:
    """Why ``--attn-backend NAME`` names no registered backend: the plugins that failed to load,
    with their errors (a backend whose plugin did not import is the usual cause), and the
    names that are registered."""
    known = ", ".join(e.name for e in registry.entries()) or "none"
    failed = [r for r in registry.records() if r.status == "failed"]
    text = f"--attn-backend {name!r} is not registered"
    if failed:
        text += "; plugins that failed to load: " + "; ".join(
            f"{r.name} ({r.error})" for r in failed
        )
    return f"{text}; registered: {known} (`attn-backends list` shows every plugin)"


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
    sinks: torch.Tensor | None = None
    """The layer's attention-sink logits, float32 ``[Hq]``, when the spec has sinks."""

    def current(self) -> torch.Tensor:
        """The packed rows as they are now: the buffer itself, or the separate tensors side
        by side (what they hold after ``forward``; batch-major ones as rows)."""
        if isinstance(self.qkv, tuple) and self.qkv[1] is not None and self.qkv[1].numel():
            return torch.cat([_as_rows(t) for t in self.qkv if t is not None], dim=1)
        return self.packed


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A separate input tensor as ``[rows, heads * D]``: batch-major ``[n, heads, L, D]``
    sequence by sequence, any other flattened past its rows."""
    if t.dim() == 4:
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], -1)
    return t.flatten(1)


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
    elif case.form in ("separate", "separate-3d"):
        # Three tensors of their own, as separate projections produce them.
        bounds = (0, spec.q_width, spec.q_width + spec.kv_width, spec.qkv_width)
        parts = [packed[:, lo:hi].clone() for lo, hi in itertools.pairwise(bounds)]
        if case.form == "separate-3d":
            heads = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
            parts = [
                t.view(t.shape[0], h, spec.head_dim) for t, h in zip(parts, heads, strict=True)
            ]
        qkv = (parts[0], parts[1], parts[2])
    elif case.form in ("batch-major", "batch-major-dense"):
        # [n, heads, L, D] each for n sequences of L tokens, as transformers hands them: views
        # of the packed rows, or dense copies whose rows no strided view reaches
        count, length = len(case.lengths), case.lengths[0]
        bounds = (0, spec.q_width, spec.q_width + spec.kv_width, spec.qkv_width)
        heads = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        grids = [
            packed[:tokens, lo:hi].view(count, length, h, spec.head_dim).transpose(1, 2)
            for (lo, hi), h in zip(itertools.pairwise(bounds), heads, strict=True)
        ]
        if case.form == "batch-major-dense":
            grids = [g.contiguous() for g in grids]
        qkv = (grids[0], grids[1], grids[2])
    sinks = None
    if spec.attention_sinks:
        # Around the scores' own scale (lse of a few keys is ~1..4), so a sink takes a share
        # from a fraction to most of the weight, depending on the head and the sequence.
        sinks = (torch.randn(spec.num_heads, generator=gen) * 2.0 + 1.0).to(device)
    return PreparedInput(qkv, packed, packed.clone(), backing, backing.clone(), sinks)


def batch_of(
    case: ConformanceCase, device: torch.device | str, seed: int
) -> tuple[FMHAParams, PreparedInput]:
    """The case's batch metadata (its padding rows included) and its random input."""
    rows = sum(case.lengths) + case.padding_rows
    params = FMHAParams.from_lengths(case.lengths, device=device, padded_rows=rows)
    return params, make_qkv(case, device, seed)


def run_case(
    backend: str,
    case: ConformanceCase,
    device: torch.device | str,
    registry: Registry | None = None,
    platform: Platform | None = None,
) -> float:
    """Run one case through the public API and return its relative error.

    A case is generated from what the backend declares, so a refusal fails the test, unless
    the platform itself rules the backend out (another device kind, arch or a missing
    library: `selected_or_skip`). Asserts the output, and that nothing but the in-place
    pass's own columns was written (V, padding rows, neighbouring columns).
    """
    spec = case.spec
    sel = selected_or_skip(backend, spec, case.id, device, registry, platform)
    params, data = batch_of(case, device, _seed(f"{backend}/{case.id}"))
    plan = sel.backend.prepare(params)
    if case.expect_fused is not None:
        fused = plan.preprocess == "fused"
        assert fused == case.expect_fused, (
            f"lengths up to {max(case.lengths)}: expected "
            f"{'fused RoPE' if case.expect_fused else 'the separate pass'}, plan has "
            f"preprocess={plan.preprocess}"
        )
    out = sel.backend.forward(data.qkv, plan, sinks=data.sinks)
    tokens = params.token_q_num
    assert tuple(out.shape) == (tokens, spec.q_width)
    assert out.dtype == spec.output_dtype
    assert out.device == data.packed.device
    ref = reference_attention(data.pristine, spec, params, sinks=data.sinks)
    err = relative_error(out, ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g} >= {TOLERANCE[spec.dtype]}"
    _check_untouched(spec, data, tokens, is_separate(plan.preprocess))
    return err


_PLATFORM_CODES = frozenset(
    {ReasonCode.PLATFORM, ReasonCode.ARCH, ReasonCode.LIBRARY_MISSING, ReasonCode.DISABLED}
)


def selected_or_skip(
    backend: str,
    spec: AttentionSpec,
    case_id: str,
    device: torch.device | str,
    registry: Registry | None = None,
    platform: Platform | None = None,
    *,
    cuda_graph: bool = False,
) -> Selection:
    """`select` the backend for a generated case: skip when only the platform rules it out,
    fail when it refuses a spec its capabilities declare (a `supports()` regression)."""
    request = SelectRequest(
        spec,
        backend=backend,
        platform=platform or detect_platform(device),
        cuda_graph=cuda_graph,
    )
    return selected_or_skip_request(request, case_id, registry)


def selected_or_skip_request(
    request: SelectRequest, case_id: str, registry: Registry | None = None
) -> Selection:
    """`selected_or_skip` for a whole `SelectRequest` (its ``backend`` names the backend)."""
    backend = request.backend
    try:
        return select_request(request, registry=registry)
    except NoBackendError as exc:
        reasons = [r for _, rs in exc.reasons for r in rs]
        text = "; ".join(str(r) for r in reasons)
        if reasons and all(r.code in _PLATFORM_CODES for r in reasons):
            pytest.skip(f"{backend} cannot run here ({case_id}): {text}")
        pytest.fail(f"{backend} refuses {case_id}, which its capabilities declare: {text}")


def _check_untouched(
    spec: AttentionSpec, data: PreparedInput, tokens: int, rotates_in_place: bool
) -> None:
    written = unexpected_writes(data.pristine, data.current(), spec, tokens, rotates_in_place)
    assert written is None, written
    width = data.backing.shape[1]
    extra = (width - spec.qkv_width) // 2
    if extra:
        outside = torch.cat((data.backing[:, :extra], data.backing[:, -extra:]), dim=1)
        before = torch.cat(
            (data.backing_pristine[:, :extra], data.backing_pristine[:, -extra:]), dim=1
        )
        assert torch.equal(outside, before), "columns outside the QKV slice were written"


def run_interleaved(
    backend: str,
    case: ConformanceCase,
    device: torch.device | str,
    registry: Registry | None = None,
    platform: Platform | None = None,
) -> None:
    """Two plans for different batches alive at once, from two callers with the same spec,
    forwards interleaved: each matches the reference (a plan is a value)."""
    spec = case.spec
    first = selected_or_skip(backend, spec, case.id, device, registry, platform).backend
    second = selected_or_skip(backend, spec, case.id, device, registry, platform).backend
    batches = [(case.lengths, 0), (INTERLEAVED_LENGTHS, 2)]
    runs = []
    for caller, (lengths, pad) in zip((first, second), batches, strict=True):
        params, data = batch_of(replace(case, lengths=lengths, padding_rows=pad), device, pad)
        runs.append((caller.prepare(params), params, data))
    for i in (0, 1, 1, 0, 0, 1):
        plan, params, data = runs[i]
        caller = (first, second)[i]
        qkv = data.pristine.clone()
        out = caller.forward(qkv, plan)
        err = relative_error(out, reference_attention(data.pristine, spec, params))
        assert err < TOLERANCE[spec.dtype], (
            f"plan {i} after the other was prepared and run: relative error {err:.3g}"
        )


def run_graph_mode(
    backend: str,
    case: ConformanceCase,
    device: torch.device | str,
    registry: Registry | None = None,
    platform: Platform | None = None,
) -> None:
    """Graph mode for a backend that declares it: one bucket plan re-planned for batches of
    different shapes; the valid rows match the reference, padding rows are never written. On
    CUDA the forward is also captured once and replayed for each batch, bit for bit equal to
    the same plan's eager forward."""
    spec = case.spec
    sel = selected_or_skip(backend, spec, case.id, device, registry, platform, cuda_graph=True)
    bucket = GraphBucket(max_tokens=96, max_batch=6)
    dev = torch.device(device)
    backend_impl = sel.backend
    assert isinstance(backend_impl, CudaGraphPrefill), (
        f"{backend} declares cuda_graph but has no prepare_graph()"
    )
    plan = backend_impl.prepare_graph(bucket, device=dev)
    static = torch.full((bucket.max_tokens, spec.qkv_width), PAD_VALUE, device=dev)
    static = static.to(spec.dtype)
    graph = None
    for n, lengths in enumerate(GRAPH_BATCHES):
        pad = bucket.max_tokens - sum(lengths)
        params, data = batch_of(replace(case, lengths=lengths, padding_rows=pad), dev, n)
        plan.update(params)
        static.copy_(data.pristine)
        eager = backend_impl.forward(static, plan).clone()
        tokens = params.token_q_num
        assert eager.shape == (bucket.max_tokens, spec.q_width)
        err = relative_error(eager[:tokens], reference_attention(data.pristine, spec, params))
        assert err < TOLERANCE[spec.dtype], f"graph plan, batch {lengths}: relative error {err:.3g}"
        written = unexpected_writes(
            data.pristine, static, spec, tokens, is_separate(plan.preprocess)
        )
        assert written is None, written
        if dev.type != "cuda":
            continue
        if graph is None:
            graph = capture_graph(lambda: backend_impl.forward(static, plan), dev)
        static.copy_(data.pristine)
        graph.replay()
        torch.cuda.synchronize(dev)
        assert torch.equal(graph.output[:tokens], eager[:tokens]), (
            f"replay differs from eager for batch {lengths}"
        )


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
                raise pytest.UsageError(unregistered_message(name, registry))
            caps = entry.capabilities
            if metafunc.function.__name__ == "test_numeric":
                for case in conformance_cases(caps):
                    params.append((name, case, device, platform))
                    ids.append(f"{name}-{case.id}")
            elif metafunc.function.__name__ == "test_refuses_undeclared":
                for refusal in refusal_cases(caps, platform):
                    params.append((name, refusal, platform))
                    ids.append(f"{name}-{refusal.id}")
            elif metafunc.function.__name__ == "test_interleaved_plans":
                base = base_case(caps)
                if base is not None:
                    params.append((name, base, device, platform))
                    ids.append(f"{name}-{base.id}")
            elif metafunc.function.__name__ == "test_graph_mode":
                base = graph_case(caps, torch.device(device).type)
                if base is not None and caps.cuda_graph:
                    params.append((name, base, device, platform))
                    ids.append(f"{name}-{base.id}")
            elif metafunc.function.__name__ == "test_refuses_kv_cache":
                params.append((name, caps))
                ids.append(name)
        if "conformance_case" in metafunc.fixturenames:
            metafunc.parametrize("conformance_case", params, ids=ids)

    def test_numeric(self, conformance_case: tuple[str, ConformanceCase, str, Platform]) -> None:
        name, case, device, platform = conformance_case
        run_case(name, case, device, platform=platform)

    def test_interleaved_plans(
        self, conformance_case: tuple[str, ConformanceCase, str, Platform]
    ) -> None:
        name, case, device, platform = conformance_case
        run_interleaved(name, case, device, platform=platform)

    def test_graph_mode(self, conformance_case: tuple[str, ConformanceCase, str, Platform]) -> None:
        name, case, device, platform = conformance_case
        run_graph_mode(name, case, device, platform=platform)

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
