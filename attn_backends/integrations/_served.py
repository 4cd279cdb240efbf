"""After a packed forward: were its sequence boundaries read by the attention layers?

`transformers.unpack_hidden` refuses a packed output whose ``cu_seq_lens`` no attention layer
served: the model let its sequences attend to each other. A batch of one sequence has no
boundary to cross (the integration reads it as a plain row and marks nothing), so only
batches of several sequences are checked.
"""

from __future__ import annotations

import torch

from .transformers import unpack_hidden

__all__ = ["check_served"]


def check_served(hidden: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """Raise the integration's `IntegrationError` when a packed batch of several sequences
    reached no attention layer as packed."""
    if cu_seq_lens.numel() > 2:  # shape only: no device sync
        unpack_hidden(hidden, cu_seq_lens)
