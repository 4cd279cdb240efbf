"""Whole-model CUDA graphs for varlen batches: one graph per bucket, replayed per batch.

A short query batch spends most of its time on the host: a 24-layer encoder launches hundreds
of small kernels per forward. Captured whole in a CUDA graph it replays in a fraction of that,
but a graph fixes every shape and buffer, and varlen attention plans per batch. The library's
graph mode (`GraphBucket`, ``backend.prepare_graph``, `GraphPlan.update`) plans a bucket once
and re-plans it in place; `GraphRunner` applies it to a whole transformers model loaded with
the integration:

- ``buckets`` (most tokens, most sequences, optionally the longest sequence): a batch runs in
  the smallest bucket it fits, as one packed row of the bucket's ``max_tokens`` rows;
- each bucket owns static ``input_ids``/``position_ids`` buffers, the batch is copied in and
  the rest filled with padding; each distinct attention spec of the model gets one
  `GraphPlan` per bucket, updated in place for every batch;
- on CUDA the whole forward is captured once per bucket, at its first batch (after a warm-up
  on a side stream), and replayed for every later batch; all buckets' graphs share one memory
  pool;
- a batch no bucket fits runs eagerly through the integration, as packed input;
- a model that asks for chunked attention (Llama 4) is refused by name: a bucket's layers get
  no mask, and the integration learns a layer's chunk from its mask.

Padding rows never reach a real token or the output: the graph plan cuts them into padding
sequences that attend only among themselves (`attn_backends._path._graph`), every other layer of an
encoder works per token, and only the batch's rows are returned.

On CPU (no capture) the runner does the same bucketing with the same static buffers, running
the model eagerly: with graph plans when the backend offers them, else with a per-batch plan of
the same padded sequence list.

What the runner serves is what the integration proved, never more. Until a batch of several
sequences has run through the integration unchanged (its checks, and its refusals with their
own errors, included), every batch does. The integration keeps the classes of mask checks it
passed (`_hf_proof`); each layer call of a bucket computes its spec with the same hook
(`_hf_call.layer_spec`) and must be covered by one of them (a packed one for a batch of
several sequences), else it is refused by name. Positions a caller gives are checked against
the batch's boundaries where the model's mask reads packed sequences from them, and a model
with token mixers outside attention (which would read a bucket's padding rows) runs every
batch through the integration. A model changed after wrapping (a submodule, parameter or
buffer registered anew, seen through torch's registration hooks, or a tensor moved to other
memory by ``model.to``/``half()``) has its buckets dropped, and the next batch is proved again.

While the runner drives a forward, the model's attention and mask functions (registered under
``<name>_graphs``, to which the runner switches the model) serve the bucket; at any other time
they are the integration's own, so the model keeps working outside the runner.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._backend._protocol import CudaGraphPrefill
from .._path._graph import GraphBucket, GraphPlan, slot_lengths
from .._select._selector import select
from .._values._errors import (
    FeatureNotSupportedError,
    GraphModeError,
    IntegrationError,
    ParamsError,
)
from .._values._params import FMHAParams
from .._values._platform import Platform
from .._values._spec import AttentionSpec
from . import _hf_call, _hf_features, _hf_models, _hf_proof, _layout, _registered
from ._packed import check_served, mark_served

__all__ = ["GraphRunner", "RunnerStats"]

logger = logging.getLogger("attn_backends")

PlanKind = Literal["graph", "eager"]


@dataclass
class RunnerStats:
    """What the runner did, batch by batch (for tests and logs)."""

    captures: int = 0
    replays: int = 0
    bucketed: int = 0
    """Bucketed batches run without a graph (CPU, or the first batch of a bucket)."""
    eager: int = 0
    """Batches no bucket fits, run through the integration."""
    proved: int = 0
    """Batches run through the integration first, to prove what the buckets then serve (the
    first batch of one sequence, the first of several, and the first after the model
    changed)."""
    buckets: list[GraphBucket | None] = field(default_factory=list)
    """The bucket of every batch, in order (None: eager)."""


@dataclass(eq=False)
class _BucketState:
    """A bucket's static buffers, its plans and (on CUDA) its captured graph."""

    bucket: GraphBucket
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    plans: dict[AttentionSpec, tuple[Any, object, torch.Tensor | None]] = field(
        default_factory=dict
    )
    """spec -> (backend, plan, qkv): a `GraphPlan` kept for the bucket's life with the packed
    QKV buffer its graph reads (the layers of the spec take turns in it), or a per-batch
    plan that reads the model's q/k/v where they are (no buffer)."""
    params: FMHAParams | None = None
    lengths: tuple[int, ...] = ()
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None


