"""`PrefillBackend`: the base that wires a kernel to the packed-QKV contract.

A backend subclass declares ``name`` and ``capabilities`` and writes two small methods:
``plan_kernel`` (per batch) and ``attend`` (per layer, on already-checked Q/K/V views). The base
runs the generic capability checks, the contract, RoPE/logn and output shaping, so a backend
cannot forget any of them. A backend that declares ``capabilities.cuda_graph`` also writes
``plan_graph_kernel`` and ``replan_graph_kernel`` for graph mode (`prepare_graph`).

A bound backend holds no per-batch state: everything a batch needs lives in its plan, so plans
prepared by any caller, in any order, never disturb each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, cast

import torch

from ._capabilities import Capabilities, check_capabilities
from ._contract import (
    AttendFn,
    BufferMemo,
    Fp8Scales,
    InputLayout,
    PrefillPlan,
    QKVInput,
    QKVViews,
    prepare_plan,
    run_forward,
)
from ._devices import indexed
from ._errors import (
    AttentionBackendError,
    BackendFailure,
    GraphModeError,
    NoBackendError,
    ParamsError,
    UnboundBackendError,
)
from ._graph import GraphBucket, GraphPlan, slot_lengths
from ._kernels import KernelModule
from ._params import FMHAParams
from ._platform import Platform
from ._preprocess import GRAPH_MODES, is_separate, platform_of, resolve_preprocess
from ._reasons import Reason, ReasonCode
from ._spec import AttentionSpec


def _named_failure(backend: str, step: str, exc: Exception) -> BackendFailure:
    """A kernel's own exception as `BackendFailure` (the original is the cause), so callers
    catch one named error; the library's own errors pass through unchanged."""
    return BackendFailure(f"backend {backend} failed in {step}(): {type(exc).__name__}: {exc}")


