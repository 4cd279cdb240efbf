"""Hugging Face transformers models run their attention through this library.

``register()`` adds an attention function (and a matching mask function) to transformers'
registries; a model loaded with ``attn_implementation="attn_backends"`` then calls it in every
layer with Q/K/V ``[B, H, S, D]``, already rotated by the model. The function builds an
`AttentionSpec` from the call (``rope=None``: nothing left to rotate) and takes a backend for
it (`_hf_call`: both kept on the attention module, the selection while the `decision_epoch`
holds), prepares one plan per layout, backend and spec for all layers, and runs the backend on
``[tokens, H, D]`` views. The first call of each class in a forward resolves it; the layers
after it that make the same call reuse that resolution (`_Lane`).

The rule: the model computes exactly its own attention, or the call raises a named error
(`IntegrationError`, `FeatureNotSupportedError`, `MaskMismatchError`) that names the model,
what it asked for and what to do instead. To keep it:

- the mask hook refuses models whose attention modules bypass the registry
  (`_hf_models`, transformers' own ``_can_set_attn_implementation`` signal), and reads a
  chunked mask's chunk (Llama 4's ``attention_chunk_size``, `_hf_features`) into the spec of
  every layer handed that mask; models that pick their attention module from a table by
  implementation name are refused at load (`register` puts a refusing entry in those tables);
- the hook returns a guard tensor (`_hf_mask.MaskGuard`) that only the attention function
  reads: a model reading its mask anywhere else is refused at that read;
- packed rows are refused before any layer runs for models with token mixers outside
  attention (``config.layer_types``), and at `unpack_hidden` when fewer attention calls
  than the model's attention layers read them; padded batches are refused for models whose
  mixers read padded positions;
- the hook records the model's ``mask_function``; the attention function evaluates it and
  compares it with what the spec computes over the batch's layout (`_hf_mask`), once per
  batch, or once per class of batch where the function is one the library proves as a value
  (`_hf_proof`);
- 4-D masks are read by content, never by identity; `unpack_hidden` refuses packed
  boundaries that no attention layer read.

Two input forms:

- **packed** (no padding anywhere): one row holding every sequence back to back, with
  ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs (see `pack_sequences`) or ``position_ids`` that
  restart per sequence;
- **padded**: ``[B, S]`` rows with a 2-D attention mask (right or left padding). The valid
  tokens are gathered per layer with indices found once per batch; padded output rows are 0.

Sliding windows, logit soft-capping and chunks become spec fields (`_hf_features` is the
mapping);
a model that alternates local and global layers gets one plan per distinct spec per batch.

Each new decision is logged (logger ``attn_backends``, INFO) with the layer class, the spec
and the backend; `decisions()` returns them all.

transformers is imported only inside `register` and the hooks: ``import attn_backends`` never
needs it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._backend._backend import PrefillBackend
from .._path._contract import BoundForward, PrefillPlan
from .._select._selector import Selection, decision_epoch
from .._values._errors import IntegrationError, MaskMismatchError
from .._values._spec import AttentionSpec
from . import _hf_call, _hf_features, _hf_mask, _hf_mask_kinds, _hf_models, _hf_proof, _layout
from ._hf_call import clear_decisions, decisions
from ._hf_mask import MaskRequest
from ._layout import BatchLayout
from ._packed import PackedBatch, mark_served, pack_sequences, unpack_hidden

DEFAULT_NAME = "attn_backends"

__all__ = [
    "DEFAULT_NAME",
    "MaskMismatchError",
    "PackedBatch",
    "attention_forward",
    "clear_decisions",
    "decisions",
    "pack_sequences",
    "padding_mask",
    "register",
    "unpack_hidden",
]

_plans_lock = threading.Lock()
"""Guards ``BatchLayout.plans``: the whole-rows layouts of `_layout.full_rows` are shared by
every thread and model."""
logger = logging.getLogger("attn_backends")


def register(name: str = DEFAULT_NAME, *, backend: str | None = None) -> str:
    """Register the attention and mask functions under ``name`` and return it, for
    ``AutoModel.from_pretrained(..., attn_implementation=name)``.

    ``backend`` names the backend to use (refused with its reasons when it does not fit, never
    swapped); ``None`` lets `select` choose per spec and device.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attend = (
        attention_forward
        if backend is None
        else functools.partial(attention_forward, backend=backend)
    )
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, padding_mask)
    _hf_models.refuse_in_attention_tables(name)
    return name


