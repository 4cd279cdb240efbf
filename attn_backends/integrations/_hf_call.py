"""One transformers attention call, proved once per class: the hook every driver shares.

The integration's eager attention function, `GraphRunner` and `compile_ready` all serve the
same call from a transformers layer (``module, query, key, value, mask, dropout, scaling,
is_causal, **kwargs``). What that call asks for is decided here, once, for all three:

- `refuse_unsupported_call`: what no driver serves (dropout in training, attention weights,
  cross-attention, mixed head dims), refused by name;
- `layer_spec`: the `AttentionSpec` of the call. It is a value of a few cheap facts (head
  counts, head dim, dtype, scale, the causal flag the call, the module or the model's mask
  gives, the window, soft-cap and sinks kwargs, a chunked mask's chunk), so the spec is built
  once per distinct key and kept on the attention module; each later call computes the key
  and looks it up;
- `layer_selection`: the backend for a spec, kept on the attention module with the
  `decision_epoch` it was made in. A call reuses it while the registry, the RoPE pass table
  and the environment are unchanged, and asks `select` again otherwise: selection happens at
  first use, the platform is probed once per process, and nothing is probed per forward.

Everything kept lives on the module it describes (plain attributes in its ``__dict__``, never
in ``state_dict``), so two models, or two threads on one model, never read each other's
entries; the entries are immutable values, so sharing one is exact.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from .._select._selector import Selection, decision_epoch, select
from .._values._errors import IntegrationError
from .._values._platform import Platform
from .._values._spec import AttentionSpec
from . import _hf_features, _hf_mask
from ._hf_mask import MaskRequest
from ._hf_proof import CLASSES

__all__ = [
    "clear_decisions",
    "decision_epoch",
    "decisions",
    "feature_key",
    "layer_selection",
    "layer_spec",
    "refuse_unsupported_call",
]

logger = logging.getLogger("attn_backends")

_SPECS = "_attn_backends_specs"
"""The attention module's specs by call key (`_spec_key`)."""
_SELECTIONS = "_attn_backends_selections"
"""The attention module's selections by ``(spec, device, backend, platform, cuda_graph)``,
each with the `decision_epoch` it was made in."""
_KEPT = 64
"""Entries one module keeps per table: a layer sees a handful of distinct calls; a caller
that varies dtypes or heads forever must not grow it without bound."""

_decided: dict[tuple[object, ...], Selection] = {}
"""Every distinct decision served so far, for `decisions()` and the log (one per spec, device,
requested backend and chosen backend); never read to serve."""
_decided_lock = threading.Lock()


