"""A model loaded with the integration, traceable whole by ``torch.compile(fullgraph=True)``.

The integration's attention function does host work in every layer (it builds the spec, reads
the layout from ``cu_seq_lens``, selects a backend, prepares a plan, checks the mask), so dynamo
would break the graph at each attention call and fuse nothing across it. Here that host work
moves out of the compiled region:

- `compile_ready` runs one example batch through the integration unchanged (its checks
  refuse what the integration refuses) and learns the attention spec of every layer; layers of
  one spec share an integer handle;
- ``CompileReady.batch(cu_seq_lens)`` selects and prepares one plan per handle for the batch,
  on the host, and holds them in a handle table for the forward run inside it;
- inside the compiled model each attention call is the custom op ``attn_backends::prefill``
  (q, k, v as ``[tokens, H, D]`` and the handle, a constant of the graph): dynamo sees only
  its fake (shape and dtype), and its body runs the prepared plan's backend ``forward``.

The handle is the same for every batch, so a new batch changes the table, not the graph.
The model is called with ``input_ids`` and restarting ``position_ids`` only; the mask hook
returns no mask while a batch is prepared (the plans hold the layout).

What runs is what the example proved. A model forward pre-hook puts the op
``attn_backends::check_batch`` at the model's input: inside ``ready.batch`` its tokens must be
the prepared count and its ``position_ids`` must restart exactly at the prepared boundaries (a
batch of other sequences is refused, not run on plans made for these). A batch of several
sequences needs an example batch of several, whose mask check proved packed rows for every
spec (`_hf_proof`): one sequence proves no boundary.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .._select._selector import select
from .._values._errors import IntegrationError
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec
from . import _hf_call, _hf_features, _hf_mask, _hf_proof, _registered
from ._layout import dense_heads
from ._packed import check_served

__all__ = ["CompileReady", "compile_ready"]

_checked_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""The models `compile_ready` registered its input check (`_checked_inputs`) on."""
_checked_lock = threading.Lock()
_HANDLE = "_attn_backends_handle"
"""The attribute holding an attention module's handle: an int that dynamo reads as a
constant of the graph."""


class _ThreadState(threading.local):
    """What one thread is serving, never seen by another thread's forward."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[Any, object, int]] = {}
        """handle -> (backend, plan, tokens) of the batch this thread is serving; filled by
        `CompileReady.batch`. Per thread: a module-global table made another thread's plain
        forward run on this thread's plans."""
        self.learning: list[CompileReady] = []
        """The `CompileReady` whose example batch this thread is running (specs being
        learned)."""
        self.bounds: list[int] | None = None
        """The prefix sums `CompileReady.batch` prepared the table for."""


_state = _ThreadState()
_next_handle = itertools.count()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [1, H, S, D]`` as ``[S, H, D]`` (a view)."""
    return x[0].transpose(0, 1)


@torch.library.custom_op("attn_backends::prefill", mutates_args=())
def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    handle: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen prefill attention of ``[tokens, H, D]`` rows on the plan prepared for
    ``handle`` (outside the compiled region, by `CompileReady.batch`); ``sinks``: the layer's
    attention-sink logits (transformers' ``s_aux``), checked by the contract."""
    found = _state.table.get(handle)
    if found is None:
        raise IntegrationError(
            f"attention handle {handle} has no prepared plan: call the compiled model inside "
            "`with ready.batch(cu_seq_lens):` of the CompileReady that prepared it"
        )
    backend, plan, tokens = found
    if q.shape[0] != tokens:
        raise IntegrationError(
            f"the model attends {q.shape[0]} tokens but ready.batch prepared plans for "
            f"{tokens}: pass the cu_seq_lens of the batch the model is called with"
        )
    out = backend.forward((dense_heads(q), dense_heads(k), dense_heads(v)), plan, sinks=sinks)
    return out  # type: ignore[no-any-return]


