"""How each aiter entry point is called: decided once per function from the parameter list
the installed aiter declares.

aiter changes these lists between releases: ``sink_size`` became required in
``mha_varlen_fwd`` in 0.1.8, and the FP8 entry point took ``q_descale, k_descale, v_descale``
at positions 4-6 in 0.1.7.post3. So nothing is sent by position: the backends pass what the
spec fixes (`ESSENTIAL`), the switches the function has (`SETTINGS`) and, for FP8, the descales
where it takes them, all by keyword. A required parameter they do not know is refused at
``prepare`` with its name and the aiter version, never left to fail at forward.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from attn_backends.errors import BackendFailure

from ._aiter_signature import SignatureSource, installed_version, read_signature

AITER_RELEASES_CHECKED = "0.1.7 to 0.1.20.post1"
"""The amd-aiter releases whose Python and C++ source these backends were written against."""

EntryPoint = Literal["fmha_v3_varlen_fwd", "mha_varlen_fwd", "flash_attn_varlen_fp8_pertensor_func"]
"""aiter functions the backends call.

* ``fmha_v3_varlen_fwd``: the hand-written ASM kernels, the function ``flash_attn_varlen_func``
  itself calls when its ASM test passes.
* ``mha_varlen_fwd``: the CK kernels, what ``flash_attn_varlen_func`` calls otherwise. It has no
  switch to skip ASM for bf16 d128, so the non-ASM backend calls this op directly.
* ``flash_attn_varlen_fp8_pertensor_func``: the FP8 varlen entry point.
"""

FP8_ENTRY: EntryPoint = "flash_attn_varlen_fp8_pertensor_func"

BF16_ROUNDING_RTNA = 1
"""``how_v3_bf16_cvt``: bf16 output rounding of the gfx942 ASM kernels (0 RTNE, 1 RTNA, 2 RTZ);
1 is what ``flash_attn_varlen_func`` passes by default. gfx950 ignores it."""

BATCH_PARAMETERS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
ESSENTIAL: dict[EntryPoint, tuple[str, ...]] = {
    "fmha_v3_varlen_fwd": (*BATCH_PARAMETERS, "softmax_scale", "is_causal"),
    "mha_varlen_fwd": (*BATCH_PARAMETERS, "softmax_scale", "is_causal"),
    FP8_ENTRY: (*BATCH_PARAMETERS, "softmax_scale", "causal"),
}
"""Parameters without which a call cannot mean what the spec says: an entry point that lacks
one is refused."""

SETTINGS: dict[str, object] = {
    "min_seqlen_q": 0,
    "dropout_p": 0.0,
    "logits_soft_cap": 0.0,
    "zero_tensors": False,
    "window_size_left": -1,
    "window_size_right": -1,
    "sink_size": 0,
    "return_softmax_lse": False,
    "return_dropout_randval": False,
    "how_v3_bf16_cvt": BF16_ROUNDING_RTNA,
    "alibi_slopes": None,
}
"""Arguments sent to an entry point that has the parameter: each switches a feature off (no
dropout, soft cap, window, attention sink, ALiBi or extra outputs), except ``how_v3_bf16_cvt``,
aiter's own default rounding. A spec's window, soft cap and ALiBi replace their defaults
(`_aiter_features`). aiter type-checks op arguments with isinstance (aiter/jit/core.py
``check_args``), so each value has the declared Python type."""

DESCALES = ("q_descale", "k_descale", "v_descale")

GENERATIONS: dict[EntryPoint, tuple[str, str, str]] = {
    "mha_varlen_fwd": ("sink_size", "0.1.8", "sink_size=0"),
    FP8_ENTRY: (
        "q_descale",
        "0.1.7.post3",
        "q/k/v descales as float32 [1] tensors on Q's device",
    ),
}
"""Per entry point: the parameter that marks the newer generation, its first release, and what
the backends send for it. Without it (and for ``fmha_v3_varlen_fwd``) the call is 0.1.7's."""


