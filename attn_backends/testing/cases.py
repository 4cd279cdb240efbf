"""Conformance cases generated from a backend's declared capabilities.

Each case varies one thing from a base (varlen with a single-token sequence) so a failure names
its cause: mask, GQA, each RoPE style, logn, padding rows, strided input, tuple forms, zero-length
and equal-length sequences. Each feature's cases (windows, soft-cap, ALiBi, headwise masks, RoPE
scaling) come from its descriptor in `attn_backends._values._feature_table`, alone and combined with
every other feature the backend declares. Refusal cases build a request the backend did not
declare and expect `supports()` to say so with the matching reason code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._backend._capabilities import Capabilities
from .._values._dtypes import FP8_DTYPES, dtype_name
from .._values._feature_table import FEATURE_LENGTHS, FEATURES, ROPE_SCALING, CaseSketch, InputForm
from .._values._platform import Platform, PlatformKind, parse_platform
from .._values._reasons import ReasonCode
from .._values._spec import AttentionSpec, RopeSpec

__all__ = [
    "FEATURE_LENGTHS",
    "ConformanceCase",
    "InputForm",
    "RefusalCase",
    "base_case",
    "conformance_cases",
    "feature_cases",
    "feature_refusals",
    "graph_case",
    "refusal_cases",
    "rope_scaling_cases",
]

VARLEN = (5, 17, 1, 32)
_FLOAT_ORDER = (torch.float32, torch.float16, torch.bfloat16)
"""Most precise first: the full variation matrix runs on the tightest tolerance declared."""


@dataclass(frozen=True)
class ConformanceCase:
    """One numeric check: a spec, a batch, and the way the QKV buffer is handed over."""

    id: str
    spec: AttentionSpec
    lengths: tuple[int, ...] = VARLEN
    padding_rows: int = 0
    form: InputForm = "plain"
    expect_fused: bool | None = None
    """For a backend that fuses RoPE up to a length: whether this batch must run fused (True)
    or the separate pass (False); ``None``: not checked."""


@dataclass(frozen=True)
class RefusalCase:
    """A request outside the declared capabilities, and the reason code it must produce."""

    id: str
    spec: AttentionSpec
    platform: Platform | None
    """``None`` means the platform under test."""
    code: ReasonCode


def _pick_head_dims(caps: Capabilities) -> tuple[int, ...]:
    declared = sorted(caps.head_dims) if caps.head_dims is not None else [64, 128]
    preferred = [d for d in (128, 64) if d in declared]
    return tuple(preferred[:2]) if preferred else tuple(declared[:1])


def _float_dtypes(caps: Capabilities) -> list[torch.dtype]:
    return [d for d in _FLOAT_ORDER if d in caps.dtypes]


def conformance_cases(caps: Capabilities) -> list[ConformanceCase]:
    """The numeric matrix for a backend, derived from what it declares."""
    dtypes = _float_dtypes(caps)
    if not dtypes:
        return []
    head_dims = _pick_head_dims(caps)
    dim = head_dims[0]
    heads, kv_heads = (8, 2) if caps.gqa else (4, 4)
    mask = caps.causal
    masks = [m for m, ok in ((True, caps.causal), (False, caps.bidirectional)) if ok]

    def spec(dtype: torch.dtype, **kw: object) -> AttentionSpec:
        fields: dict[str, object] = {
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": dim,
            "dtype": dtype,
            "causal": mask,
        }
        fields.update(kw)
        return AttentionSpec(**fields)  # type: ignore[arg-type]

    cases: list[ConformanceCase] = []
    first = dtypes[0]
    tag = dtype_name(first)
    rope = RopeSpec(theta=10000.0)
    for causal in masks:
        name = "causal" if causal else "bidir"
        cases.append(ConformanceCase(f"{tag}-{name}-norope", spec(first, causal=causal)))
        cases.append(ConformanceCase(f"{tag}-{name}-rope", spec(first, causal=causal, rope=rope)))
        if caps.gqa:
            cases.append(
                ConformanceCase(f"{tag}-{name}-mha", spec(first, causal=causal, num_kv_heads=heads))
            )
    base = spec(first, rope=RopeSpec(theta=1e6))
    cases += [
        ConformanceCase(
            f"{tag}-rope-interleaved", replace(base, rope=RopeSpec(theta=10000.0, interleaved=True))
        ),
        ConformanceCase(f"{tag}-rope-partial", replace(base, rope=RopeSpec(10000.0, dim // 2))),
        ConformanceCase(
            f"{tag}-rope-partial-interleaved",
            replace(base, rope=RopeSpec(10000.0, dim // 2, interleaved=True)),
        ),
        ConformanceCase(f"{tag}-logn", replace(base, use_logn_attn=True, logn_base=8)),
        ConformanceCase(
            f"{tag}-logn-norope", replace(base, rope=None, use_logn_attn=True, logn_base=4)
        ),
        ConformanceCase(f"{tag}-softmax-scale", replace(base, softmax_scale=0.3)),
        ConformanceCase(f"{tag}-padding-rows", base, padding_rows=7),
        ConformanceCase(f"{tag}-strided", base, form="strided"),
        ConformanceCase(f"{tag}-strided-padding", base, padding_rows=3, form="strided"),
        ConformanceCase(f"{tag}-tuple-none", base, form="tuple-none"),
        ConformanceCase(f"{tag}-tuple-empty", base, form="tuple-empty"),
        ConformanceCase(f"{tag}-separate-qkv", base, padding_rows=3, form="separate"),
        ConformanceCase(f"{tag}-separate-qkv-3d", base, form="separate-3d"),
        # batch-major q/k/v (transformers' layout) for a batch of equal lengths, nothing to
        # rotate (a plan that rotates refuses it)
        ConformanceCase(
            f"{tag}-batch-major", replace(base, rope=None), (12,) * 3, form="batch-major"
        ),
        ConformanceCase(
            f"{tag}-batch-major-dense",
            replace(base, rope=None),
            (12,) * 3,
            form="batch-major-dense",
        ),
        ConformanceCase(
            f"{tag}-batch-major-one", replace(base, rope=None), (20,), form="batch-major-dense"
        ),
        ConformanceCase(f"{tag}-single-token", base, lengths=(1,)),
        ConformanceCase(f"{tag}-zero-length-seq", base, lengths=(3, 0, 4)),
        ConformanceCase(f"{tag}-equal-lengths", base, lengths=(16,) * 6),
        ConformanceCase(f"{tag}-long", base, lengths=(300, 45)),
    ]
    for other in head_dims[1:]:
        cases.append(
            ConformanceCase(
                f"{tag}-d{other}-rope",
                replace(base, head_dim=other),
                padding_rows=2,
                form="strided",
            )
        )
    for dtype in dtypes[1:]:
        t = dtype_name(dtype)
        for causal in masks:
            name = "causal" if causal else "bidir"
            cases.append(
                ConformanceCase(
                    f"{t}-{name}-rope-strided",
                    replace(base, dtype=dtype, causal=causal),
                    padding_rows=2,
                    form="strided",
                )
            )
    cases += feature_cases(caps, base, masks)
    limit = caps.fused_rope_max_seqlen
    if caps.fused_rope and limit is not None and base.rope_fusable:
        # Both sides of the per-batch fusion limit, the limit itself included.
        cases += [
            ConformanceCase(f"{tag}-fused-rope-at-limit", base, (limit, 3, 1), expect_fused=True),
            ConformanceCase(
                f"{tag}-past-fused-rope-limit", base, (limit + 1, 2), expect_fused=False
            ),
        ]
    return cases


def rope_scaling_cases(base: AttentionSpec) -> list[ConformanceCase]:
    """One case per RoPE scaling rule on ``base`` (`_feature_table.RopeScalingFeature`)."""
    return [_case(base, sketch) for sketch in ROPE_SCALING.cases(None, base, [base.causal])]


def _case(base: AttentionSpec, sketch: CaseSketch) -> ConformanceCase:
    """A feature's proposed case on ``base``, its id prefixed with the dtype."""
    spec = replace(base, **sketch.fields)  # type: ignore[arg-type]  # a feature's spec fields
    return ConformanceCase(
        f"{dtype_name(spec.dtype)}-{sketch.name}",
        spec,
        lengths=sketch.lengths if sketch.lengths is not None else VARLEN,
        padding_rows=sketch.padding_rows,
        form=sketch.form,
    )


