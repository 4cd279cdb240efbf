"""What every engine plugin does in an attention layer, written once.

An engine hands its attention backend the same things whatever the engine: per batch, where
each sequence starts in the packed token rows; per layer, ``q``/``k``/``v`` rows ``[T, H, D]``
(views of the packed QKV projection) and an output buffer to write. The engine plugins
(`vllm`, `sglang`) only translate their engine's objects into these: `EngineBatch` once per
batch, `EngineLayer` once per layer module. Both run the layer the way every other caller of
this library does: `select` picks the backend (once per layer, dtype and device), its
``prepare`` plans the batch (once per batch, backend and spec) and its ``forward`` runs the
layer. Rows past the batch's tokens (an engine pads its buffers for graphs) are written as 0.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .._select._selector import Selection, select
from .._values._errors import IntegrationError, NoBackendError
from .._values._features import AlibiSpec, SlidingWindow
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec
from ._layout import dense_heads, prepared_plan

__all__ = ["EngineBatch", "EngineLayer", "LayerShape", "refusals"]


@dataclass(frozen=True)
class LayerShape:
    """What an engine's attention layer declares when it is built: everything of its spec
    except the dtype, which the layer's inputs carry."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    softmax_scale: float
    window: SlidingWindow | None = None
    logit_softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    attention_sinks: bool = False

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """The layer's `AttentionSpec` for inputs of ``dtype``: bidirectional, no RoPE left
        (the engine's model rotates q and k before attention)."""
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            causal=False,
            rope=None,
            softmax_scale=self.softmax_scale,
            window=self.window,
            logit_softcap=self.logit_softcap,
            alibi=AlibiSpec(self.alibi_slopes) if self.alibi_slopes is not None else None,
            attention_sinks=self.attention_sinks,
        )


@dataclass(eq=False)
class EngineBatch:
    """One engine batch: its sequence lengths as `FMHAParams`, and the plans prepared on them
    (one per backend and spec, shared by every layer of that spec)."""

    params: FMHAParams
    tokens: int
    """Token rows the sequences fill; rows past them in the engine's buffers are padding."""
    plans: dict[Hashable, tuple[object, object]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str) -> EngineBatch:
        """A batch of sequences of ``lengths`` tokens, back to back from row 0; sequences of 0
        tokens (requests an engine pads a batch with) are left out."""
        real = [int(n) for n in lengths if int(n) > 0]
        if not real:
            raise IntegrationError(
                f"an engine batch with no token to attend (sequence lengths {list(lengths)[:8]})"
            )
        return cls(FMHAParams.from_lengths(real, device=device), sum(real))

    def plan(self, selection: Selection, spec: AttentionSpec) -> object:
        """The selected backend's plan for ``spec`` on this batch, shared by its layers."""
        return prepared_plan(self.plans, self._lock, selection.backend, spec, self.params)


class EngineLayer:
    """One attention layer of an engine's model, served by the backend `select` picks for it.

    ``backend`` pins the backend by name (refused with its reasons when it does not fit, never
    swapped). The selection is made at the layer's first batch for each dtype and device and
    kept: a serving engine selects once, at startup.
    """

    def __init__(self, shape: LayerShape, *, engine: str, backend: str | None = None) -> None:
        self.shape = shape
        self.engine = engine
        self.backend = backend
        self._selections: dict[tuple[torch.dtype, torch.device], tuple[AttentionSpec, Selection]]
        self._selections = {}

    def selection(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[AttentionSpec, Selection]:
        """The layer's spec for ``dtype`` and the backend selected for it on ``device``."""
        found = self._selections.get((dtype, device))
        if found is None:
            spec = self.shape.spec(dtype)
            found = (spec, select(spec, device=device, backend=self.backend))
            self._selections[(dtype, device)] = found
        return found

    def run(
        self,
        batch: EngineBatch,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``batch`` from ``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` (or
        the same as ``[T, H * D]`` rows), written into ``output`` (``[T, Hq, D]`` or
        ``[T, Hq * D]``, ``T >= batch.tokens``); returns ``output``."""
        tokens, heads, dim = batch.tokens, self.shape.num_heads, self.shape.head_dim
        rows = query.shape[0]
        if rows < tokens or key.shape[0] < tokens or value.shape[0] < tokens:
            raise IntegrationError(
                f"{self.engine}: the batch holds {tokens} tokens but the layer was given "
                f"q/k/v of {query.shape[0]}/{key.shape[0]}/{value.shape[0]} rows"
            )
        if output.shape[0] != rows or output[0].numel() != heads * dim:
            raise IntegrationError(
                f"{self.engine}: an output buffer of shape {tuple(output.shape)} for {rows} "
                f"query rows of {heads} heads x {dim}"
            )
        kv_heads = self.shape.num_kv_heads
        q = _heads(query[:tokens], heads, dim)
        k, v = _heads(key[:tokens], kv_heads, dim), _heads(value[:tokens], kv_heads, dim)
        spec, selection = self.selection(query.dtype, query.device)
        plan = batch.plan(selection, spec)
        out = selection.backend.forward(
            (q, k, v),
            plan,  # type: ignore[arg-type]
            sinks=sinks,
        )
        flat = output.view(rows, heads * dim)
        flat[:tokens].copy_(out.view(tokens, heads * dim))
        if rows > tokens:
            flat[tokens:].zero_()
        return output


def _heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``x`` as ``[T, heads, dim]`` rows whose heads are dense per token, as the backends read
    them: the engine's views of its packed QKV projection already are (a view, no copy);
    anything else is copied."""
    if x.dim() == 2 and x.shape[1] == heads * dim and x.stride(-1) == 1:
        x = x.view(x.shape[0], heads, dim)
    if x.dim() != 3 or tuple(x.shape[1:]) != (heads, dim):
        raise IntegrationError(
            f"q/k/v rows of shape {tuple(x.shape)} for a layer of {heads} heads x {dim}"
        )
    return dense_heads(x)


def refusals(
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    has_kv_cache: bool = False,
    backend: str | None = None,
) -> list[str]:
    """Why this library cannot serve ``spec`` here, as `select` gave them; empty when it can.
    What an engine's own validation reports: `select`'s summary, then the reasons every
    backend shares (one of them refuses the call whatever the backend), else each backend's."""
    try:
        select(spec, device=device, has_kv_cache=has_kv_cache, backend=backend)
    except NoBackendError as exc:
        lead = f"attn_backends: {str(exc).splitlines()[0].rstrip(':')}"
        per_backend = [(name, [str(r) for r in reasons]) for name, reasons in exc.reasons]
        if not per_backend:
            return [lead]
        shared = [r for r in per_backend[0][1] if all(r in rs for _, rs in per_backend)]
        if shared and len(per_backend) > 1:
            return [lead, *(f"every backend: {r}" for r in shared)]
        return [lead, *(f"{name}: {'; '.join(rs)}" for name, rs in per_backend)]
    return []