@dataclass(frozen=True)
class EntryBinding:
    """How one aiter entry point is called, read once from the installed aiter."""

    entry: EntryPoint
    aiter_version: str
    parameters: tuple[str, ...]
    """The entry point's parameters, in declared order."""
    read_from: SignatureSource
    """Compiled ops take ``(*args, **kwargs)`` in Python: theirs come from aiter/ops/mha.py."""
    keywords: tuple[str, ...]
    """Every argument the backends send, all by keyword."""
    descales: bool
    """FP8 scales go to aiter as ``q/k/v_descale``; otherwise they are folded (0.1.7 FP8)."""

    @property
    def generation(self) -> str:
        """The first aiter release whose parameter list this call matches."""
        marker = GENERATIONS.get(self.entry)
        return marker[1] if marker is not None and marker[0] in self.parameters else "0.1.7"

    def describe(self) -> str:
        marker = GENERATIONS.get(self.entry)
        sends = f"; {marker[2]}" if marker is not None and marker[0] in self.parameters else ""
        return (
            f"{self.entry} of amd-aiter {self.aiter_version}, parameters as in {self.generation} "
            f"and later (read via {self.read_from}){sends}"
        )


def bind_entry(entry: EntryPoint, kernel: Callable[..., Any]) -> EntryBinding:
    """Decide the keywords for ``entry`` from its declared parameters, or refuse with the one
    that stops it. ``kernel`` is ``Any``-typed because aiter ships no type information."""
    version = installed_version()
    signature, read_from = read_signature(kernel, entry)
    params = signature.parameters
    where = f"aiter {version}'s {entry}"
    advice = (
        f"the aiter backends know amd-aiter {AITER_RELEASES_CHECKED}; install one of those or "
        "pick another backend with backend=..."
    )
    for name in ESSENTIAL[entry]:
        if name not in params:
            raise BackendFailure(f"{where} has no parameter {name!r}; {advice}")
    present = [name for name in DESCALES if name in params]
    descales = entry == FP8_ENTRY and bool(present)
    if descales and len(present) != len(DESCALES):
        raise BackendFailure(f"{where} takes {', '.join(present)} but not all three; {advice}")
    keywords = (
        *ESSENTIAL[entry],
        *(name for name in SETTINGS if name in params),
        *(DESCALES if descales else ()),
    )
    for name, param in params.items():
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and name not in keywords:
            raise BackendFailure(
                f"{where} requires parameter {name!r}, which these backends cannot set; {advice}"
            )
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as exc:
        raise BackendFailure(f"{where} cannot be called by keyword ({exc}); {advice}") from exc
    return EntryBinding(entry, version, tuple(params), read_from, keywords, descales)


_BOUND: dict[EntryPoint, tuple[Callable[..., Any], EntryBinding]] = {}
"""Last binding per entry point, with the function object it was read from: a different object
(another aiter, a wrapper) is read again. Only the binding is cached, never a batch."""
_bound_lock = threading.Lock()


def binding_for(entry: EntryPoint, kernel: Callable[..., Any]) -> EntryBinding:
    with _bound_lock:
        cached = _BOUND.get(entry)
    if cached is not None and cached[0] is kernel:
        return cached[1]
    binding = bind_entry(entry, kernel)  # outside the lock: it may read aiter's source file
    with _bound_lock:
        _BOUND[entry] = (kernel, binding)
    return binding


def last_binding(entry: EntryPoint) -> EntryBinding | None:
    """The binding the last ``prepare`` made for ``entry`` in this process, if any."""
    with _bound_lock:
        cached = _BOUND.get(entry)
    return None if cached is None else cached[1]


def clear_bindings() -> None:
    """Forget every binding: the next ``prepare`` reads aiter's signatures again (an aiter
    upgraded or reloaded in process, tests)."""
    with _bound_lock:
        _BOUND.clear()
