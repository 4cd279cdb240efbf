"""A spec's sliding window, logit soft-cap and ALiBi as arguments of aiter's CK op
``mha_varlen_fwd``, which takes all three (read from amd-aiter's source, not run on ROCm).

The op follows FlashAttention's conventions (py_itfs_ck/mha_varlen_fwd_kernels.cu):

* ``window_size_left`` / ``window_size_right``: query ``i`` sees keys ``i - left .. i + right``
  (bottom-right aligned, which for a no-cache prefill, where Q and K have one length, is the
  diagonal); ``-1`` is unbounded and ``is_causal`` forces ``right = 0``. The spec's
  `SlidingWindow` counts the same way, so its bounds go unchanged.
* ``logits_soft_cap``: ``cap * tanh(scale * q.k / cap)`` with CK's default soft-cap formula
  (``CK_TILE_ATTENTION_LOGITS_SOFT_CAP_DEFAULT`` = 0, tanh, as aiter builds it unless that
  variable is set: 1 builds a softsign formula, which is refused here).
* ``alibi_slopes``: float32 ``[Hq]`` on Q's device, read through a float pointer. CK adds
  ``-slope * |i - j|`` to the scaled score, or ``slope * j`` for a causal mask without a window;
  both give the spec's softmax. The order of ALiBi and the soft-cap inside CK's pipeline is not
  documented, so the two together are not declared.
"""

from __future__ import annotations

import functools
import os

import torch

from attn_backends import AttentionSpec
from attn_backends.plugin import Reason, ReasonCode

SOFTCAP_FORMULA_ENV = "CK_TILE_ATTENTION_LOGITS_SOFT_CAP_DEFAULT"
"""Chooses CK's soft-cap formula when aiter builds its kernels: 0 (or unset) tanh, 1 softsign."""


def feature_settings(spec: AttentionSpec, device: torch.device) -> dict[str, object]:
    """The ``mha_varlen_fwd`` keywords that carry the spec's features (none for a plain spec)."""
    settings: dict[str, object] = {}
    if spec.window is not None:
        settings["window_size_left"] = int(spec.window.left)
        settings["window_size_right"] = int(spec.window.right)
    if spec.logit_softcap is not None:
        settings["logits_soft_cap"] = float(spec.logit_softcap)
    if spec.alibi is not None:
        settings["alibi_slopes"] = alibi_slopes(spec.alibi.slopes_for(spec.num_heads), device)
    return settings


@functools.lru_cache(maxsize=64)
def alibi_slopes(slopes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """float32 ``[Hq]`` slopes on ``device``, made once per slopes and device; aiter only
    reads them."""
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def feature_reasons(spec: AttentionSpec) -> list[Reason]:
    """What the CK op cannot serve of the spec's features: none on FP8 (its entry point is
    another function, not wired for them), and a soft-cap when aiter would build softsign."""
    features = [
        (code, field)
        for code, field, present in (
            (ReasonCode.SLIDING_WINDOW, "window", spec.window is not None),
            (ReasonCode.SOFTCAP, "logit_softcap", spec.logit_softcap is not None),
            (ReasonCode.ALIBI, "alibi", spec.alibi is not None),
        )
        if present
    ]
    reasons = [
        Reason(
            code,
            "aiter's FP8 varlen entry point is not wired for windows, soft-capping or ALiBi",
            field,
            "set with an FP8 dtype",
            "None, or a float16/bfloat16 dtype",
        )
        for code, field in features
        if spec.is_fp8
    ]
    formula = os.environ.get(SOFTCAP_FORMULA_ENV, "0").strip()
    if spec.logit_softcap is not None and not spec.is_fp8 and formula != "0":
        reasons.append(
            Reason(
                ReasonCode.SOFTCAP,
                f"{SOFTCAP_FORMULA_ENV}={formula} makes aiter build CK's softsign soft-cap, "
                "not the tanh one the spec means",
                SOFTCAP_FORMULA_ENV,
                formula,
                "unset or 0",
            )
        )
    return reasons
