"""attn-backends: pick and run a no-KV-cache prefill attention kernel on packed QKV.

One contract (`forward` on packed QKV views, RoPE/logn in place, padding rows trimmed), one
selector that explains itself, and backends that arrive as pluggy plugins.

This face is what an engine calls. The rest lives in submodules, one job each, imported where
they are used (``from attn_backends.errors import KVCacheFlagError``):
`attn_backends.errors` (every error), `attn_backends.env` (the environment variables),
`attn_backends.deploy` (plugins, warm-up, canary, ranks, cache resets), `attn_backends.reference`
(the float64 oracle), `attn_backends.plugin` (what a backend author needs),
`attn_backends.integrations` (transformers, sentence-transformers) and `attn_backends.testing`
(the conformance suite).
"""

from __future__ import annotations

from ._backend._protocol import CudaGraphPrefill, NoCachePrefill
from ._backend._reference import reference_attention
from ._path._contract import Fp8Scales, PrefillPlan, QKVInput, split_views
from ._path._graph import GraphBucket, GraphPlan
from ._select._selector import Candidate, Selection, SelectRequest, select, select_request
from ._values._errors import AttentionBackendError, NoBackendError, SpecError
from ._values._features import AlibiSpec, HeadwiseConfig, SlidingWindow
from ._values._params import FMHAParams
from ._values._platform import Platform, detect_platform, parse_platform
from ._values._reasons import Reason, ReasonCode
from ._values._rope_scaling import RopeScaling
from ._values._spec import PRESETS, AttentionSpec, RopeSpec
from ._version import __version__ as __version__

__all__ = [
    "PRESETS",
    "AlibiSpec",
    "AttentionBackendError",
    "AttentionSpec",
    "Candidate",
    "CudaGraphPrefill",
    "FMHAParams",
    "Fp8Scales",
    "GraphBucket",
    "GraphPlan",
    "HeadwiseConfig",
    "NoBackendError",
    "NoCachePrefill",
    "Platform",
    "PrefillPlan",
    "QKVInput",
    "Reason",
    "ReasonCode",
    "RopeScaling",
    "RopeSpec",
    "SelectRequest",
    "Selection",
    "SlidingWindow",
    "SpecError",
    "detect_platform",
    "parse_platform",
    "reference_attention",
    "select",
    "select_request",
    "split_views",
]