class PrefillBackend(ABC):
    """Base class implementing `NoCachePrefill` around a kernel."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self._spec = spec
        self._layout: InputLayout = "views" if spec is None else self.input_layout(spec)

    @property
    def spec(self) -> AttentionSpec | None:
        return self._spec

    def supports(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return check_capabilities(self.capabilities, spec, platform) + self.extra_reasons(
            spec, platform
        )

    def extra_reasons(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Backend-specific refusals beyond the declared capabilities."""
        return []

    def bind(self, spec: AttentionSpec) -> PrefillBackend:
        return type(self)(spec)

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.bound_spec()
        caps = self.capabilities
        rope = resolve_preprocess(spec, platform, caps.fused_rope)
        details = {**rope.details(), "input_layout": self.input_layout(spec)}
        if rope.mode == "fused" and caps.fused_rope_max_seqlen is not None:
            longer = resolve_preprocess(spec, platform, False)
            details["preprocess"] = (
                f"fused for batches of max_seqlen <= {caps.fused_rope_max_seqlen}, "
                f"else {longer.mode}"
            )
        return details

    def bound_spec(self) -> AttentionSpec:
        if self._spec is None:
            raise UnboundBackendError(
                f"{self.name} is not bound to a spec; use attn_backends.select(spec) or "
                "backend.bind(spec) first"
            )
        return self._spec

    def _refuse_fp8_rotation(self, spec: AttentionSpec, mode: str) -> None:
        if spec.is_fp8 and is_separate(mode) and not self.capabilities.fp8_preprocess:
            raise NoBackendError(
                f"{self.name}: RoPE/logn on FP8 input would rotate stored FP8 values in place; "
                "apply them before quantising, or use a backend that declares fp8_preprocess"
            )

    def prepare(self, params: FMHAParams) -> PrefillPlan:
        spec = self.bound_spec()
        if not isinstance(params, FMHAParams):
            raise ParamsError(f"prepare() takes FMHAParams, got {type(params).__name__}")
        fused = self.capabilities.fuses_rope(spec, params.max_seqlen_q)
        self._refuse_fp8_rotation(
            spec, resolve_preprocess(spec, platform_of(params.device), fused).mode
        )
        try:
            kernel = self.plan_kernel(spec, params, fused_rope=fused)
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "plan_kernel", exc) from exc
        return prepare_plan(self.name, spec, params, fused, kernel)

    def forward(
        self, qkv: QKVInput, plan: PrefillPlan | GraphPlan, *, fp8_scales: Fp8Scales | None = None
    ) -> torch.Tensor:
        spec = self._spec
        if spec is None:
            spec = self.bound_spec()
        # A graph plan reaches ``attend`` only for backends that declared graph mode and take
        # it (`prepare_graph` refuses the others), hence the wider callable type.
        attend = cast(AttendFn, self.attend)
        return run_forward(
            self.name, spec, qkv, plan, fp8_scales, self._layout, attend, self.accepts_rows
        )

    def accepts_rows(self, rows: torch.Tensor) -> bool:
        """Whether the kernel can read these packed rows in place (e.g. an alignment rule); if
        not, the contract hands it a dense copy. Asked once per plan and buffer signature."""
        return True

    def kernel_modules(self, spec: AttentionSpec, device: torch.device) -> tuple[KernelModule, ...]:
        """Compiled kernel modules ``spec`` loads on ``device`` (every per-batch path), for
        warm-up's estimate; empty for a backend whose kernels need no build."""
        return ()

    def input_layout(self, spec: AttentionSpec) -> InputLayout:
        """Memory layout the kernel needs; by default from ``capabilities.needs_contiguous``."""
        return "dense-tensors" if self.capabilities.needs_contiguous else "views"

    # Graph mode ---------------------------------------------------------------------------

    def graph_reasons(self, spec: AttentionSpec, device: torch.device) -> list[Reason]:
        """Why this backend cannot serve graph mode for ``spec`` on ``device`` (empty: it can)."""
        if not self.capabilities.cuda_graph:
            return [
                Reason(
                    ReasonCode.CUDA_GRAPH,
                    "does not declare graph mode (capture once per bucket, re-plan per batch)",
                    "capabilities.cuda_graph",
                    "False",
                    "True (a backend that declares graph mode)",
                )
            ]
        return []

    def prepare_graph(
        self, bucket: GraphBucket, *, device: torch.device | str | None = None
    ) -> GraphPlan:
        """A plan for every batch of ``bucket``: capture ``forward`` with it once, then
        ``plan.update(params)`` per batch and replay. Raises `GraphModeError` with the reasons
        when this backend cannot serve graph mode for its spec."""
        spec = self.bound_spec()
        if not isinstance(bucket, GraphBucket):
            raise ParamsError(f"prepare_graph() takes a GraphBucket, got {type(bucket).__name__}")
        try:
            # FMHAParams carry the indexed device their tensors landed on ("cuda:0").
            dev = indexed(device if device is not None else "cuda")
        except (RuntimeError, TypeError, AssertionError) as exc:
            raise ParamsError(f"device {device!r} cannot hold a graph plan: {exc}") from None
        fused = self.capabilities.fuses_rope(spec, bucket.seqlen_limit)
        choice = resolve_preprocess(spec, platform_of(dev), fused)
        mode = choice.mode
        reasons = self.graph_reasons(spec, dev)
        if mode not in GRAPH_MODES:
            skipped = f" ({choice.fallback})" if choice.fallback else ""
            reasons.append(
                Reason(
                    ReasonCode.CUDA_GRAPH,
                    f"the {mode} RoPE/logn pass takes the token count on the host and cannot be "
                    "replayed for another batch; graph mode needs the native kernel, fused RoPE "
                    f"or no RoPE/logn{skipped}",
                    "preprocess",
                    mode,
                    ", ".join(sorted(GRAPH_MODES)),
                )
            )
        if reasons:
            raise GraphModeError(
                f"{self.name} cannot serve graph mode here: " + "; ".join(map(str, reasons)),
                [(self.name, reasons)],
            )
        self._refuse_fp8_rotation(spec, mode)
        try:
            kernel = self.plan_graph_kernel(spec, bucket, dev, fused_rope=fused)
            self.replan_graph_kernel(spec, kernel, slot_lengths(bucket, ()))
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "plan_graph_kernel", exc) from exc
        return GraphPlan(
            backend=self.name,
            spec=spec,
            bucket=bucket,
            device=dev,
            preprocess=mode,
            kernel=kernel,
            replan=self._replan_graph,
            memo=BufferMemo(),
        )

    def _replan_graph(self, plan: GraphPlan, slots: tuple[int, ...]) -> None:
        try:
            self.replan_graph_kernel(plan.spec, plan.kernel, slots)
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "replan_graph_kernel", exc) from exc

    def plan_graph_kernel(
        self, spec: AttentionSpec, bucket: GraphBucket, device: torch.device, *, fused_rope: bool
    ) -> object:
        """Fixed device state for ``bucket`` (graph-mode backends override it)."""
        raise GraphModeError(f"{self.name} has no graph mode", [(self.name, [])])

    def replan_graph_kernel(
        self, spec: AttentionSpec, kernel: object, slots: tuple[int, ...]
    ) -> None:
        """Plan the fixed-size sequence list ``slots`` into ``kernel``'s state, in place."""
        raise GraphModeError(f"{self.name} has no graph mode", [(self.name, [])])

    # Per batch and per layer ----------------------------------------------------------------

    @abstractmethod
    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> object:
        """Per-batch kernel planning; ``fused_rope`` says the kernel must apply RoPE itself.

        What it returns is the plan's own state: it must not be shared with other plans."""

    @abstractmethod
    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        """Attention on checked views; returns ``[tokens, Hq, D]`` in the output dtype.

        A backend that declares ``capabilities.cuda_graph`` also receives `GraphPlan`s here
        (and types ``plan`` as `AnyPlan`); any other never does: `prepare_graph` refuses it."""

    def __repr__(self) -> str:
        bound = "unbound" if self._spec is None else "bound"
        return f"<{type(self).__name__} {self.name!r} {bound}>"
