"""`PrefillBackend`: the base that wires a kernel to the packed-QKV contract.

A backend subclass declares ``name`` and ``capabilities`` and writes two small methods:
``plan_kernel`` (per batch) and ``attend`` (per layer, on already-checked Q/K/V views). The base
runs the generic capability checks, the contract, RoPE/logn and output shaping, so a backend
cannot forget any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch

from ._capabilities import Capabilities, check_capabilities
from ._contract import (
    Fp8Scales,
    InputLayout,
    PrefillPlan,
    QKVInput,
    QKVViews,
    prepare_plan,
    run_forward,
)
from ._errors import AttentionBackendError, BackendFailure, ParamsError, UnboundBackendError
from ._params import FMHAParams
from ._platform import Platform
from ._preprocess import resolve_preprocess
from ._reasons import Reason
from ._spec import AttentionSpec


@contextmanager
def _failures_named(backend: str, step: str) -> Iterator[None]:
    """Re-raise a kernel's own exception as `BackendFailure` (original as ``__cause__``), so
    callers catch one named error; the library's own errors pass through unchanged."""
    try:
        yield
    except AttentionBackendError:
        raise
    except Exception as exc:
        raise BackendFailure(
            f"backend {backend} failed in {step}(): {type(exc).__name__}: {exc}"
        ) from exc


class PrefillBackend(ABC):
    """Base class implementing `NoCachePrefill` around a kernel."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self._spec = spec

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

    def prepare(self, params: FMHAParams) -> PrefillPlan:
        spec = self.bound_spec()
        if not isinstance(params, FMHAParams):
            raise ParamsError(f"prepare() takes FMHAParams, got {type(params).__name__}")
        fused = self.capabilities.fuses_rope(spec, params.max_seqlen_q)
        with _failures_named(self.name, "plan_kernel"):
            kernel = self.plan_kernel(spec, params, fused_rope=fused)
        return prepare_plan(self.name, spec, params, fused, kernel)

    def forward(
        self, qkv: QKVInput, plan: PrefillPlan, *, fp8_scales: Fp8Scales | None = None
    ) -> torch.Tensor:
        return run_forward(
            self.name,
            self.bound_spec(),
            qkv,
            plan,
            fp8_scales,
            self.input_layout(self.bound_spec()),
            self._attend_named,
        )

    def _attend_named(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        with _failures_named(self.name, "attend"):
            out = self.attend(views, plan)
        if not isinstance(out, torch.Tensor):
            raise BackendFailure(f"backend {self.name} attend() returned {type(out).__name__}")
        return out

    def input_layout(self, spec: AttentionSpec) -> InputLayout:
        """Memory layout the kernel needs; by default from ``capabilities.needs_contiguous``."""
        return "dense-tensors" if self.capabilities.needs_contiguous else "views"

    @abstractmethod
    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> object:
        """Per-batch kernel planning; ``fused_rope`` says the kernel must apply RoPE itself."""

    @abstractmethod
    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        """Attention on checked views; returns ``[token_q_num, Hq, D]`` in the output dtype."""

    def __repr__(self) -> str:
        bound = "unbound" if self._spec is None else "bound"
        return f"<{type(self).__name__} {self.name!r} {bound}>"
