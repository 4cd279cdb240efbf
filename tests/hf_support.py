"""What the Hugging Face tests share: how a tiny model gets its weights, how it is run, and how
far from the model's own eager attention a served result may land.

One rule for every HF test, kept in one place so the tests cannot drift apart: weights are
seeded and scaled up until attention is far from uniform (a wrong scale, mask or window then
shows in the output), and the tolerance is the model's own sdpa-vs-eager spread on the same
input, times a small factor the caller names, plus a floor of a few units in the last place.

Import it only after ``pytest.importorskip("transformers")``: it imports transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import transformers


def randomize(model: torch.nn.Module, seed: int = 3) -> None:
    """Seeded weights large enough that attention is far from uniform (a wrong mask shows):
    matrices at 1.5 / sqrt(fan-in), norm weights near one, other vectors near zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])))
            elif "norm" in name.lower():
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def from_config(cfg: Any, impl: str = "eager", seed: int = 3) -> Any:
    """``AutoModel`` built from ``cfg`` under ``impl``, randomized with ``seed``, in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=impl)
    randomize(model, seed)
    return model.eval()


def run(model: Any, impl: str, **inputs: Any) -> torch.Tensor:
    """The model's last hidden state under attention implementation ``impl``."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        hidden: torch.Tensor = model(**inputs).last_hidden_state
        return hidden


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (norms, not maxima: a bf16 maximum is one rounding step of
    the largest value and hides a real error)."""
    return float((got - want).norm() / want.norm())


def random_ids(rows: int, cols: int, *, vocab: int, seed: int = 0) -> torch.Tensor:
    """Seeded token ids in ``[3, vocab)`` (clear of the usual pad/bos/eos ids)."""
    return torch.randint(3, vocab, (rows, cols), generator=torch.Generator().manual_seed(seed))


def padded(
    seqs: list[list[int]], pad_id: int, *, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, longest]`` token ids of ``seqs`` padded with ``pad_id`` on the right (or the
    left), and the 0/1 attention mask that marks their tokens."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return ids, mask


def valid_positions(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The positions that hold tokens: the attention mask where there is one, else all."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.bool()
    ids: torch.Tensor = inputs["input_ids"]
    return torch.ones(ids.shape, dtype=torch.bool)


def eager_and_sdpa_spread(
    model: Any, valid: torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor, float]:
    """HF eager on the valid positions, and HF's own sdpa-vs-eager relative error there."""
    eager = run(model, "eager", **inputs)[valid]
    sdpa = run(model, "sdpa", **inputs)[valid]
    return eager, relative_error(sdpa, eager)


def spread_tolerance(
    spread: float, *, factor: float, dtype: torch.dtype = torch.float32, floor_ulps: float = 1.0
) -> float:
    """The distance allowed from eager: ``factor`` times HF's own spread, plus ``floor_ulps``
    units in the last place of ``dtype`` (a spread of zero must not demand bit equality)."""
    return factor * spread + floor_ulps * torch.finfo(dtype).eps
