"""Pack the backbone of a model whose head reads fixed positions (cross-encoders).

sentence-transformers never flattens a ``sequence-classification`` or ``text-generation``
model: its head reads the first token of each row (BERT's pooler, RoBERTa's classification
head), the last real token (decoder rerankers), or pools over the mask (ModernBERT), so a
single packed row would hand it the wrong positions. The layers in front of the head are what
costs, so `BackbonePacking` packs exactly those: a pre-hook on the backbone
(``model.base_model``) turns the padded ``[B, S]`` batch into one row with ``cu_seq_lens`` and
restarting positions, the backbone runs with no padding in any layer, and a hook on its output
puts each token's hidden state back in its ``[B, S]`` cell (zeros in padding) and recomputes a
pooler output from them. The head then reads the tensor it reads on the padded path.

Positions restart at ``position_offset`` per sequence (``padding_idx + 1`` for RoBERTa-style
embeddings): what a right-padded batch gives every model, and, for rotary models, the same
relative positions as a left-padded one.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .._values._errors import IntegrationError
from ._packed import check_served

__all__ = ["BackbonePacking"]


@dataclass(frozen=True)
class _Packed:
    valid: torch.Tensor
    """``[B, S]`` bool: the cells that hold a token."""
    cu_seq_lens: torch.Tensor


class BackbonePacking:
    """The two hooks on one backbone module; `attach` registers them."""

    def __init__(self, backbone: torch.nn.Module, position_offset: int) -> None:
        self.backbone = backbone
        self.position_offset = position_offset
        self._names = [
            name
            for name, p in inspect.signature(backbone.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._pending = threading.local()

    def attach(self) -> None:
        self.backbone.register_forward_pre_hook(self.pack, with_kwargs=True)
        self.backbone.register_forward_hook(self.unpack, with_kwargs=True)

    def _stack(self) -> list[_Packed | None]:
        stack: list[_Packed | None] | None = getattr(self._pending, "stack", None)
        if stack is None:
            stack = []
            self._pending.stack = stack
        return stack

    def pack(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pre-hook: the padded batch as one packed row (every argument passed by name)."""
        if len(args) > len(self._names):
            raise IntegrationError(
                f"{type(module).__name__} got {len(args)} positional arguments; attn_backends "
                "packs calls that name their inputs"
            )
        call = dict(zip(self._names, args, strict=False)) | kwargs
        input_ids = call.get("input_ids")
        mask = call.get("attention_mask")
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or call.get("inputs_embeds") is not None
            or call.get("past_key_values") is not None
            or "cu_seq_lens_q" in call
        ):
            self._stack().append(None)  # not a padded token batch: served as it comes
            return (), call
        valid = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if mask is None
            else mask.to(dtype=torch.bool)
        )
        if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
            raise IntegrationError(
                f"{type(module).__name__}: attention mask of shape {tuple(mask.shape)} for "
                f"input_ids {tuple(input_ids.shape)}; pass the 2-D [batch, seq] padding mask"
            )
        lengths = valid.sum(dim=1)
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
        cu[1:] = lengths.cumsum(0)
        tokens = int(cu[-1])
        starts = torch.repeat_interleave(cu[:-1].long(), lengths, output_size=tokens)
        positions = call.get("position_ids")
        if isinstance(positions, torch.Tensor):
            positions = positions.expand_as(input_ids)[valid][None]
        else:
            arange = torch.arange(tokens, device=lengths.device)
            positions = (arange - starts + self.position_offset)[None]
        longest = int(lengths.max())
        call |= {
            "input_ids": input_ids[valid][None],
            "attention_mask": None,
            "position_ids": positions,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }
        token_types = call.get("token_type_ids")
        if isinstance(token_types, torch.Tensor):
            call["token_type_ids"] = token_types.expand_as(input_ids)[valid][None]
        self._stack().append(_Packed(valid, cu))
        return (), call

    def unpack(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        """Forward hook: the hidden states back in their ``[B, S]`` cells, the pooler rerun."""
        packed = self._stack().pop()
        if packed is None:
            return output
        if isinstance(output, tuple):
            raise IntegrationError(
                f"{type(module).__name__} returned a tuple; attn_backends packs backbones that "
                "return a ModelOutput (call them with return_dict=True)"
            )
        first = next(iter(output.keys()))  # last_hidden_state, a ModelOutput's first field
        check_served(output[first], packed.cu_seq_lens)  # refuses boundaries nothing read
        output[first] = _repad(output[first], packed.valid)
        if output.get("hidden_states") is not None:
            output["hidden_states"] = tuple(_repad(h, packed.valid) for h in output.hidden_states)
        if output.get("pooler_output") is not None:
            # transformers' BERT-family backbones pool in a ``pooler`` submodule (untyped).
            pooler = getattr(module, "pooler", None)
            if not isinstance(pooler, torch.nn.Module):
                raise IntegrationError(
                    f"{type(module).__name__} returns a pooled output but has no `pooler` to "
                    "recompute it per sequence; attn_backends cannot pack this model's backbone"
                )
            output["pooler_output"] = pooler(output[first])
        return output


def _repad(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``hidden [1, T, C]`` back into ``[B, S, C]``: token ``t`` in the ``t``-th valid cell."""
    full = hidden.new_zeros(*valid.shape, hidden.shape[-1])
    full[valid] = hidden[0]
    return full
