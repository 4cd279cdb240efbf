"""Conformance cases generated from a backend's declared capabilities.

Each case varies one thing from a base (varlen with a single-token sequence) so a failure names
its cause: mask, GQA, each RoPE style, logn, padding rows, strided input, tuple forms, zero-length
and equal-length sequences, headwise masks. Refusal cases build a request the backend did not
declare and expect `supports()` to say so with the matching reason code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from .._capabilities import Capabilities
from .._dtypes import FP8_DTYPES, dtype_name
from .._features import AlibiSpec, SlidingWindow
from .._platform import Platform, PlatformKind, parse_platform
from .._reasons import ReasonCode
from .._rope_scaling import RopeScaling
from .._spec import AttentionSpec, HeadwiseConfig, RopeSpec

InputForm = Literal["plain", "strided", "tuple-none", "tuple-empty", "separate", "separate-3d"]

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
    hw = HeadwiseConfig(frozenset({0, 3}), sink_token_num=2, swa_token_num=4, seqlen_threshold=8)
    masks = [m for m, ok in ((True, caps.causal), (False, caps.bidirectional)) if ok]

    def spec(dtype: torch.dtype, **kw: object) -> AttentionSpec:
        fields: dict[str, object] = {
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": dim,
            "dtype": dtype,
            "causal": mask,
            "headwise": hw if caps.headwise else None,
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
    if caps.headwise:
        cases.append(ConformanceCase(f"{tag}-headwise-mixed-lengths", base, lengths=(5, 17, 7, 33)))
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
    cases += rope_scaling_cases(base)
    return cases


def rope_scaling_cases(base: AttentionSpec) -> list[ConformanceCase]:
    """One case per RoPE scaling rule on ``base``: the chosen pass must apply it (theta-only
    kernels refuse it, so the torch pass serves it) and match the float64 reference. The
    length-dependent rules (dynamic, longrope) run once below and once past their threshold of
    16 tokens, so both sets of frequencies are checked; padding rows and strided input too."""
    tag = dtype_name(base.dtype)
    pairs = base.head_dim // 2
    rules = {
        "linear": RopeScaling("linear", factor=4.0),
        "dynamic": RopeScaling("dynamic", factor=2.0, max_position_embeddings=16),
        "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
        "yarn-mscale": RopeScaling(
            "yarn",
            factor=8.0,
            original_max_position_embeddings=16,
            mscale=0.707,
            mscale_all_dim=1.0,
            truncate=False,
        ),
        "longrope": RopeScaling(
            "longrope",
            factor=4.0,
            original_max_position_embeddings=16,
            short_factor=tuple(1.0 + i / pairs for i in range(pairs)),
            long_factor=tuple(1.0 + 8.0 * i / pairs for i in range(pairs)),
        ),
        "llama3": RopeScaling(
            "llama3",
            factor=8.0,
            original_max_position_embeddings=64,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
        "proportional": RopeScaling("proportional", factor=2.0, partial_rotary_factor=0.25),
    }
    cases: list[ConformanceCase] = []
    for name, rule in rules.items():
        spec = replace(base, rope=RopeSpec(1e4, scaling=rule))
        cases.append(ConformanceCase(f"{tag}-rope-{name}", spec, padding_rows=3, form="strided"))
        if rule.length_dependent:
            cases.append(ConformanceCase(f"{tag}-rope-{name}-short", spec, lengths=(5, 1, 12)))
    return cases


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
    hw = HeadwiseConfig(frozenset({0}), sink_token_num=2, swa_token_num=4, seqlen_threshold=8)
    base = AttentionSpec(
        num_heads=4,
        num_kv_heads=4,
        head_dim=dim,
        dtype=dtype,
        causal=caps.causal,
        headwise=hw if caps.headwise else None,
    )
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
                replace(base, causal=False, headwise=None),
                None,
                ReasonCode.BIDIRECTIONAL,
            )
        )
    if not caps.mla:
        cases.append(RefusalCase("mla", replace(base, use_mla=True), None, ReasonCode.MLA))
    if caps.headwise:
        cases.append(
            RefusalCase(
                "headwise-missing-config", replace(base, headwise=None), None, ReasonCode.HEADWISE
            )
        )
    elif base.causal:
        cases.append(RefusalCase("headwise", replace(base, headwise=hw), None, ReasonCode.HEADWISE))
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


FEATURE_LENGTHS = (5, 17, 1, 32, 8)
"""Varlen batch for windows: windows of 8 are smaller than 17 and 32, equal to 8, larger than
5 and 1."""


def feature_cases(
    caps: Capabilities, base: AttentionSpec, masks: list[bool]
) -> list[ConformanceCase]:
    """Sliding windows, soft-capping and ALiBi, each alone, with GQA and together, on the
    masks the backend declares. ``base`` is the varlen RoPE case of the first dtype."""
    tag = dtype_name(base.dtype)
    cases: list[ConformanceCase] = []

    def add(name: str, spec: AttentionSpec, **kw: object) -> None:
        cases.append(ConformanceCase(f"{tag}-{name}", spec, **kw))  # type: ignore[arg-type]

    mha = replace(base, num_kv_heads=base.num_heads)
    for causal in masks:
        mask = "causal" if causal else "bidir"
        spec = replace(base, causal=causal)
        if caps.sliding_window:
            windows = (
                [("w8", SlidingWindow.causal(8)), ("w1", SlidingWindow.causal(1))]
                if causal or not caps.window_right
                else [
                    ("w4-4", SlidingWindow(4, 4)),
                    ("w0-3", SlidingWindow(0, 3)),
                    ("w6-0", SlidingWindow(6, 0)),
                    ("w64-64", SlidingWindow(64, 64)),
                ]
            )
            for name, window in windows:
                add(f"{mask}-window-{name}", replace(spec, window=window), lengths=FEATURE_LENGTHS)
            add(
                f"{mask}-window-mha-padding",
                replace(mha, causal=causal, window=windows[0][1]),
                lengths=FEATURE_LENGTHS,
                padding_rows=3,
            )
        if caps.logit_softcap:
            add(f"{mask}-softcap", replace(spec, logit_softcap=2.0))
            add(f"{mask}-softcap-mha", replace(mha, causal=causal, logit_softcap=30.0))
        alibi = caps.alibi and (causal or caps.alibi_bidirectional)
        if alibi:
            add(f"{mask}-alibi", replace(spec, rope=None, alibi=AlibiSpec()))
            add(f"{mask}-alibi-gqa-rope", replace(spec, alibi=AlibiSpec()), padding_rows=2)
        if alibi and caps.alibi_custom_slopes:
            slopes = tuple(0.5 / (h + 1) for h in range(base.num_heads))
            add(
                f"{mask}-alibi-slopes-mha-strided",
                replace(mha, causal=causal, rope=None, alibi=AlibiSpec(slopes)),
                form="strided",
            )
        right = 2 if not causal and caps.window_right else 0
        if caps.sliding_window and caps.logit_softcap and alibi and caps.alibi_with_softcap:
            window = SlidingWindow(5, right)
            add(
                f"{mask}-window-softcap-alibi",
                replace(spec, window=window, logit_softcap=5.0, alibi=AlibiSpec()),
                lengths=FEATURE_LENGTHS,
            )
        elif caps.sliding_window and alibi:
            window = SlidingWindow(5, right)
            add(
                f"{mask}-window-alibi",
                replace(spec, rope=None, window=window, alibi=AlibiSpec()),
                lengths=FEATURE_LENGTHS,
            )
        if caps.sliding_window and caps.logit_softcap:
            add(
                f"{mask}-window-softcap",
                replace(spec, window=SlidingWindow(3, right), logit_softcap=3.0),
                lengths=FEATURE_LENGTHS,
            )
        every = _declared_features(caps, causal)
        for dtype in _float_dtypes(caps)[1:]:
            if every:
                cases.append(
                    ConformanceCase(
                        f"{dtype_name(dtype)}-{mask}-features-strided",
                        replace(spec, dtype=dtype, **every),  # type: ignore[arg-type]
                        lengths=FEATURE_LENGTHS,
                        padding_rows=2,
                        form="strided",
                    )
                )
    return cases


def _declared_features(caps: Capabilities, causal: bool) -> dict[str, object]:
    """Spec fields turning on every feature the backend declares (for the 16-bit cases)."""
    fields: dict[str, object] = {}
    if caps.sliding_window:
        fields["window"] = SlidingWindow(6, 3 if not causal and caps.window_right else 0)
    if caps.logit_softcap:
        fields["logit_softcap"] = 4.0
    alibi = caps.alibi and (causal or caps.alibi_bidirectional)
    if alibi and (caps.alibi_with_softcap or not caps.logit_softcap):
        fields["alibi"] = AlibiSpec()
    return fields


def feature_refusals(caps: Capabilities, base: AttentionSpec) -> list[RefusalCase]:
    """A window, a soft-cap and ALiBi on a backend that does not declare them."""
    cases: list[RefusalCase] = []
    if not caps.sliding_window:
        window = replace(base, window=SlidingWindow.causal(8))
        cases.append(RefusalCase("sliding-window", window, None, ReasonCode.SLIDING_WINDOW))
    if caps.sliding_window and not caps.window_right:
        both = replace(base, causal=False, headwise=None, window=SlidingWindow(4, 4))
        cases.append(RefusalCase("window-right", both, None, ReasonCode.SLIDING_WINDOW))
    if not caps.logit_softcap:
        capped = replace(base, logit_softcap=30.0)
        cases.append(RefusalCase("logit-softcap", capped, None, ReasonCode.SOFTCAP))
    if not caps.alibi:
        cases.append(RefusalCase("alibi", replace(base, alibi=AlibiSpec()), None, ReasonCode.ALIBI))
        return cases
    if not caps.alibi_bidirectional:
        bidir = replace(base, causal=False, headwise=None, alibi=AlibiSpec())
        cases.append(RefusalCase("alibi-bidirectional", bidir, None, ReasonCode.ALIBI))
    if not caps.alibi_custom_slopes:
        custom = AlibiSpec(tuple(0.5 / (h + 1) for h in range(base.num_heads)))
        cases.append(
            RefusalCase("alibi-custom-slopes", replace(base, alibi=custom), None, ReasonCode.ALIBI)
        )
    if caps.logit_softcap and not caps.alibi_with_softcap:
        both = replace(base, alibi=AlibiSpec(), logit_softcap=30.0)
        cases.append(RefusalCase("alibi-with-softcap", both, None, ReasonCode.ALIBI))
    return cases
