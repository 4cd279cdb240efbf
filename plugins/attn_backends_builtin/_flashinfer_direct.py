"""flashinfer's ragged prefill kernel called with the argument list its plan fixed.

``BatchPrefillWithRaggedKVCacheWrapper.run`` works out on every call what ``plan`` already
fixed (the softmax scale, the mask mode, the planned buffers, the PDL flag, the ALiBi slopes
buffer), checks the call's dtypes and rows, then passes it all with q, k, v and a new output to
the compiled module's ``ragged_run``. A plan's `DirectRun` builds the list once per batch; each
call allocates the output and calls ``ragged_run``. On an H100 host that took the kernel call's
host time from 36 to 24 µs per layer (docs/hardware-verification.md, 2026-12-08). The contract
has checked what ``run`` checks (dtypes from the spec, the rows from the plan's lengths) before
any call reaches the kernel.

The list is flashinfer's own arrangement, not its public API, so it is used only where it is
known and proved:

- a release whose ``run`` was read for it (`READ_RELEASES`), the fa2 or fa3 implementation with
  no JIT variant and no custom mask, and every attribute the list reads present;
- not while flashinfer's API logging or trace dumps are on (``FLASHINFER_LOGLEVEL``,
  ``FLASHINFER_TRACE_DUMP``): they record each ``run`` call, so ``run`` keeps running;
- proved once per process and kernel module: the first call runs both ``run`` and the direct
  call on the same input and compares them bit for bit. A difference or an error keeps ``run``
  for that module from then on, and a warning says so. A call made while a CUDA graph is being
  captured, or under torch's sync debug mode, proves nothing (the comparison reads the device)
  and runs ``run``; a later call proves it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

READ_RELEASES = frozenset({"0.7.0.post1", "0.7.1", "0.7.2", "0.7.4"})
"""flashinfer releases whose ``BatchPrefillWithRaggedKVCacheWrapper.run`` builds the
``ragged_run`` argument list `direct_run` builds (the same list in each)."""

SERVED = frozenset({"fa2", "fa3"})
"""The implementations whose ``run`` ends in ``ragged_run`` with that list."""

QUIET = ("", "0")
"""Values of flashinfer's logging and trace-dump variables that leave them off."""

RowsRun = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q, k, v) -> out``: a plan's way to run its kernel on one layer's rows."""

logger = logging.getLogger("attn_backends")

_verdicts: dict[Hashable, bool] = {}
"""Per kernel module (`plan_run`'s ``key``): whether the direct call equalled ``run``."""
_lock = threading.Lock()
"""Guards `_verdicts` and `_said`."""


class DirectRun:
    """``ragged_run`` with the plan's arguments around one call's q, k, v and new output."""

    __slots__ = ("_head", "_indptrs", "_kernel", "_out_dtype", "_tail")

    def __init__(
        self,
        kernel: Callable[..., object],
        head: tuple[object, ...],
        indptrs: tuple[object, ...],
        tail: tuple[object, ...],
        out_dtype: torch.dtype,
    ) -> None:
        self._kernel = kernel
        self._head = head
        self._indptrs = indptrs
        self._tail = tail
        self._out_dtype = out_dtype

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            (q.shape[0], q.shape[1], v.shape[2]), dtype=self._out_dtype, device=q.device
        )
        self._kernel(*self._head, q, k, v, *self._indptrs, out, None, *self._tail)
        return out


class ProvingRun:
    """A plan's run while its kernel module is unproved: ``run``, and on the first call that
    can read the device, the direct call too, compared bit for bit (`_prove`)."""

    __slots__ = ("_direct", "_key", "_wrapper")

    def __init__(self, wrapper: Any, direct: DirectRun, key: Hashable) -> None:
        self._wrapper = wrapper
        self._direct = direct
        self._key = key

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        verdict = _verdicts.get(self._key)
        if verdict is True:
            return self._direct(q, k, v)
        expected: torch.Tensor = self._wrapper.run(q, k, v)
        if verdict is None and _may_read(q.device):
            _prove(self._key, self._direct, expected, q, k, v)
        return expected


def plan_run(wrapper: Any, key: Hashable, heads: int, head_dim: int, pdl: bool) -> RowsRun:
    """How a freshly planned ``wrapper`` runs its layers: the direct call where its module is
    proved, a `ProvingRun` where it is not yet, else ``wrapper.run``. ``key`` names the kernel
    module (the plan's JIT module); ``heads`` and ``head_dim`` are the query heads and their
    size; ``pdl`` is flashinfer's programmatic-dependent-launch flag for the device (``run``
    sets it on sm90 and later)."""
    verdict = _verdicts.get(key)
    direct = direct_run(wrapper, heads, head_dim, pdl) if verdict is not False else None
    if direct is None:
        return wrapper.run  # type: ignore[no-any-return]  # untyped library object
    if verdict is True:
        return direct
    return ProvingRun(wrapper, direct, key)