def clear_layout_cache() -> None:
    """Drop the shared layouts (whole rows, prefix sums seen before) and the plans prepared on
    them (they keep their backends, and those backends' memory, alive past a
    `reset_registry`)."""
    _layout.clear_layouts()


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' mask hook: a ``[batch, kv_length]`` guard tensor (`_hf_mask.MaskGuard`)
    that only the registered attention function reads.

    No ``[B, 1, S, S]`` mask is built. The hook refuses models whose attention bypasses the
    registry (they would add this tensor to their scores) and packed or padded input that
    the model's other token mixers would misread, and records the model's ``mask_function``
    (and a chunked mask's chunk) with the returned tensor: the attention
    function evaluates it once per batch against what it computes.
    """
    config = kwargs.get("config")
    facts = _hf_models.config_facts(config) if config is not None else None
    model = facts.model if facts is not None else "the model"
    chunk: int | None = None
    if config is not None:
        _hf_models.refuse_bypassing_model(config)
        chunk = _hf_features.chunk_from_hf(config, kwargs.get("local_size"), model)
    if q_length != kv_length or q_offset != 0 or kv_offset != 0:
        raise IntegrationError(
            f"{model} asks for {q_length} queries against {kv_length} keys at offsets "
            f"{q_offset}/{kv_offset}: a KV cache continuing earlier tokens, which the no-cache "
            "prefill path does not serve; call the model with use_cache=False on a whole batch"
        )
    device = kwargs.get("device", "cpu")
    if type(device) is not torch.device:
        device = torch.device(device)
    padding: torch.Tensor | None = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise IntegrationError(
                f"{model}: the mask hook takes a [batch, seq] padding mask, got shape "
                f"{tuple(attention_mask.shape)}"
            )
        given = (
            attention_mask
            if attention_mask.shape[-1] == kv_length
            else attention_mask[:, -kv_length:]
        )
        # all() reads a value as bool() does (non-zero: a real token): a batch without
        # padding is told apart on the mask as given, and only a padded one is copied
        if not bool(given.all()):
            padding = given.to(device=device, dtype=torch.bool, copy=True)
    # the guard's storage: the bool mask as transformers hands it over (the guard is never
    # read or written: any operation on it raises), else a bool tensor of that shape
    token = (
        given
        if attention_mask is not None and given.dtype == torch.bool and given.device == device
        else torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    )
    function = kwargs.get("mask_function")
    request = MaskRequest(
        model,
        batch_size,
        kv_length,
        device,
        padding,
        # the evaluators are made from the function on first use (a batch of a proved class
        # never evaluates it); transformers vmaps as soon as a model adds a function of its
        # own, and a tree recognised to broadcast is evaluated exactly without it
        function=function if callable(function) else None,
        use_vmap=bool(kwargs.get("use_vmap", False)),
        chunk_size=chunk,
        mask_given=attention_mask is not None,
    )
    if facts is not None:
        if facts.mixers and padding is None and request.function is not None:
            evaluate = request.model_mask()
            assert evaluate is not None  # made from the function
            _refuse_packed_mixers(facts.mixers, model, evaluate, batch_size, kv_length, chunk)
        if facts.blind and padding is not None:
            _refuse_padding_blind_mixers(facts.blind, model)
        request.attention_layers = facts.attention_layers
        request.mixers = facts.mixers
    proof = _hf_mask_kinds.proof_signature(function)
    if proof is not None:
        request.proof, ids = proof
        request.packed_ids = tuple(ids)
    request.epoch = decision_epoch()  # once per forward: the layers' kept selections hold
    return _hf_mask.record(_hf_mask.guard(token, model), request)


def _refuse_padding_blind_mixers(blind: tuple[str, ...], model: str) -> None:
    """Refuse a padded batch for a model whose token mixers outside attention read the padded
    positions (``blind``): there the model's attention output has values, attn_backends' is 0."""
    if blind:
        raise IntegrationError(
            f"{model} is given a padded batch, but its {', '.join(blind)} mix the padded "
            "positions into the valid tokens, and there the attention output is the model's "
            "own (attn_backends leaves padded rows at 0). Pass one sequence per call (no "
            "padding), or load it with attn_implementation='sdpa' or 'eager'"
        )


def _refuse_packed_mixers(
    mixers: tuple[str, ...],
    model: str,
    evaluate: _hf_mask.ModelMask,
    batch: int,
    length: int,
    chunk: int | None,
) -> None:
    """Refuse packed rows, before any layer runs, for a model with layers that mix tokens
    outside the attention function: they would run across the sequences' boundaries.
    transformers marks packed rows (restarting ``position_ids``) in the mask function; a
    mask that hides some token's left neighbour splits its row."""
    # a chunked mask (``chunk``) splits rows at chunk starts by itself: not counted
    if mixers and _hf_mask.splits_rows(evaluate, batch, length, chunk):
        raise IntegrationError(_packed_mixers_message(model, mixers))


def _packed_mixers_message(model: str, mixers: tuple[str, ...]) -> str:
    return (
        f"{model} is given packed sequences, but its layers of kind {', '.join(mixers)} mix "
        "tokens outside the attention function and would run across the sequences' "
        "boundaries; attn_backends keeps only its attention layers apart. Pass a padded batch "
        "(each sequence its own row) instead"
    )


def _packed_source(
    batch: int, seq: int, kwargs: Mapping[str, Any], *, positions_pack: Callable[[], bool]
) -> tuple[str, torch.Tensor] | None:
    """The kwarg that packs several sequences into a row: ``cu_seq_lens_q``, else, where
    transformers itself reads them so (``positions_pack()``, `_positions_pack`, asked only when
    there are no prefix sums), 2-D ``position_ids`` (they split a row where they stop counting
    up by one)."""
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return "cu_seqlens", cu
    positions = kwargs.get("position_ids")
    if (
        isinstance(positions, torch.Tensor)
        and positions.dim() == 2
        and positions.shape[-1] == seq
        and positions.shape[0] in (1, batch)
        and positions_pack()
    ):
        return "positions", positions
    return None


def _packed_layout(
    kind: str, source: torch.Tensor, batch: int, seq: int, kwargs: Mapping[str, Any]
) -> BatchLayout:
    if kind == "cu_seqlens":
        cu_k = kwargs.get("cu_seq_lens_k")
        return _layout.from_cu_seqlens(_same_keys(source, cu_k), batch, seq)
    return _layout.from_position_ids(source, batch, seq)


def _positions_pack(request: MaskRequest) -> bool:
    """Whether restarting ``position_ids`` split this batch's rows, as transformers reads
    them, and only when the model was given no 2-D mask: a recognised mask function packs
    exactly when transformers built it with packed-sequence ids (its causal masks do; its
    bidirectional ones from transformers 5.25 on; a cache makes none). An unrecognised one
    is read as transformers' causal functions before 5.25 read positions; the mask check
    refuses it wherever the model's own mask says otherwise."""
    if request.mask_given:
        return False
    if request.proof is not None:
        return any(role == "ids" for role, _ in request.packed_ids)
    return request.mask_is_causal() is True


def _hooked_layout(
    request: MaskRequest, batch: int, seq: int, kwargs: Mapping[str, Any], layer: str
) -> tuple[BatchLayout, torch.Tensor | None]:
    """The layout of a batch whose mask came from the hook: packed by the kwargs when the
    batch has no padding, else the padding's rows; once per forward and source. With it the
    packed source this call marked as served (None for rows)."""
    if (batch, seq) != (request.batch, request.length):
        raise IntegrationError(
            f"{request.model} ({layer}): the mask was built for {request.batch} x "
            f"{request.length} tokens but the layer attends {batch} x {seq}; attn_backends "
            "serves self-attention over the whole batch only"
        )
    packed = _packed_source(batch, seq, kwargs, positions_pack=lambda: _positions_pack(request))
    if packed is not None and request.padding is None:
        kind, source = packed
        key: Hashable = (kind, id(source))
        entry = request.layouts.get(key)
        if entry is None or entry[0] is not source:
            entry = (source, _packed_layout(kind, source, batch, seq, kwargs))
            request.layouts[key] = entry  # the source kept alive: its id stays its own
        if entry[1].segments and request.mixers:
            # packed by kwargs the hook did not see (a 2-D mask given, or cu_seq_lens without
            # restarting position_ids): refused at the first attention layer
            raise IntegrationError(
                _packed_mixers_message(f"{request.model} ({layer})", request.mixers)
            )
        if entry[1].segments:
            mark_served(
                source,
                request=request.serial,
                newest=_hf_mask.newest_serial(),
                expected=request.attention_layers,
            )
            return entry[1], source
        return entry[1], None
    entry = request.layouts.get("rows")
    if entry is None:
        rows = (
            _layout.from_padding_mask(request.padding)
            if request.padding is not None
            else _layout.full_rows(batch, seq, request.device)
        )
        entry = (None, rows)
        request.layouts["rows"] = entry
    return entry[1], None


def _unhooked_layout(
    batch: int, seq: int, device: torch.device, kwargs: Mapping[str, Any]
) -> BatchLayout:
    """No mask at all (the model built none through the hook): the kwargs pack the rows, or
    each row is one sequence, as transformers' sdpa path reads a missing mask. Without the
    hook nothing marks where a forward starts, so a packed layout is derived per call from the
    kwargs' content (an inference tensor rewritten in place keeps no version to tell)."""
    # no mask function to consult: position_ids pack as transformers' flash path reads them
    packed = _packed_source(batch, seq, kwargs, positions_pack=lambda: True)
    if packed is not None:
        kind, source = packed
        layout = _packed_layout(kind, source, batch, seq, kwargs)
        if layout.segments:
            mark_served(source)
        return layout
    return _layout.full_rows(batch, seq, device)


def _batch_layout(
    module: torch.nn.Module,
    attention_mask: torch.Tensor | None,
    request: MaskRequest | None,
    batch: int,
    seq: int,
    device: torch.device,
    spec: AttentionSpec,
    kwargs: Mapping[str, Any],
    *,
    rows_proved: bool = False,
) -> tuple[BatchLayout, torch.Tensor | None]:
    """The batch's layout, checked against the model's own mask wherever there is one (whole
    rows need no check where ``rows_proved``: the call's class proved them, `_CallClass`),
    and the packed source a hooked call marked as served (`_hooked_layout`)."""
    layer = type(module).__name__
    if request is not None:
        layout, served = _hooked_layout(request, batch, seq, kwargs, layer)
        if rows_proved and _whole_rows(layout):
            return layout, served
        verdict = (id(layout), spec.causal, spec.window, spec.chunk_size)
        if request.has_mask and verdict not in request.checked:
            proof = _hf_proof.mask_proof(request, layout, spec)
            if proof is None or not _hf_proof.proved(module, proof):
                evaluate = request.model_mask()
                assert evaluate is not None  # has_mask
                _hf_mask.check_mask(
                    evaluate,
                    layout,
                    spec,
                    model_name=request.model,
                    layer=layer,
                    blocks=request.model_blocks(),
                )
                if proof is not None:
                    _hf_proof.remember(module, proof)
            request.checked.add(verdict)
        return layout, served
    if attention_mask is None:
        return _unhooked_layout(batch, seq, device, kwargs), None
    if attention_mask.dim() == 4:
        if (
            attention_mask.shape[-1] != seq
            or attention_mask.shape[-2] not in (1, seq)
            or attention_mask.shape[0] != batch
        ):
            raise IntegrationError(
                f"{layer}: a 4-D attention mask of shape {tuple(attention_mask.shape)} for a "
                f"batch of {batch} x {seq} tokens; pass the 2-D [batch, seq] padding mask"
            )
        if isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor):
            raise IntegrationError(
                f"{layer}: a 4-D attention mask together with cu_seq_lens; pass one of them"
            )
        return _hf_mask.layout_of_4d(attention_mask, spec, model_name=layer, layer=layer), None
    raise IntegrationError(
        f"{layer} received a {attention_mask.dim()}-D attention mask of shape "
        f"{tuple(attention_mask.shape)} that transformers' mask functions did not build, so "
        "its meaning is unknown; pass the 2-D padding mask to the model (which builds the "
        "layer masks through the registered mask function) or a 4-D [batch, 1, seq, seq] mask"
    )