def refuse_unsupported_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    kwargs: Mapping[str, Any],
) -> None:
    """Raise `IntegrationError` for a call no driver serves: attention dropout in training,
    ``output_attentions``, q/k/v that are not ``[batch, heads, seq, head_dim]``, fewer or more
    keys than queries (cross-attention, a KV cache), or head dims that differ."""
    if dropout > 0 and module.training:
        raise IntegrationError(
            f"{type(module).__name__} runs attention dropout {dropout} in training; "
            "attn_backends serves inference only: call model.eval() or set the attention "
            "dropout to 0"
        )
    if kwargs.get("output_attentions"):
        raise IntegrationError(
            "output_attentions=True needs the attention weights, which attn_backends never "
            "materialises; use attn_implementation='eager' for that call"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise IntegrationError(
            f"{type(module).__name__} passed q/k/v of shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}; expected [batch, heads, seq, head_dim]"
        )
    q_shape, k_shape = query.shape, key.shape
    if k_shape[2] != q_shape[2] or k_shape[0] != q_shape[0]:
        raise IntegrationError(
            f"{type(module).__name__} attends {q_shape[2]} queries to {k_shape[2]} keys: "
            "cross-attention or a KV cache, which the no-cache prefill path does not serve; "
            "call the model with use_cache=False on self-attention models"
        )
    if value.shape[-1] != q_shape[-1] or k_shape[-1] != q_shape[-1]:
        raise IntegrationError(
            f"{type(module).__name__} has q/k/v head dims {q_shape[-1]}/{k_shape[-1]}/"
            f"{value.shape[-1]}; attn_backends needs one head_dim for all three"
        )


def _declared_causal(
    module: torch.nn.Module,
    is_causal: bool | None,
    request: MaskRequest | None,
    mask: torch.Tensor | None,
    proved_causal: bool | None,
) -> bool:
    """The call's flag, else the module's (untyped: not all modules define ``is_causal``),
    else the model's own mask (the hook's, a 4-D one, or what a checked batch proved of it
    for a driver that hands the layers none): transformers' eager and sdpa paths apply the
    mask they are given and read the flag only without one (then as causal)."""
    declared = is_causal if is_causal is not None else getattr(module, "is_causal", None)
    if declared is None and request is not None:
        declared = request.mask_is_causal()
    elif declared is None and isinstance(mask, torch.Tensor) and mask.dim() == 4:
        declared = _hf_mask.mask_4d_is_causal(mask, type(module).__name__)
    elif declared is None:
        declared = proved_causal
    return bool(declared if declared is not None else True)


def feature_key(kwargs: Mapping[str, Any]) -> tuple[object, ...] | None:
    """The call's feature kwargs (window, soft-cap, whether sinks come) as a value; None when
    one is of a type only the spec builder judges (it raises the named error, every time), so
    such a call is never kept."""
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    if (
        (window is not None and type(window) is not int)
        or (cap is not None and type(cap) not in (int, float))
        or kwargs.get("position_bias") is not None
    ):
        return None
    return (window, cap, kwargs.get("s_aux") is not None)


def _spec_key(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    causal: bool,
    chunk: int | None,
    kwargs: Mapping[str, Any],
) -> Hashable | None:
    """The facts the spec is made of, as a value (None: build it every time)."""
    features = feature_key(kwargs)
    if features is None:
        return None
    heads = (query.shape[1], key.shape[1], query.shape[3], query.dtype)
    return (*heads, scaling if scaling is None else float(scaling), causal, chunk, *features)


def _build_spec(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    causal: bool,
    chunk: int | None,
    kwargs: Mapping[str, Any],
) -> AttentionSpec:
    features = _hf_features.hf_features(module, kwargs, causal=causal)
    return AttentionSpec(
        num_heads=int(query.shape[1]),
        num_kv_heads=int(key.shape[1]),
        head_dim=int(query.shape[-1]),
        dtype=query.dtype,
        causal=causal,
        rope=None,  # the model rotated q and k before calling attention
        softmax_scale=None if scaling is None else float(scaling),
        chunk_size=chunk,  # from the mask this layer was handed (the hook read it)
        **features,  # type: ignore[arg-type]
    )


def _table(module: torch.nn.Module, name: str) -> dict[Hashable, Any]:
    table: dict[Hashable, Any] | None = module.__dict__.get(name)
    if table is None or len(table) >= _KEPT:
        table = {}
        module.__dict__[name] = table  # replaced whole: a reader holds the old dict intact
    return table


def keep(module: torch.nn.Module, name: str, key: Hashable, value: object) -> None:
    """Keep ``value`` under ``key`` in ``module``'s table ``name`` (at most `_KEPT` entries;
    a full table is replaced whole, so a reader holds the old one intact)."""
    _table(module, name)[key] = value


def layer_spec(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: Mapping[str, Any],
    request: MaskRequest | None = None,
    mask: torch.Tensor | None = None,
    *,
    proved_causal: bool | None = None,
) -> AttentionSpec:
    """The `AttentionSpec` of one attention call of ``module``: ``causal`` is ``is_causal``
    when given, else ``module.is_causal``, else what the model's mask (``request``, or a 4-D
    ``mask``, or for a driver that hands the layers no mask ``proved_causal``, what a checked
    batch proved) says; a chunked mask's chunk comes from ``request``. Built once per distinct
    call key and kept on the module."""
    causal = _declared_causal(module, is_causal, request, mask, proved_causal)
    chunk = request.chunk_size if request is not None else None
    call = _spec_key(query, key, scaling, causal, chunk, kwargs)
    if call is None:
        return _build_spec(module, query, key, scaling, causal, chunk, kwargs)
    specs: dict[Hashable, AttentionSpec] | None = module.__dict__.get(_SPECS)
    found = specs.get(call) if specs is not None else None
    if found is None:
        found = _build_spec(module, query, key, scaling, causal, chunk, kwargs)
        _table(module, _SPECS)[call] = found
    return found


def layer_selection(
    module: torch.nn.Module,
    spec: AttentionSpec,
    device: torch.device,
    backend: str | None,
    *,
    epoch: tuple[object, ...] | None = None,
    platform: Platform | str | None = None,
    cuda_graph: bool = False,
) -> Selection:
    """`select`'s decision for ``spec`` on ``device``, kept on ``module`` while the
    `decision_epoch` (``epoch``, read once per forward by the caller, or here) is unchanged."""
    now = epoch if epoch is not None else decision_epoch()
    key = (spec, device, backend, platform, cuda_graph)
    kept: dict[Hashable, tuple[tuple[object, ...], Selection]] | None = module.__dict__.get(
        _SELECTIONS
    )
    entry = kept.get(key) if kept is not None else None
    if entry is not None and entry[0] == now:
        return entry[1]
    found = select(spec, device=device, backend=backend, platform=platform, cuda_graph=cuda_graph)
    _table(module, _SELECTIONS)[key] = (now, found)
    _log_decision(found, spec, device, backend, module)
    return found


def decisions() -> list[Selection]:
    """The backend decisions served so far (one per spec, device, requested backend and
    chosen backend): ``[s.name for s in decisions()]`` says which backend served a model."""
    with _decided_lock:
        return list(_decided.values())


def clear_decisions() -> None:
    """Forget the decisions `decisions` reports; the next one of each is logged again."""
    with _decided_lock:
        _decided.clear()


def _log_decision(
    found: Selection,
    spec: AttentionSpec,
    device: torch.device,
    backend: str | None,
    module: torch.nn.Module,
) -> None:
    key = (spec, device, backend, found.name)
    with _decided_lock:
        new = key not in _decided
        _decided[key] = found
    if new:
        logger.info(
            "attn_backends: %s on %s served by %s (causal=%s, window=%s, logit_softcap=%s, "
            "chunk_size=%s, %d/%d heads, head_dim %d, %s)",
            type(module).__name__,
            device,
            found.name,
            spec.causal,
            spec.window.describe() if spec.window is not None else None,
            spec.logit_softcap,
            spec.chunk_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            str(spec.dtype).removeprefix("torch."),
        )


def clear_kept(model: torch.nn.Module) -> None:
    """Drop the specs, selections and classes of call kept on ``model``'s attention modules:
    the next call of each is built and selected again (after replacing a mapping this module
    uses, in tests)."""
    for module in model.modules():
        for name in (_SPECS, _SELECTIONS, CLASSES):
            module.__dict__.pop(name, None)
