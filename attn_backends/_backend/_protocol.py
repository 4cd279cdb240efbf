"""The `NoCachePrefill` protocol (what engines call) and `BackendClass` (what plugins register)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .._path._contract import Fp8Scales, PrefillPlan, QKVInput
from .._path._graph import GraphBucket, GraphPlan
from .._values._params import FMHAParams
from .._values._platform import Platform
from .._values._reasons import Reason
from .._values._spec import AttentionSpec
from ._capabilities import Capabilities


@runtime_checkable
class NoCachePrefill(Protocol):
    """A no-KV-cache prefill attention backend bound to one spec.

    A plugin registers the class (`BackendClass`); `select` judges the classes with
    ``supports`` and constructs the one it picked for the spec. Engines call `prepare` once per
    batch and `forward` once per layer on that instance.
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
    def spec(self) -> AttentionSpec:
        """The spec this instance is bound to."""
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


class BackendClass(Protocol):
    """What a plugin registers: a class whose declarations and judgement need no instance.

    ``name`` and ``capabilities`` are class data, ``supports`` a classmethod; calling the class
    with a spec and a platform that ``supports`` accepted gives the bound `NoCachePrefill`.
    `PrefillBackend` subclasses are `BackendClass`es.
    """

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def supports(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Every reason this backend cannot serve ``spec`` on ``platform``; empty if it can."""
        ...

    def __call__(self, spec: AttentionSpec, platform: Platform) -> NoCachePrefill: ...