def base_case(caps: Capabilities) -> ConformanceCase | None:
    """The varlen case with RoPE the other generated checks start from (None: nothing to run)."""
    cases = conformance_cases(caps)
    return next((c for c in cases if c.id.endswith("-rope") and "causal" in c.id), None) or (
        cases[0] if cases else None
    )


def graph_case(caps: Capabilities, device_type: str) -> ConformanceCase | None:
    """The graph-mode case: the base case, with RoPE where graph mode has a pass for it (the
    native kernel on a GPU); on CPU tensors without it (the torch pass is never replayed)."""
    base = base_case(caps)
    if base is None or device_type == "cuda" or base.spec.rope is None:
        return base
    return replace(base, id=base.id.replace("-rope", "-norope"), spec=replace(base.spec, rope=None))


def refusal_cases(caps: Capabilities, platform: Platform) -> list[RefusalCase]:
    """Requests the backend did not declare; each must be refused with the given code."""
    dtypes = _float_dtypes(caps)
    dtype = dtypes[0] if dtypes else next(iter(sorted(caps.dtypes, key=str)))
    dim = _pick_head_dims(caps)[0]
    base = AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=dim, dtype=dtype, causal=caps.causal)
    cases: list[RefusalCase] = []
    for other in (*_FLOAT_ORDER, torch.float8_e4m3fn):
        if other not in caps.dtypes:
            code = ReasonCode.FP8 if other in FP8_DTYPES else ReasonCode.DTYPE
            cases.append(
                RefusalCase(f"dtype-{dtype_name(other)}", replace(base, dtype=other), None, code)
            )
    if caps.head_dims is not None:
        odd = next(d for d in (40, 72, 80, 96, 160, 192, 256, 512, 24) if d not in caps.head_dims)
        cases.append(
            RefusalCase(f"head-dim-{odd}", replace(base, head_dim=odd), None, ReasonCode.HEAD_DIM)
        )
    if not caps.gqa:
        cases.append(
            RefusalCase("gqa", replace(base, num_heads=8, num_kv_heads=2), None, ReasonCode.GQA)
        )
    if not caps.causal:
        cases.append(RefusalCase("causal", replace(base, causal=True), None, ReasonCode.CAUSAL))
    if not caps.bidirectional:
        cases.append(
            RefusalCase(
                "bidirectional",
                replace(base, causal=False),
                None,
                ReasonCode.BIDIRECTIONAL,
            )
        )
    cases += feature_refusals(caps, base)
    samples: dict[PlatformKind, str] = {"cpu": "cpu", "cuda": "cuda:sm90", "rocm": "rocm:gfx942"}
    for kind, text in samples.items():
        if kind not in caps.platforms:
            cases.append(
                RefusalCase(f"platform-{kind}", base, parse_platform(text), ReasonCode.PLATFORM)
            )
    if caps.requires:
        bare = replace(
            platform, libraries=tuple((lib, None) for lib in caps.requires), assumed=False
        )
        cases.append(RefusalCase("library-missing", base, bare, ReasonCode.LIBRARY_MISSING))
    return cases


