"""The `NoCachePrefill` protocol: what engines call and what backend plugins provide."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .._model._params import FMHAParams
from .._model._platform import Platform
from .._model._reasons import Reason
from .._model._spec import AttentionSpec
from .._path._contract import Fp8Scales, PrefillPlan, QKVInput
from .._path._graph import GraphBucket, GraphPlan
from ._capabilities import Capabilities


@runtime_checkable
class NoCachePrefill(Protocol):
    """A no-KV-cache prefill attention backend.

    A plugin registers one unbound instance per backend. `select` checks it with `supports`,
    then calls `bind` to get an instance for one spec; engines call `prepare` once per batch and
    `forward` once per layer on the bound instance.
    """

    @property
    def name(self) -> str:
        """Unique, stable name (``flashinfer``, ``torch-sdpa``...)."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """Declared limits, as data."""
        ...

    @property
    def spec(self) -> AttentionSpec | None:
        """The spec this instance is bound to; None for the registered, unbound instance."""
        ...

    def supports(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Every reason this backend cannot serve ``spec`` on ``platform``; empty if it can."""
        ...

    def bind(self, spec: AttentionSpec, platform: Platform | None = None) -> NoCachePrefill:
        """A new instance bound to ``spec`` for ``platform`` (None: this machine). It refuses,
        with `NoBackendError` and the reasons, a spec ``supports`` refuses there."""
        ...

    def describe(self, platform: Platform) -> dict[str, str]:
        """Choices the bound instance makes internally (kernel variant...), for the record."""
        ...

    def prepare(self, params: FMHAParams) -> PrefillPlan:
        """Per-batch planning; all host work happens here."""
        ...

    def forward(
        self,
        qkv: QKVInput,
        plan: PrefillPlan,
        *,
        fp8_scales: Fp8Scales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over packed QKV: ``[token_q_num, Hq * D]``; no host sync, no cache.
        ``sinks``: the layer's attention-sink logits, float ``[Hq]``, exactly when the spec
        has ``attention_sinks``."""
        ...


@runtime_checkable
class CudaGraphPrefill(NoCachePrefill, Protocol):
    """A backend that declares ``capabilities.cuda_graph`` also offers graph mode: a plan per
    bucket, captured once, re-planned per batch (`GraphPlan.update`)."""

    def prepare_graph(
        self, bucket: GraphBucket, *, device: torch.device | str | None = None
    ) -> GraphPlan:
        """The bucket's plan; `GraphModeError` when graph mode cannot serve the spec."""
        ...

    def forward(
        self,
        qkv: QKVInput,
        plan: PrefillPlan | GraphPlan,
        *,
        fp8_scales: Fp8Scales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `NoCachePrefill.forward`; with a `GraphPlan` the output has the bucket's rows."""
        ...
