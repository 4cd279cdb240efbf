"""Named exceptions. Each message says what to change, so a caller never has to guess."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._reasons import Reason


class AttentionBackendError(Exception):
    """Base of every error this library raises on purpose."""

    modified: str | None = None
    """None when the caller's buffers are exactly as they were before the call. Otherwise the
    error came after an in-place write (RoPE/logn on the Q|K columns): it says which rows and
    columns changed, and how to recover (recompute or restore the QKV before a retry)."""

    def __init__(self, *args: object, modified: str | None = None) -> None:
        super().__init__(*args)
        if modified is not None:
            self.modified = modified


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


class NoBackendError(AttentionBackendError, RuntimeError):
    """No backend fits, or the explicitly chosen one does not; carries every reason.

    ``record``, when the selector raised it, is the decision record of the failed selection
    (the shape of ``Selection.to_dict()`` with ``"selected": None``): what ``explain --json``
    prints when nothing fits.
    """

    def __init__(
        self,
        message: str,
        reasons: Sequence[tuple[str, Sequence[Reason]]] = (),
        *,
        record: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.reasons: tuple[tuple[str, tuple[Reason, ...]], ...] = tuple(
            (name, tuple(rs)) for name, rs in reasons
        )
        self.record: Mapping[str, object] | None = record


class GraphModeError(NoBackendError):
    """A backend cannot serve graph mode (CUDA-graph capture, re-planned per batch) for a spec;
    carries the reasons. Pick one with ``select(spec, cuda_graph=True)``."""


class BackendFailure(AttentionBackendError, RuntimeError):
    """A backend raised inside `prepare`/`forward`; the original error is the cause."""


class NativeBuildError(AttentionBackendError, RuntimeError):
    """The native RoPE/logn kernel (``csrc/``) cannot be built or loaded on this machine.

    The pre-processing choice catches it, falls back to another implementation and records why.
    """


class InvalidArgumentError(AttentionBackendError, TypeError, ValueError):
    """An argument has the wrong type or value: a `select` flag that is not a real bool, a
    plugin timeout that is not a positive number. Caught as either TypeError or ValueError."""


class PluginLoadError(AttentionBackendError, RuntimeError):
    """A plugin's code failed, hung or misbehaved while it was being loaded.

    The registry records it against that plugin (``attn-backends list`` shows it) and loads the
    others; it reaches a caller only as `ReentrantRegistryError`, inside the plugin itself.
    """


class ReentrantRegistryError(PluginLoadError):
    """A plugin called back into the registry (`get_registry`, `select`, `reset_registry`, a
    `Registry` method) while it was being loaded.

    Loading holds the registry, so such a call could only deadlock. Do that work later, when the
    backend is used (in ``plan_kernel`` or ``attend``), never at import or in the hook.
    """


class IntegrationError(AttentionBackendError, ValueError):
    """A framework integration (``attn_backends.integrations``) was called in a way this
    library cannot serve: dropout while training, attention weights requested, a custom mask,
    cross-attention or a KV cache. The message says what to change in the model call."""


class FeatureNotSupportedError(IntegrationError, NotImplementedError):
    """A model asks for an attention feature the spec cannot express yet (sliding window, logit
    soft-cap, attention sinks). Use another attention implementation for that model for now."""


class MaskMismatchError(IntegrationError):
    """A model's own attention mask allows other keys than attn_backends would attend to for
    that batch (a rule the spec cannot express, a padding hole under a sliding window, packed
    sequences the model reads as one). The message names the model, the first differing cell
    and what to change."""