def direct_run(wrapper: Any, heads: int, head_dim: int, pdl: bool) -> DirectRun | None:
    """`DirectRun` for a planned ``wrapper``, or None where its ``run`` must stay (see the
    module: another release or implementation, a variant, logging on, an attribute missing)."""
    flashinfer = sys.modules.get("flashinfer")
    utils = sys.modules.get("flashinfer.utils")
    if flashinfer is None or utils is None:
        _say_once("flashinfer and flashinfer.utils are not both loaded")
        return None
    try:
        release = flashinfer.__version__
        if release not in READ_RELEASES:
            _say_once(f"flashinfer {release} is not a release whose run was read for it")
            return None
        for variable in ("FLASHINFER_LOGLEVEL", "FLASHINFER_TRACE_DUMP"):
            if os.environ.get(variable, "0") not in QUIET:
                _say_once(f"{variable} is on, and it records each run call")
                return None
        return _built(wrapper, utils, heads, head_dim, pdl)
    except AttributeError as exc:  # a library or wrapper without what the list reads
        _say_once(f"flashinfer or its planned wrapper lacks {exc.name or exc}")
        return None


_said: set[str] = set()


def _say_once(reason: str) -> None:
    """One INFO line per reason and process: why plans call ``run`` (never silent)."""
    with _lock:
        if reason in _said:
            return
        _said.add(reason)
    logger.info(
        "flashinfer: plans call BatchPrefillWithRaggedKVCacheWrapper.run per layer, not the "
        "direct ragged_run call: %s",
        reason,
    )


def _built(wrapper: Any, utils: Any, heads: int, head_dim: int, pdl: bool) -> DirectRun | None:
    """The list ``run`` builds for a 16-bit q, k and v without LSE, scales or NVFP4 factors."""
    if (
        wrapper._backend not in SERVED
        or wrapper._jit_module is not None
        or wrapper._custom_mask_buf is not None
        or wrapper._variant_owns_mask
        or wrapper._cached_module is None
    ):
        return None
    mask = utils.MaskMode.CAUSAL if wrapper._causal else utils.MaskMode.NON_CAUSAL
    soft_cap = wrapper._logits_soft_cap
    sm_scale = wrapper._sm_scale
    rope_scale = wrapper._rope_scale
    rope_theta = wrapper._rope_theta
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)  # as run derives it from q's head dim
    out_dtype = wrapper._cached_o_data_type
    if out_dtype is None or out_dtype.itemsize == 1:
        return None  # run picks the dtype from q then
    head = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._plan_info)
    indptrs = (wrapper._qo_indptr_buf, wrapper._kv_indptr_buf)
    tail = (
        mask.value,
        utils.TensorLayout[wrapper._kv_layout].value,
        wrapper._window_left,
        pdl,
        wrapper._custom_mask_buf,
        wrapper._mask_indptr_buf,
        utils._get_cache_alibi_slopes_buf(heads, wrapper.device),
        wrapper._prefix_len_ptr,
        wrapper._token_pos_in_items_ptr,
        wrapper._max_item_len_ptr,
        0.0 if soft_cap is None else soft_cap,
        sm_scale,
        1.0 if rope_scale is None else rope_scale,
        1e4 if rope_theta is None else rope_theta,
        wrapper._token_pos_in_items_len,
        None,  # k_sf: no NVFP4 keys
        None,  # v_sf
    )
    return DirectRun(wrapper._cached_module.ragged_run, head, indptrs, tail, out_dtype)


def _may_read(device: torch.device) -> bool:
    """Whether this call may read the device to compare outputs: not while a CUDA graph is
    captured, nor under torch's sync debug mode (a caller proving that its forward never
    syncs); the proof waits for a later call then."""
    if device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0


def _prove(
    key: Hashable,
    direct: DirectRun,
    expected: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Run ``direct`` on the input ``run`` just computed ``expected`` from and keep whether the
    two agree bit for bit (NaN where both are NaN) as ``key``'s verdict."""
    problem: str | None
    try:
        got = direct(q, k, v)
    except Exception as exc:  # any failure keeps run: the list is not the release's
        same, problem = False, f"it raised {type(exc).__name__}: {exc}"
    else:
        same = got.shape == expected.shape and bool(
            ((got == expected) | (got.isnan() & expected.isnan())).all()
        )
        problem = None if same else "its output differs from run's"
    with _lock:
        if key in _verdicts:
            return
        _verdicts[key] = same
    if problem is not None:
        logger.warning(
            "flashinfer: the direct ragged_run call for %s is not used: %s; this process "
            "calls BatchPrefillWithRaggedKVCacheWrapper.run for it",
            key,
            problem,
        )


def clear_verdicts() -> None:
    """Forget every proof and every reason said (tests; a process that swapped its
    flashinfer)."""
    with _lock:
        _verdicts.clear()
        _said.clear()
