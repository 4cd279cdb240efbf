"""The face for code that extends attn-backends: backend plugins and ``attn-backends`` subcommands.

Engines import `attn_backends`; a plugin imports the shared values from there (`AttentionSpec`,
`FMHAParams`, `Platform`, `PrefillPlan`, the errors) and what only an author needs from here:
the base class and its plan types, capabilities as data, structured refusals, the hook that
registers backend classes (with their `Placement` and the RoPE passes a plugin brings, in its
manifest), and the entry-point groups. The built-in plugins use this module, `attn_backends`
and `attn_backends.errors` only; an import-linter contract keeps it that way.
"""

from __future__ import annotations

from ._backend._backend import Binding, KernelModule, PrefillBackend
from ._backend._capabilities import Capabilities, check_capabilities
from ._backend._protocol import BackendClass
from ._cli._commands import COMMAND_GROUP, Subcommand
from ._path._contract import AnyPlan, InputLayout, QKVViews
from ._path._preprocess import preprocess_mode
from ._path._rope_passes import RopePass, register_rope_pass, rope_passes
from ._select._hooks import (
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    Placement,
    PluginManifest,
    hookimpl,
)
from ._values._dtypes import dtype_name
from ._values._feature_table import (
    AlibiSupport,
    ChunkSupport,
    FeatureSupport,
    Fp8Support,
    HeadwiseSupport,
    MlaSupport,
    SinkSupport,
    SoftcapSupport,
    WindowSupport,
)
from ._values._features import bloom_alibi_slopes
from ._values._reasons import Reason, ReasonCode

__all__ = [
    "COMMAND_GROUP",
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "AlibiSupport",
    "AnyPlan",
    "BackendClass",
    "Binding",
    "Capabilities",
    "ChunkSupport",
    "FeatureSupport",
    "Fp8Support",
    "HeadwiseSupport",
    "InputLayout",
    "KernelModule",
    "MlaSupport",
    "Placement",
    "PluginManifest",
    "PrefillBackend",
    "QKVViews",
    "Reason",
    "ReasonCode",
    "RopePass",
    "SinkSupport",
    "SoftcapSupport",
    "Subcommand",
    "WindowSupport",
    "bloom_alibi_slopes",
    "check_capabilities",
    "dtype_name",
    "hookimpl",
    "preprocess_mode",
    "register_rope_pass",
    "rope_passes",
]