def feature_cases(
    caps: Capabilities, base: AttentionSpec, masks: list[bool]
) -> list[ConformanceCase]:
    """Each declared feature's own cases (`Feature.cases`), then every pair of declared
    features and all of them together, on each mask the backend declares; combinations the
    backend's declared limits refuse (ALiBi with the soft-cap on flashinfer) are left out.
    The other float dtypes run all of them together. ``base`` is the varlen RoPE case of the
    first dtype."""
    declared = [
        (f, caps.support(f)) for f in FEATURES if f.support is None or caps.support(f) is not None
    ]
    cases = [
        _case(base, sketch) for f, support in declared for sketch in f.cases(support, base, masks)
    ]
    for causal in masks:
        spec = replace(base, causal=causal)
        samples = [
            (f.name, on)
            for f, support in declared
            if support is not None and (on := f.sample(support, causal)) is not None
        ]
        mask = "causal" if causal else "bidir"
        combos = [list(pair) for pair in itertools.combinations(samples, 2)]
        combos += [samples] if len(samples) > 2 else []
        for combo in combos:
            combined = _combined(caps, spec, combo)
            if combined is not None:
                name = "-".join(n.replace("logit_", "") for n, _ in combo)
                cases.append(
                    ConformanceCase(
                        f"{dtype_name(spec.dtype)}-{mask}-{name}", combined, FEATURE_LENGTHS
                    )
                )
        every = _greedy(caps, spec, samples)
        for dtype in _float_dtypes(caps)[1:]:
            if every is not None:
                cases.append(
                    ConformanceCase(
                        f"{dtype_name(dtype)}-{mask}-features-strided",
                        replace(every, dtype=dtype),
                        lengths=FEATURE_LENGTHS,
                        padding_rows=2,
                        form="strided",
                    )
                )
    return cases


def _combined(
    caps: Capabilities, spec: AttentionSpec, combo: list[tuple[str, dict[str, object]]]
) -> AttentionSpec | None:
    """``spec`` with every sample of ``combo`` on, or ``None`` when the declared limits
    refuse that combination."""
    fields: dict[str, Any] = {}
    for _, on in combo:
        fields.update(on)
    combined = replace(spec, **fields)
    refused = any(f.reasons(caps.support(f), combined) for f in FEATURES)
    return None if refused else combined


def _greedy(
    caps: Capabilities, spec: AttentionSpec, samples: list[tuple[str, dict[str, object]]]
) -> AttentionSpec | None:
    """``spec`` with as many declared features on as the limits take together (table order);
    ``None`` when the backend declares none."""
    taken: list[tuple[str, dict[str, object]]] = []
    for sample in samples:
        if _combined(caps, spec, [*taken, sample]) is not None:
            taken.append(sample)
    return _combined(caps, spec, taken) if taken else None


def feature_refusals(caps: Capabilities, base: AttentionSpec) -> list[RefusalCase]:
    """Each feature the backend does not declare, and each limit of those it declares
    (`Feature.refusals`)."""
    cases: list[RefusalCase] = []
    for feature in FEATURES:
        for sketch in feature.refusals(caps.support(feature), base):
            spec = replace(base, **sketch.fields)  # type: ignore[arg-type]  # spec fields
            cases.append(RefusalCase(sketch.name, spec, None, sketch.code))
    return cases