_watched: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[GraphRunner]] = (
    weakref.WeakKeyDictionary()
)
"""Each module of a wrapped model -> the runners that prepared it."""
_hooks_lock = threading.Lock()
_hooks_installed = False


def _registered_under(module: torch.nn.Module, name: str, value: object) -> None:
    """torch's registration hooks: a watched module gained or replaced a child, a parameter
    or a buffer, so the runners that prepared it are stale."""
    for runner in list(_watched.get(module, ())):
        runner._tree_changed = True


def _install_registration_hooks() -> None:
    """Install the three global registration hooks once per process."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        from torch.nn.modules import module as torch_module

        torch_module.register_module_module_registration_hook(_registered_under)
        torch_module.register_module_parameter_registration_hook(_registered_under)
        torch_module.register_module_buffer_registration_hook(_registered_under)
        _hooks_installed = True


class _Active(threading.local):
    state: _BucketState | None = None
    runner: GraphRunner | None = None


_active = _Active()


def _dispatch_attention(inner: Any) -> Any:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        runner, state = _active.runner, _active.state
        if runner is None or state is None:
            return inner(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )
        return runner._attend(state, module, query, key, value, dropout, scaling, is_causal, kwargs)

    _registered.mark_ours(attention)
    return attention


def _dispatch_mask(inner: Any) -> Any:
    def mask(*args: Any, **kwargs: Any) -> Any:
        if _active.state is None:
            return inner(*args, **kwargs)
        _refuse_chunks(kwargs)
        return None  # the bucket's plans hold the layout; no mask tensor, no device work

    return mask


def _refuse_chunks(kwargs: Mapping[str, Any]) -> None:
    """A bucket's layers get no mask, so no layer would learn a chunked mask's chunk (the
    integration reads it from the mask each layer is handed): refused by name, never run as
    plain causal attention."""
    config = kwargs.get("config")
    if config is None:
        return
    name = _hf_models.model_name(config)
    chunk = _hf_features.chunk_from_hf(config, kwargs.get("local_size"), name)
    if chunk is not None:
        raise FeatureNotSupportedError(
            f"{name} asks for chunked attention (attention_chunk_size={chunk}), which "
            "GraphRunner's bucket plans do not carry; run this model through the integration "
            "without GraphRunner (its packed and padded batches serve the chunks)"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [1, H, S, D]`` as ``[S, H, D]``, copied only when heads are not dense per token."""
    return _layout.dense_heads(x[0].transpose(0, 1))