def _same_keys(cu_q: torch.Tensor, cu_k: object) -> torch.Tensor:
    """``cu_seq_lens_q``, once checked (per batch) to equal ``cu_seq_lens_k`` when given."""
    if isinstance(cu_k, torch.Tensor) and cu_k is not cu_q and not torch.equal(cu_k, cu_q):
        raise IntegrationError(
            "cu_seq_lens_k differs from cu_seq_lens_q: keys of other lengths than the "
            "queries mean a KV cache or cross-attention; pass equal prefix sums"
        )
    return cu_q


def _plan_for(layout: BatchLayout, selection: Selection, spec: AttentionSpec) -> object:
    """The selected backend's plan for ``spec`` on ``layout``, shared by its layers."""
    return _layout.prepared_plan(layout.plans, _plans_lock, selection.backend, spec, layout.params)


RowsView = tuple[tuple[int, int, int], tuple[int, int, int], int]
"""Size, strides and storage offset that view a ``[B, H, S, D]`` tensor's tokens as rows
``[B * S, H, D]`` (``as_strided``'s arguments)."""


def _rows_view(x: torch.Tensor) -> RowsView | None:
    """How ``x [B, H, S, D]``'s tokens are one strided view of rows with each token's heads
    dense (what the kernels read); None where the memory allows no such view."""
    batch, heads, seq, dim = x.shape
    s_batch, s_head, s_seq, s_dim = x.stride()
    if s_dim == 1 and (heads == 1 or s_head == dim) and (batch == 1 or s_batch == seq * s_seq):
        return (batch * seq, heads, dim), (s_seq, s_head, 1), int(x.storage_offset())
    return None


