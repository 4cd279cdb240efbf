"""sentence-transformers' own flattening path, switched on for this library's attention.

sentence-transformers can skip padding: its ``Transformer`` module concatenates a text batch
into one row with transformers' ``DataCollatorWithFlattening`` (``input_ids``/``position_ids``
``[1, T]`` restarting per text, ``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/
``max_length_k``), lets those keys through its forward-kwargs filter, shifts the positions of
RoBERTa-style models by ``padding_idx + 1``, and its pooling reads the flat output by
``cu_seq_lens_q`` (mean, CLS, last token, prompt exclusion). It turns all of that on only when
the attention implementation's name says "flash" and a flash varlen function can be imported
(``Transformer._can_flatten_inputs``), although the attention function this library registers
serves exactly those kwargs.

`enable_flattening` checks sentence-transformers' other prerequisites and sets the module up as
that method does once its flash checks pass: the same collator's output (`_st_collator`
builds it without per-token Python work), the same filter keys, the module's own
position-offset inference. Everything after that (tokenising without padding,
the length-interleaved batch order, pooling, normalisation, prompts, truncation) is
sentence-transformers' own code. Built against sentence-transformers 6.2; ``tests/
test_sentence_transformers.py`` fails if a later release moves these attributes.

A batch of one input is not flattened (`_single_input`): it holds no padding to drop.

One output needs the padded batch: sentence-transformers' inference loop cuts per-text token
embeddings (``output_value="token_embeddings"``, and the per-text dicts of ``None``) by the
batch's ``attention_mask``, which a flattened batch has not, so those calls fail inside it
(``KeyError: 'attention_mask'``) on its own flash path too. `padded_batches` makes the calls
inside it tokenise padded, for the current thread or task only (a context variable, read by
the module's ``_should_flatten_inputs``), so they return exactly the padded path's output
through this library's attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from .._values._errors import IntegrationError

__all__ = ["FLATTENED_KWARGS", "enable_flattening", "flattening_problems", "padded_batches"]

_padded: ContextVar[bool] = ContextVar("attn_backends_st_padded", default=False)

FLATTENED_KWARGS = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
)
"""What the collator adds that a model forward takes through ``**kwargs`` only."""

_FLATTENING_TASKS = ("feature-extraction", "fill-mask")


def flattening_problems(transformer: Any) -> list[str]:
    """Why sentence-transformers' flattening cannot serve this ``Transformer`` module (its own
    conditions, less the flash-attention ones); empty when it can."""
    problems: list[str] = []
    if transformer.transformer_task not in _FLATTENING_TASKS:
        problems.append(
            f"transformer_task {transformer.transformer_task!r} (flattening serves "
            f"{' and '.join(_FLATTENING_TASKS)}: other heads read fixed positions)"
        )
    if "text" not in transformer.modality_config:
        problems.append("the module takes no plain text modality")
    if transformer.backend != "torch":
        problems.append(f"backend {transformer.backend!r} (only 'torch' runs this attention)")
    methods = sorted({str(p["method"]) for p in transformer.modality_config.values()})
    if methods != ["forward"]:
        problems.append(f"modality methods {methods} (flattening needs 'forward' for all)")
    if transformer.unpad_inputs is False:
        problems.append("unpad_inputs=False asks for padded batches")
    return problems


def enable_flattening(transformer: Any) -> None:
    """Make sentence-transformers flatten this module's text batches, as it does for flash
    attention; `IntegrationError` names what stands in the way."""
    problems = flattening_problems(transformer)
    if problems:
        raise IntegrationError(
            "sentence-transformers cannot flatten the batches of this model: "
            + "; ".join(problems)
            + ". Use the model as it is (padded batches through attn_backends) or fix the above"
        )
    from ._st_collator import FlatteningCollator

    # As sentence-transformers configures it for flash attention (Transformer._can_flatten_inputs),
    # with the collator's output built in tensor operations (`_st_collator`).
    transformer.data_collator = FlatteningCollator(  # type: ignore[no-untyped-call]
        return_seq_idx=True, return_flash_attn_kwargs=True, return_position_ids=True
    )
    if transformer.model_forward_params is not None:
        transformer.model_forward_params |= FLATTENED_KWARGS
    transformer._flatten_position_offset = transformer._infer_flatten_position_offset()
    transformer.can_flatten_inputs = True
    should_flatten = transformer._should_flatten_inputs  # the bound method of its class

    def flatten_unless_padded(
        modality: Any, processor_inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> bool:
        if _padded.get() or _single_input(modality, processor_inputs):
            return False
        return bool(should_flatten(modality, processor_inputs, *args, **kwargs))

    transformer._should_flatten_inputs = flatten_unless_padded


def _single_input(modality: Any, processor_inputs: dict[str, Any]) -> bool:
    """Whether the batch holds one input: its padded batch has no padding, so it runs as it
    is (one whole row) and skips the flattening's collator, packed-sequence search and flat
    pooling, which buy nothing for one sequence."""
    inputs = processor_inputs.get(modality) if isinstance(modality, str) else None
    return isinstance(inputs, list) and len(inputs) == 1


@contextlib.contextmanager
def padded_batches() -> Iterator[None]:
    """Tokenise padded, not flattened, inside this block (this thread or task only)."""
    token = _padded.set(True)
    try:
        yield
    finally:
        _padded.reset(token)
