"""Every error attn-backends raises, under one base (`AttentionBackendError`).

Each names what to change; catch the base to catch them all. `NoBackendError` and `SpecError`,
the two an engine meets at start-up, are also on the top-level face.
"""

from __future__ import annotations

from ._select._distributed import RankMismatchError
from ._values._errors import (
    AttentionBackendError,
    BackendFailure,
    FeatureNotSupportedError,
    GraphModeError,
    IntegrationError,
    InvalidArgumentError,
    KVCacheFlagError,
    MaskMismatchError,
    NativeBuildError,
    NoBackendError,
    PackedQKVError,
    ParamsError,
    PlatformError,
    PluginLoadError,
    ReentrantRegistryError,
    SpecError,
)

__all__ = [
    "AttentionBackendError",
    "BackendFailure",
    "FeatureNotSupportedError",
    "GraphModeError",
    "IntegrationError",
    "InvalidArgumentError",
    "KVCacheFlagError",
    "MaskMismatchError",
    "NativeBuildError",
    "NoBackendError",
    "PackedQKVError",
    "ParamsError",
    "PlatformError",
    "PluginLoadError",
    "RankMismatchError",
    "ReentrantRegistryError",
    "SpecError",
]