def _pad_token_id(model: Any) -> int:
    """The config's ``pad_token_id`` (0 where it has none): what padding rows hold."""
    # transformers' untyped config; not every config defines a pad token
    pad = getattr(model.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else 0


class GraphRunner:
    """Run a transformers model (loaded with the integration) on packed batches in buckets.

    ``plans``: ``"graph"`` uses the backend's graph mode (required to capture; the default on
    CUDA), ``"eager"`` a per-batch plan of the bucket's padded sequence list (the default
    elsewhere). ``capture`` (default: on CUDA with graph plans) captures and replays.
    ``backend``/``platform`` go to `select` (``cuda_graph=True`` with graph plans).
    ``position_offset`` and ``pad_token_id`` fill what a batch does not give: positions
    restart at the offset, padding rows hold ``pad_token_id``. By default both follow the
    model's own rule: the offset is ``padding_idx + 1`` for RoBERTa-style embeddings (XLM-R,
    BGE-M3), else 0 (`_hf_models.position_offset`), the pad the config's ``pad_token_id``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: Sequence[GraphBucket],
        *,
        plans: PlanKind | None = None,
        capture: bool | None = None,
        backend: str | None = None,
        platform: Platform | str | None = None,
        position_offset: int | None = None,
        pad_token_id: int | None = None,
        warmup: int = 2,
    ) -> None:
        if not buckets or not all(isinstance(b, GraphBucket) for b in buckets):
            raise ParamsError("GraphRunner needs at least one GraphBucket")
        self.model = model
        self.device = next(model.parameters()).device
        self.buckets = tuple(sorted(set(buckets), key=lambda b: (b.max_tokens, b.max_batch)))
        self.plans: PlanKind = plans or ("graph" if self.device.type == "cuda" else "eager")
        self.capture = (
            self.plans == "graph" and self.device.type == "cuda" if capture is None else capture
        )
        if self.capture and (self.plans != "graph" or self.device.type != "cuda"):
            raise ParamsError("capture needs graph plans on a CUDA device")
        self.backend = backend
        self.platform = platform
        self.position_offset = (
            position_offset if position_offset is not None else _hf_models.position_offset(model)
        )
        self.pad_token_id = pad_token_id if pad_token_id is not None else _pad_token_id(model)
        self.warmup = warmup
        self.stats = RunnerStats()
        self._states: dict[GraphBucket, _BucketState] = {}
        self._pool: Any = None
        self._proved_class = 0
        """The widest class of batch run through the integration since the buckets were last
        dropped: 0 none, 1 one sequence, 2 several (a batch of several proves what one of one
        does, and the model's keeping sequences apart besides)."""
        self._proofs: frozenset[_hf_proof.MaskProof] = frozenset()
        """What the batches the integration checked proved of the model's mask (`_hf_proof`):
        every bucketed layer call must be covered by one of them."""
        self._no_cache = "use_cache" in inspect.signature(model.forward).parameters
        self._lock = threading.Lock()
        """Serializes calls: a bucket's input buffers, plans and graph are one batch's at a
        time (two threads on one runner wrote each other's buffers)."""
        self.attn_implementation = self._switch_attention(model)
        self._tree_changed = False
        """Set by the module registration hooks (`_watch`) when a module of the model gains or
        replaces a submodule, parameter or buffer."""
        self._tensors: list[torch.Tensor] = []
        self._addresses: tuple[int, ...] = ()
        self._watch()

    @staticmethod
    def _switch_attention(model: Any) -> str:
        """Register ``<name>_graphs`` around the model's integration functions; switch to it."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        name = _registered.require_ours(model, "GraphRunner")
        if name.endswith("_graphs"):
            return name
        graphs = f"{name}_graphs"
        AttentionInterface.register(
            graphs, _dispatch_attention(AttentionInterface._global_mapping[name])
        )
        AttentionMaskInterface.register(
            graphs, _dispatch_mask(AttentionMaskInterface._global_mapping[name])
        )
        model.set_attn_implementation(graphs)
        return graphs

    # -- public -----------------------------------------------------------------------------

    def bucket_for(self, lengths: Sequence[int]) -> GraphBucket | None:
        """The smallest bucket ``lengths`` fit, or None (the batch runs eagerly)."""
        tokens, longest = sum(lengths), max(lengths)
        for bucket in self.buckets:
            if (
                tokens <= bucket.max_tokens
                and len(lengths) <= bucket.max_batch
                and longest <= bucket.seqlen_limit
            ):
                return bucket
        return None

    def buffers(self, bucket: GraphBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The static ``input_ids``/``position_ids`` ``[1, max_tokens]`` of ``bucket``."""
        state = self._state(bucket)
        return state.input_ids, state.position_ids

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cu_seq_lens: torch.Tensor | Sequence[int],
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last hidden state ``[1, T, C]`` of one packed batch: ``input_ids`` ``[1, T]``,
        ``cu_seq_lens`` its ``n + 1`` prefix sums, ``position_ids`` ``[1, T]`` (default:
        restarting at ``position_offset``). Calls from several threads run one at a time."""
        _registered.require_still(self.model, self.attn_implementation, "GraphRunner")
        with self._lock:
            if self._tree_changed or self._moved():
                self._forget("the model changed after the runner prepared it")
            return self._call(input_ids, cu_seq_lens, position_ids)

    def _call(
        self,
        input_ids: torch.Tensor,
        cu_seq_lens: torch.Tensor | Sequence[int],
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        bounds = (
            _layout.cu_seqlens_bounds(cu_seq_lens)
            if isinstance(cu_seq_lens, torch.Tensor)
            else [int(x) for x in cu_seq_lens]
        )
        lengths = tuple(b - a for a, b in itertools.pairwise(bounds))
        tokens = bounds[-1] if bounds else 0
        if (
            input_ids.dim() != 2
            or input_ids.shape[0] != 1
            or len(bounds) < 2
            or bounds[0] != 0
            or input_ids.shape[1] != tokens
            or any(n <= 0 for n in lengths)
        ):
            raise IntegrationError(
                f"GraphRunner takes one packed row: input_ids [1, T] and cu_seq_lens from 0 to "
                f"T with no empty sequence; got input_ids {tuple(input_ids.shape)} and "
                f"cu_seq_lens {bounds[:6]}{'...' if len(bounds) > 6 else ''}"
            )
        input_ids = input_ids.to(self.device)
        given = position_ids is not None
        if position_ids is None:
            position_ids = self._positions(lengths)
        position_ids = _layout.check_position_ids(position_ids, tokens).to(self.device)
        bucket = self.bucket_for(lengths)
        self.stats.buckets.append(bucket)
        mixers = _hf_models.config_facts(self.model.config).mixers
        # a batch of one sequence has no boundary to prove: its class is proved by any batch
        # through the integration; the model's keeping sequences apart (and the integration's
        # refusals of models that mix them) only by a batch of several
        batch_class = min(len(lengths), 2)
        proved = self._proved_class >= batch_class
        if bucket is None or not proved or mixers:
            # a model with token mixers outside attention would read a bucket's padding rows
            # as tokens: every batch runs through the integration (which refuses packed rows
            # of several sequences for it, and serves one sequence exactly)
            hidden = self._eager(input_ids, position_ids, bounds)
            if not proved and not mixers:  # what the buckets may serve, until proved
                if bucket is not None:
                    self.stats.proved += 1
                self._proofs = _hf_proof.model_proofs(self.model)
            self._proved_class = max(self._proved_class, batch_class)
            if bucket is None or mixers:
                self.stats.eager += 1
                return self._served(hidden, cu_seq_lens)
        elif given:
            self._check_positions(position_ids, bounds)
        hidden = self._bucketed(self._state(bucket), input_ids, position_ids, lengths)
        return self._served(hidden, cu_seq_lens)

    @staticmethod
    def _served(hidden: torch.Tensor, cu_seq_lens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``hidden``, with the caller's ``cu_seq_lens`` marked as served by attention that
        kept the sequences apart (the runner proved it: this batch through the integration's
        checks, or an earlier batch of several for the bucketed path), so that
        `transformers.unpack_hidden` accepts the output."""
        if isinstance(cu_seq_lens, torch.Tensor):
            mark_served(cu_seq_lens)
        return hidden

    # -- internals --------------------------------------------------------------------------

    def _watch(self) -> None:
        """Remember what the runner's graphs and plans read of the model: its module tree
        (watched through torch's registration hooks) and its tensors' storage."""
        _install_registration_hooks()
        for module in self.model.modules():
            _watched.setdefault(module, weakref.WeakSet()).add(self)
        self._tensors = [*self.model.parameters(), *self.model.buffers()]
        self._addresses = tuple(t.data_ptr() for t in self._tensors)
        self._tree_changed = False

    def _moved(self) -> bool:
        """Whether a tensor of the model now lives elsewhere (``model.to``, ``half()``,
        ``p.data = ...``): a captured graph would read the old memory."""
        return tuple(t.data_ptr() for t in self._tensors) != self._addresses

    def _forget(self, why: str) -> None:
        """Drop every bucket (graphs, plans, buffers) and the proofs the runner relied on: the
        next batch runs through the integration again and is proved anew."""
        logger.info("GraphRunner: %s; its buckets are dropped and re-proved", why)
        self._states.clear()
        self._proved_class = 0
        self._proofs = frozenset()
        self._watch()

    def _check_positions(self, position_ids: torch.Tensor, bounds: list[int]) -> None:
        """A caller's positions must describe the batch's sequences where the model's mask
        reads them (a causal mask finds packed sequences in them): the proved class holds
        only for positions that count up by one inside each sequence and, for packed ids,
        break at every start. One read on the host."""
        reads = {role for proof in self._proofs for role in proof.reads}
        if not reads:
            return
        row = position_ids[0].cpu()
        if not _hf_proof.positions_split_at(row, bounds[:-1], strict="ids" in reads):
            raise IntegrationError(
                f"GraphRunner: position_ids do not restart exactly at the cu_seq_lens "
                f"boundaries {bounds[:6]}{'...' if len(bounds) > 6 else ''}, and the model's "
                "mask reads its packed sequences from them; pass positions restarting per "
                "sequence (the default when position_ids is None)"
            )

    def _proved_causal(self) -> bool | None:
        """The causal flag every kept proof agrees on (None: none, or they differ)."""
        found = {proof.causal for proof in self._proofs}
        return found.pop() if len(found) == 1 else None

    def _positions(self, lengths: Sequence[int]) -> torch.Tensor:
        return torch.cat([torch.arange(n) for n in lengths])[None] + self.position_offset

    def _forward(self, **inputs: Any) -> torch.Tensor:
        if self._no_cache:
            inputs["use_cache"] = False
        out = self.model(**inputs)
        hidden = out[0] if isinstance(out, tuple) else next(iter(out.values()))
        return hidden  # type: ignore[no-any-return]

    def _eager(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """The batch through the integration as packed input (its checks included)."""
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.device)
        longest = max(b - a for a, b in itertools.pairwise(bounds))
        hidden = self._forward(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
        check_served(hidden, cu)  # refuses boundaries no attention layer read
        return hidden

    def _state(self, bucket: GraphBucket) -> _BucketState:
        state = self._states.get(bucket)
        if state is None:
            shape = (1, bucket.max_tokens)
            state = _BucketState(
                bucket,
                torch.full(shape, self.pad_token_id, dtype=torch.long, device=self.device),
                torch.full(shape, self.position_offset, dtype=torch.long, device=self.device),
            )
            self._states[bucket] = state
        return state

    def _bucketed(
        self,
        state: _BucketState,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        lengths: tuple[int, ...],
    ) -> torch.Tensor:
        tokens = sum(lengths)
        state.input_ids[:, :tokens].copy_(input_ids)
        state.input_ids[:, tokens:].fill_(self.pad_token_id)
        state.position_ids[:, :tokens].copy_(position_ids)
        state.position_ids[:, tokens:].fill_(self.position_offset)
        state.lengths = lengths
        state.params = FMHAParams.from_lengths(
            lengths, device=self.device, padded_rows=state.bucket.max_tokens
        )
        if self.plans == "eager":
            state.plans.clear()  # per-batch plans: made again by the first layer of each spec
        else:
            for _, plan, _ in state.plans.values():
                assert isinstance(plan, GraphPlan)
                plan.update(state.params)
        if not self.capture:
            self.stats.bucketed += 1
            return self._run(state)[:, :tokens]
        if state.graph is None:
            self._capture_graph(state)
        assert state.graph is not None and state.output is not None
        state.graph.replay()
        self.stats.replays += 1
        return state.output[:, :tokens].clone()

    def _run(self, state: _BucketState) -> torch.Tensor:
        _active.runner, _active.state = self, state
        try:
            return self._forward(input_ids=state.input_ids, position_ids=state.position_ids)
        finally:
            _active.runner, _active.state = None, None

    def _capture_graph(self, state: _BucketState) -> None:
        """Warm up on a side stream (the plans are made there), then capture the forward."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(max(self.warmup, 1)):
                self._run(state)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            state.output = self._run(state)
        state.graph = graph
        self.stats.captures += 1

    def _plan(
        self, state: _BucketState, spec: AttentionSpec
    ) -> tuple[Any, object, torch.Tensor | None]:
        found = state.plans.get(spec)
        if found is not None:
            return found
        if state.graph is not None:
            raise IntegrationError(
                f"a layer asked for attention spec {spec} after the bucket "
                f"{state.bucket.to_dict()} was captured; the model changed under its graph"
            )
        params = state.params
        assert params is not None
        graph = self.plans == "graph"
        backend = select(
            spec,
            device=self.device,
            backend=self.backend,
            platform=self.platform,
            cuda_graph=graph,
        ).backend
        qkv: torch.Tensor | None = None
        if graph:
            if not isinstance(backend, CudaGraphPrefill):
                raise GraphModeError(
                    f"{backend.name} was selected with cuda_graph=True but has no graph mode",
                    [(backend.name, [])],
                )
            plan: object = backend.prepare_graph(state.bucket, device=self.device)
            assert isinstance(plan, GraphPlan)
            plan.update(params)
            # Graph mode reads one fixed packed buffer: [max_tokens, (Hq + 2 Hkv) * D].
            qkv = torch.zeros(
                state.bucket.max_tokens, spec.qkv_width, dtype=spec.dtype, device=self.device
            )
        else:
            padded = [n for n in slot_lengths(state.bucket, state.lengths) if n > 0]
            plan = backend.prepare(FMHAParams.from_lengths(padded, device=self.device))
        state.plans[spec] = (backend, plan, qkv)
        return backend, plan, qkv

    def _attend(
        self,
        state: _BucketState,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout: float,
        scaling: float | None,
        is_causal: bool | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        _hf_call.refuse_unsupported_call(module, query, key, value, dropout, kwargs)
        spec = _hf_call.layer_spec(
            module, query, key, scaling, is_causal, kwargs, proved_causal=self._proved_causal()
        )
        several = sum(1 for n in state.lengths if n > 0) > 1
        if not _hf_proof.proves(self._proofs, spec, several=several):
            raise IntegrationError(
                f"GraphRunner: {type(module).__name__} runs attention spec {spec} on "
                f"{'several packed sequences' if several else 'one sequence'}, but no batch "
                "the integration checked proved that class (the model's mask is not one the "
                "library proves once for every such batch, or the model changed since); run "
                "the model through the integration without GraphRunner"
            )
        backend, plan, qkv = self._plan(state, spec)
        sinks = _hf_features.sinks_from_hf(module, kwargs, spec.num_heads)
        if qkv is None:
            out = backend.forward((_rows(query), _rows(key), _rows(value)), plan, sinks=sinks)
        else:
            rows, q_width, kv_width = qkv.shape[0], spec.q_width, spec.kv_width
            qkv[:, :q_width].view(rows, spec.num_heads, spec.head_dim).copy_(
                query[0].transpose(0, 1)
            )
            for start, x in ((q_width, key), (q_width + kv_width, value)):
                part = qkv[:, start : start + kv_width]
                part.view(rows, spec.num_kv_heads, spec.head_dim).copy_(x[0].transpose(0, 1))
            out = backend.forward(qkv, plan, sinks=sinks)
        seq = query.shape[2]
        return out.view(1, seq, spec.num_heads, spec.head_dim), None