def _token_rows(x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """``x [B, H, S, D]`` as ``[tokens, H, D]``: a view when the memory allows, else a copy."""
    if layout.cells is not None:
        rows, cols = layout.cells
        return x.transpose(1, 2)[rows, cols]
    view = _rows_view(x)
    if view is not None:
        return x.as_strided(*view)
    heads, dim = x.shape[1], x.shape[3]
    return _layout.dense_heads(x.transpose(1, 2).reshape(-1, heads, dim))


@dataclass(frozen=True, eq=False)
class _Lane:
    """One resolved class of attention call within a forward: the layers that make the same
    call (same shapes, flags, features and layout sources) share the spec, the checked layout,
    the backend and the plan the first of them resolved, and run only the tensor work."""

    sources: tuple[object, object, object]
    """The ``cu_seq_lens_q``/``cu_seq_lens_k``/``position_ids`` objects the layout came from,
    kept alive here: the lane key holds their ids, so a later call matches only with these
    very objects."""
    spec: AttentionSpec
    layout: BatchLayout
    backend: Any
    plan: object
    served: torch.Tensor | None
    """The packed source each call marks as served (`mark_served`), None for rows."""
    bound: BoundForward | None = None
    """The backend's ``forward`` bound to the call's input signature, which the lane key
    holds (`PrefillBackend.bind_forward`); None: ``forward`` runs every call."""
    rows: tuple[RowsView, RowsView, RowsView] | None = None
    """For a packed batch whose q, k and v are each one strided view of token rows: those
    views' arguments, fixed by the geometry the lane key holds, so a later call views its
    tensors without reading their strides again; None: `_kernel_input` per call."""


Geometry = tuple[object, ...]
"""Shape, strides and storage offset of q, k and v: everything the contract's input checks
read of them besides dtype and device (`separate_signature`)."""


def _lane_key(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    backend: str | None,
    kwargs: Mapping[str, Any],
) -> tuple[tuple[object, ...], Geometry, tuple[int, int, int]] | None:
    """Everything the resolution of a call reads, `refuse_unsupported_call` included, as a
    value (None: resolve it in full; a kwarg of a type only the full path judges): the call's
    facts but its tensors' geometry (what its class depends on with the heads, `_class_key`),
    that geometry (so a lane's bound forward serves exactly the inputs it was checked for),
    and the ids of the kwargs that may lay out its batch. Those enter by id: the lane keeps
    them alive, so an id seen again while it lives is the very same object."""
    features = _hf_call.feature_key(kwargs)
    if features is None:
        return None
    return (
        (
            query.dtype,
            key.dtype,
            value.dtype,
            query.device,
            key.device,
            value.device,
            scaling,
            is_causal,
            getattr(module, "is_causal", None),  # untyped: not every module defines it
            dropout > 0 and module.training,
            bool(kwargs.get("output_attentions")),
            *features,
            backend,
        ),
        (
            query.shape,
            query.stride(),
            query.storage_offset(),
            key.shape,
            key.stride(),
            key.storage_offset(),
            value.shape,
            value.stride(),
            value.storage_offset(),
        ),
        (
            id(kwargs.get("cu_seq_lens_q")),
            id(kwargs.get("cu_seq_lens_k")),
            id(kwargs.get("position_ids")),
        ),
    )


def _heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Hashable | None:
    """What a call's class reads of its tensors' shapes: the head counts and head dims, and
    whether q, k and v agree on the batch and the tokens (`refuse_unsupported_call`); None
    where they are not 4-D (refused in full)."""
    q, k, v = query.shape, key.shape, value.shape
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    same = q[0] == k[0] == v[0] and q[2] == k[2] == v[2]
    return (q[1], k[1], v[1], q[3], k[3], v[3], same)


@dataclass(frozen=True, eq=False)
class _CallClass:
    """What one class of call resolved to, kept on its attention module across forwards: the
    spec, the selection, and whether the model's mask is proved on whole rows (every row one
    sequence, no padding) for it. The class holds everything these depend on
    (`_class_key`), so a later forward of the class reads them back instead of refusing,
    building, selecting and proving again; its layout and plan are the batch's own."""

    spec: AttentionSpec
    selection: Selection
    rows_proved: bool


def _class_key(
    facts: tuple[object, ...], heads: Hashable | None, request: MaskRequest, declared: bool
) -> Hashable | None:
    """The class of a call under the forward's mask: the call's own facts (`_lane_key`) with
    its heads (`_heads`), not its batch's size, the mask function as a value, a chunked mask's
    chunk and the `decision_epoch`. None when the spec would depend on more: a layer that
    declares no causal flag reads it from the model's mask per forward, and a mask function
    that is not a value proves no class."""
    if heads is None or not declared or (request.has_mask and request.proof is None):
        return None
    return (facts, heads, request.proof, request.chunk_size, request.epoch)


def _reads_data(request: MaskRequest | None) -> bool:
    """Whether the model's mask reads tensors of the batch (packed-sequence ids, remapped
    positions): then each batch's own are checked, and no class proves them once."""
    return request is not None and bool(request.packed_ids)


def _whole_rows(layout: BatchLayout) -> bool:
    """Every row is one sequence, no padding: the layout a `_CallClass` proves once."""
    return layout.cells is None and not layout.segments


def _resolve(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    request: MaskRequest | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    backend: str | None,
    kwargs: Mapping[str, Any],
    call: tuple[object, ...] | None,
) -> _Lane:
    """The full path: the spec, the layout checked against the model's mask, the backend and
    the plan of one call; what depends on the class of the call alone is read back from the
    module where an earlier forward resolved it (`_CallClass`)."""
    klass: Hashable | None = None
    known: _CallClass | None = None
    if call is not None and request is not None:
        # untyped: not every transformers attention module defines is_causal
        declared = is_causal is not None or getattr(module, "is_causal", None) is not None
        klass = _class_key(call, _heads(query, key, value), request, declared)
        kept: dict[Hashable, _CallClass] | None = module.__dict__.get(_hf_proof.CLASSES)
        known = kept.get(klass) if kept is not None and klass is not None else None
    batch, _, seq, _ = query.shape
    if known is None:
        _hf_call.refuse_unsupported_call(module, query, key, value, dropout, kwargs)
        spec = _hf_call.layer_spec(
            module, query, key, scaling, is_causal, kwargs, request, attention_mask
        )
        selection = _hf_call.layer_selection(
            module,
            spec,
            query.device,
            backend,
            epoch=request.epoch if request is not None else None,
        )
    else:
        spec, selection = known.spec, known.selection
    rows_proved = known is not None and known.rows_proved
    layout, served = _batch_layout(
        module,
        attention_mask,
        request,
        batch,
        seq,
        query.device,
        spec,
        kwargs,
        rows_proved=rows_proved,
    )
    if klass is not None:
        # a new class is kept; a kept one again once its whole rows are proved
        proved = _whole_rows(layout) and not _reads_data(request)
        if known is None or (proved and not rows_proved):
            _hf_call.keep(module, _hf_proof.CLASSES, klass, _CallClass(spec, selection, proved))
    plan = _plan_for(layout, selection, spec)
    sources = (
        kwargs.get("cu_seq_lens_q"),
        kwargs.get("cu_seq_lens_k"),
        kwargs.get("position_ids"),
    )
    return _Lane(sources, spec, layout, selection.backend, plan, served)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    backend: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: ``(out [B, S, Hq, D], None)``.

    Padded rows of the output are zeros (the model ignores them, as it ignores any value
    there). The spec's ``causal`` flag is ``is_causal`` when given, else ``module.is_causal``, else
    what the model's own mask says. The first call of each class in a forward resolves it in
    full (`_resolve`); the layers after it that make the same call reuse that (`_Lane`).
    """
    request = _hf_mask.request_of(attention_mask)
    lane: _Lane | None = None
    call = (
        _lane_key(module, query, key, value, dropout, scaling, is_causal, backend, kwargs)
        if request is not None
        else None
    )
    if call is not None and request is not None:
        lane = request.lanes.get(call)
    if lane is not None:
        if lane.served is not None and request is not None:
            mark_served(  # every attention call that reads the packed boundaries counts
                lane.served,
                request=request.serial,
                newest=_hf_mask.newest_serial(),
                expected=request.attention_layers,
            )
        rows = lane.rows
        if rows is not None:
            qkv = (query.as_strided(*rows[0]), key.as_strided(*rows[1]), value.as_strided(*rows[2]))
        else:
            qkv = _kernel_input(query, key, value, lane.layout)
    else:
        lane = _resolve(
            module,
            query,
            key,
            value,
            attention_mask,
            request,
            dropout,
            scaling,
            is_causal,
            backend,
            kwargs,
            call[0] if call is not None else None,
        )
        qkv = _kernel_input(query, key, value, lane.layout)
        if call is not None and request is not None:
            # the input's checks run here once, for the whole lane
            lane = _kept(lane, qkv, (query, key, value))
            request.lanes[call] = lane
    spec, layout = lane.spec, lane.layout
    sinks = _hf_features.sinks_from_hf(module, kwargs, spec.num_heads)
    out = (
        lane.bound(qkv, sinks)
        if lane.bound is not None
        else lane.backend.forward(qkv, lane.plan, sinks=sinks)
    )
    batch, heads, seq, head_dim = query.shape[0], spec.num_heads, query.shape[2], query.shape[3]
    if layout.cells is None:
        return _viewed(out, (batch, seq, heads, head_dim)), None
    full = out.new_zeros(batch, seq, heads, head_dim)
    full[layout.cells] = _viewed(out, (-1, heads, head_dim))
    return full, None


def _kernel_input(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: BatchLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the backend gets: rows of one whole sequence each go batch-major, as the model
    hands them (a kernel that attends that layout reads them as they are); any other layout
    goes as token rows."""
    if layout.cells is None and not layout.segments:
        return query, key, value
    return _token_rows(query, layout), _token_rows(key, layout), _token_rows(value, layout)


def _kept(
    lane: _Lane,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    given: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> _Lane:
    """``lane`` as later calls of its key reuse it: its backend's ``forward`` bound to this
    input's signature where the backend offers that (`PrefillBackend.bind_forward`), and the
    row views of a packed batch's ``given`` q, k, v where each is one (`_rows_view`)."""
    backend, plan, layout = lane.backend, lane.plan, lane.layout
    bound = None
    if isinstance(backend, PrefillBackend) and isinstance(plan, PrefillPlan):
        bound = backend.bind_forward(qkv, plan)
    rows = None
    if layout.cells is None and layout.segments:
        q, k, v = (_rows_view(t) for t in given)
        if q is not None and k is not None and v is not None:
            rows = (q, k, v)
    if bound is None and rows is None:
        return lane
    return _Lane(lane.sources, lane.spec, layout, backend, plan, lane.served, bound, rows)


def _viewed(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The kernel's output as ``shape``: a view where its strides allow (every kernel's so
    far), else a copy. One sequence's rows gain the batch dimension whatever their strides."""
    if shape[0] == 1 and len(shape) == out.dim() + 1 and out.shape == shape[1:]:
        return out.unsqueeze(0)
    return out.view(shape) if out.is_contiguous() else out.reshape(shape)