@prefill.register_fake
def _prefill_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    handle: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("attn_backends::check_batch", mutates_args=())
def check_batch(tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The model's input checked against the batch `CompileReady.batch` prepared: its tokens
    (``input_ids [1, T]`` or ``inputs_embeds [1, T, C]``) are the prepared count, and its
    ``position_ids`` restart exactly at the prepared boundaries and count up by one between
    them (as `pack_sequences` makes them), so the plans describe the sequences the model
    embeds. Returns a copy of ``tokens`` for the model to read (the check stays in the graph).
    Reads the positions on the host: one synchronisation per forward on a GPU."""
    bounds = _state.bounds
    if bounds is None:
        raise IntegrationError(
            "the model was called with no prepared batch: call it inside "
            "`with ready.batch(cu_seq_lens):` of the CompileReady that prepared it"
        )
    tokens_n = bounds[-1]
    if tokens.dim() < 2 or tokens.shape[0] != 1 or tokens.shape[1] != tokens_n:
        raise IntegrationError(
            f"the model is given input of shape {tuple(tokens.shape)} but ready.batch "
            f"prepared plans for one packed row of {tokens_n} tokens: pass the cu_seq_lens "
            "of the batch the model is called with"
        )
    starts = bounds[:-1]
    if position_ids is None:
        if len(starts) > 1:
            raise IntegrationError(
                f"the model is called without position_ids on a batch of {len(starts)} "
                "sequences: it would number the whole row as one sequence; pass position_ids "
                "restarting at each sequence (pack_sequences makes them)"
            )
    elif tuple(position_ids.shape) != (1, tokens_n) or not _hf_proof.positions_split_at(
        position_ids[0].cpu(), starts, strict=True
    ):
        raise IntegrationError(
            f"position_ids do not restart exactly at the boundaries ready.batch prepared "
            f"({bounds[:6]}{'...' if len(bounds) > 6 else ''}): the model would embed other "
            "sequences than its attention keeps apart; prepare the batch with the cu_seq_lens "
            "its position_ids describe"
        )
    return tokens.clone()


@check_batch.register_fake
def _check_batch_fake(tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    return tokens.new_empty(tokens.shape)


def _checked_inputs(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The model's forward pre-hook: inside a prepared batch (compiled or not) its input goes
    through `check_batch` first."""
    if not (torch.compiler.is_compiling() or _state.table):
        return None
    positions = kwargs.get("position_ids")
    if args and isinstance(args[0], torch.Tensor):
        return (check_batch(args[0], positions), *args[1:]), kwargs
    for name in ("input_ids", "inputs_embeds"):
        given = kwargs.get(name)
        if isinstance(given, torch.Tensor):
            return args, {**kwargs, name: check_batch(given, positions)}
    raise IntegrationError(
        "call the model with input_ids (or inputs_embeds) inside ready.batch: compile_ready "
        "checks them against the prepared batch"
    )


def _attention(inner: Any) -> Any:
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
        if torch.compiler.is_compiling() or _state.table:
            # the module is transformers' (untyped): its handle is our own attribute
            handle: int | None = getattr(module, _HANDLE, None)
            if handle is None:
                raise IntegrationError(
                    f"{type(module).__name__} has no prepared attention handle: the example "
                    "batch given to compile_ready never reached this layer; give compile_ready "
                    "a batch that runs every attention layer of the model"
                )
            seq, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
            sinks = _hf_features.sinks_from_hf(module, kwargs, heads)
            out = prefill(_rows(query), _rows(key), _rows(value), handle, sinks)
            return out.view(1, seq, heads, head_dim), None
        if _state.learning:
            ready = _state.learning[-1]
            _hf_call.refuse_unsupported_call(module, query, key, value, dropout, kwargs)
            request = _hf_mask.request_of(attention_mask)
            spec = _hf_call.layer_spec(
                module, query, key, scaling, is_causal, kwargs, request, attention_mask
            )
            setattr(module, _HANDLE, ready._handle_for(spec))
        return inner(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )

    _registered.mark_ours(attention)
    return attention


def _mask(inner: Any) -> Any:
    def mask(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _state.table:
            return None  # the prepared plans hold the layout
        return inner(*args, **kwargs)

    return mask


class CompileReady:
    """A model switched to ``<name>_compiled`` whose attention specs are known; see
    `compile_ready`."""

    def __init__(self, model: torch.nn.Module, backend: str | None, name: str) -> None:
        self.model = model
        self.backend = backend
        self.name = name
        """The attention implementation `compile_ready` switched the model to."""
        self.device = next(model.parameters()).device
        self.specs: dict[AttentionSpec, int] = {}
        """Every attention spec of the model and its handle."""
        self.packed_proved = False
        """Whether the example batch proved packed rows for every module (`_hf_proof`): set
        by `compile_ready`; without it only batches of one sequence are served."""

    def _handle_for(self, spec: AttentionSpec) -> int:
        handle = self.specs.get(spec)
        if handle is None:
            handle = self.specs[spec] = next(_next_handle)
        return handle

    @contextlib.contextmanager
    def batch(self, cu_seq_lens: torch.Tensor | Sequence[int]) -> Iterator[None]:
        """Select and prepare one plan per spec for the packed batch ``cu_seq_lens`` (its
        ``n + 1`` prefix sums); the model (compiled or not) runs it inside this block."""
        bounds = [
            int(x)
            for x in (
                cu_seq_lens.tolist() if isinstance(cu_seq_lens, torch.Tensor) else cu_seq_lens
            )
        ]
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        if len(bounds) < 2 or bounds[0] != 0 or any(n <= 0 for n in lengths):
            raise IntegrationError(
                f"CompileReady.batch takes the prefix sums of a packed row, from 0 with no "
                f"empty sequence; got {bounds[:6]}{'...' if len(bounds) > 6 else ''}"
            )
        if _state.table:
            raise IntegrationError("CompileReady.batch blocks do not nest")
        _registered.require_still(self.model, self.name, "compile_ready")
        if len(lengths) > 1 and not self.packed_proved:
            raise IntegrationError(
                f"CompileReady.batch is given {len(lengths)} sequences, but the example batch "
                "compile_ready checked proved no batch of several: it held one sequence, or "
                "the model's mask is not one the library proves for every packed batch. Call "
                "compile_ready with an example of two or more sequences, or run this model "
                "through the integration without compile_ready"
            )
        params = FMHAParams.from_lengths(lengths, device=self.device)
        for spec, handle in self.specs.items():
            chosen = select(spec, device=self.device, backend=self.backend).backend
            _state.table[handle] = (chosen, chosen.prepare(params), bounds[-1])
        _state.bounds = bounds
        try:
            yield
        finally:
            _state.table.clear()
            _state.bounds = None


def compile_ready(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    backend: str | None = None,
    **forward_kwargs: Any,
) -> CompileReady:
    """Make ``model`` (loaded with the integration) traceable by
    ``torch.compile(model, fullgraph=True)`` on packed input.

    The example batch (``input_ids [1, T]``, its ``cu_seq_lens``, restarting ``position_ids``
    by default) runs once through the integration, which checks it as for any packed batch,
    and the attention spec of every layer is learned from it. Then::

        ready = compile_ready(model, ids, cu)
        compiled = torch.compile(model, fullgraph=True)
        with ready.batch(cu):
            hidden = compiled(input_ids=ids, position_ids=positions)[0]

    ``backend`` pins the backend for every spec (else `select` chooses per spec and device).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = _registered.require_ours(model, "compile_ready")
    compiled_name = name if name.endswith("_compiled") else f"{name}_compiled"
    ready = CompileReady(model, backend, compiled_name)
    if not name.endswith("_compiled"):
        AttentionInterface.register(
            compiled_name, _attention(AttentionInterface._global_mapping[name])
        )
        AttentionMaskInterface.register(
            compiled_name, _mask(AttentionMaskInterface._global_mapping[name])
        )
        model.set_attn_implementation(compiled_name)  # type: ignore[operator]
    with _checked_lock:
        if model not in _checked_models:  # one pre-hook per model, however often prepared
            model.register_forward_pre_hook(_checked_inputs, with_kwargs=True)
            _checked_models.add(model)
    cu = cu_seq_lens.to(device=ready.device, dtype=torch.int32)
    if position_ids is None:
        bounds = cu.tolist()
        position_ids = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])[None]
    longest = int((cu[1:] - cu[:-1]).max())
    kwargs: Mapping[str, Any] = {
        "input_ids": input_ids.to(ready.device),
        "position_ids": position_ids.to(ready.device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        **forward_kwargs,
    }
    _state.learning.append(ready)
    try:
        with torch.inference_mode():
            out = model(**kwargs)
    finally:
        _state.learning.pop()
    hidden = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    check_served(hidden, cu)
    proofs = _hf_proof.model_proofs(model)
    ready.packed_proved = bool(ready.specs) and all(
        _hf_proof.proves(proofs, spec, several=True) for spec in ready.specs
    )
    if not ready.specs:
        raise IntegrationError(
            f"{type(model).__name__} ran no attention layer through the integration on the "
            "example batch, so compile_ready learned nothing to prepare"
        )
    return ready
