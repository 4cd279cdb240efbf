"""attn-backends: pick and run a no-KV-cache prefill attention kernel on packed QKV.

One contract (`forward` on packed QKV views, RoPE/logn in place, padding rows trimmed), one
selector that explains itself, and backends that arrive as pluggy plugins.
"""

from __future__ import annotations

from ._backend._backend import Binding
from ._backend._protocol import CudaGraphPrefill, NoCachePrefill
from ._backend._reference import TOLERANCE, reference_attention, relative_error
from ._model._errors import (
    AttentionBackendError,
    BackendFailure,
    FeatureNotSupportedError,
    GraphModeError,
    IntegrationError,
    InvalidArgumentError,
    KVCacheFlagError,
    NativeBuildError,
    NoBackendError,
    PackedQKVError,
    ParamsError,
    PlatformError,
    PluginLoadError,
    ReentrantRegistryError,
    SpecError,
    UnboundBackendError,
)
from ._model._features import AlibiSpec, HeadwiseConfig, SlidingWindow, bloom_alibi_slopes
from ._model._params import FMHAParams
from ._model._platform import Platform, detect_platform, parse_platform
from ._model._presets import PRESETS
from ._model._reasons import Reason, ReasonCode
from ._model._rope_hf import rope_spec_from_hf, rope_spec_from_hf_config
from ._model._rope_scaling import ROPE_TYPES, RopeScaling
from ._model._spec import AttentionSpec, RopeSpec
from ._path._contract import (
    Fp8Scales,
    PrefillPlan,
    QKVInput,
    split_views,
)
from ._path._graph import GraphBucket, GraphPlan
from ._path._preprocess import clear_preprocess_cache
from ._path._rope_passes import register_rope_pass, rope_passes
from ._plugins._isolation import PLUGIN_TIMEOUT_ENV
from ._plugins._policy import DISABLE_ENV, PLUGINS_ENV
from ._plugins._registry import (
    BackendEntry,
    PluginPolicy,
    PluginRecord,
    Registry,
    get_registry,
    reset_registry,
)
from ._select._canary import CanaryResult, run_canary
from ._select._distributed import (
    RankDecision,
    RankMismatchError,
    check_consistent_across_ranks,
    select_across_ranks,
)
from ._select._selector import (
    BACKEND_ENV,
    STRICT_ENV,
    Candidate,
    Selection,
    SelectRequest,
    clear_selection_cache,
    select,
    select_request,
)
from ._select._warmup import WarmupReport, WarmupStep, warmup

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV",
    "DISABLE_ENV",
    "PLUGINS_ENV",
    "PLUGIN_TIMEOUT_ENV",
    "PRESETS",
    "ROPE_TYPES",
    "STRICT_ENV",
    "TOLERANCE",
    "AlibiSpec",
    "AttentionBackendError",
    "AttentionSpec",
    "BackendEntry",
    "BackendFailure",
    "Binding",
    "CanaryResult",
    "Candidate",
    "CudaGraphPrefill",
    "FMHAParams",
    "FeatureNotSupportedError",
    "Fp8Scales",
    "GraphBucket",
    "GraphModeError",
    "GraphPlan",
    "HeadwiseConfig",
    "IntegrationError",
    "InvalidArgumentError",
    "KVCacheFlagError",
    "NativeBuildError",
    "NoBackendError",
    "NoCachePrefill",
    "PackedQKVError",
    "ParamsError",
    "Platform",
    "PlatformError",
    "PluginLoadError",
    "PluginPolicy",
    "PluginRecord",
    "PrefillPlan",
    "QKVInput",
    "RankDecision",
    "RankMismatchError",
    "Reason",
    "ReasonCode",
    "ReentrantRegistryError",
    "Registry",
    "RopeScaling",
    "RopeSpec",
    "SelectRequest",
    "Selection",
    "SlidingWindow",
    "SpecError",
    "UnboundBackendError",
    "WarmupReport",
    "WarmupStep",
    "bloom_alibi_slopes",
    "check_consistent_across_ranks",
    "clear_preprocess_cache",
    "clear_selection_cache",
    "detect_platform",
    "get_registry",
    "parse_platform",
    "reference_attention",
    "register_rope_pass",
    "relative_error",
    "reset_registry",
    "rope_passes",
    "rope_spec_from_hf",
    "rope_spec_from_hf_config",
    "run_canary",
    "select",
    "select_across_ranks",
    "select_request",
    "split_views",
    "warmup",
]
