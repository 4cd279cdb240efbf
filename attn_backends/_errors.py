"""Named exceptions. Each message says what to change, so a caller never has to guess."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._distributed import RankDecision
    from ._reasons import Reason


class AttentionBackendError(Exception):
    """Base of every error this library raises on purpose."""


class SpecError(AttentionBackendError, ValueError):
    """An `AttentionSpec`, `RopeSpec` or `HeadwiseConfig` field is invalid."""


class ParamsError(AttentionBackendError, ValueError):
    """Batch lengths given to `FMHAParams.from_lengths` cannot describe a no-cache prefill."""


class PackedQKVError(AttentionBackendError, ValueError):
    """The QKV input breaks the packed-QKV contract; the input is left untouched."""


class KVCacheFlagError(AttentionBackendError, ValueError):
    """The RoPE/KV-cache flag contradicts the model: a cache nobody writes, or RoPE skipped."""


class PlatformError(AttentionBackendError, ValueError):
    """A platform string such as ``cuda:sm90`` could not be parsed."""


class UnboundBackendError(AttentionBackendError, RuntimeError):
    """`prepare`/`forward` was called on a backend that was never bound to a spec."""


class NoBackendError(AttentionBackendError, RuntimeError):
    """No backend fits, or the explicitly chosen one does not; carries every reason."""

    def __init__(self, message: str, reasons: Sequence[tuple[str, Sequence[Reason]]] = ()) -> None:
        super().__init__(message)
        self.reasons: tuple[tuple[str, tuple[Reason, ...]], ...] = tuple(
            (name, tuple(rs)) for name, rs in reasons
        )


class BackendFailure(AttentionBackendError, RuntimeError):
    """A backend raised inside `prepare`/`forward`; the original error is the cause."""


class RankMismatchError(AttentionBackendError, RuntimeError):
    """Ranks of one process group selected different backends (or some failed to select)."""

    def __init__(self, message: str, decisions: Sequence[RankDecision] = ()) -> None:
        super().__init__(message)
        self.decisions: tuple[RankDecision, ...] = tuple(decisions)


class NativeBuildError(AttentionBackendError, RuntimeError):
    """The native RoPE/logn kernel (``csrc/``) cannot be built or loaded on this machine.

    The pre-processing choice catches it, falls back to another implementation and records why.
    """
