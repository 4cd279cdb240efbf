"""One descriptor per attention feature, and the table the rest of the package loops over.

A feature (sliding windows, the logit soft-cap, ALiBi, headwise masks, MLA, FP8 input, RoPE
scaling, chunked attention) is one `Feature`. It owns, in one place:

- whether a spec uses it (`Feature.used`), its checks against the rest of the layer
  (`validate`, and `canonical` for the one form equal values are stored in) and its part of
  `AttentionSpec.to_dict` (`record`);
- its capability: the `FeatureSupport` value a backend lists in ``Capabilities.features``, the
  feature's own limits as typed fields (window sides, ALiBi forms, ...), and the reasons a
  backend without it, or past those limits, refuses a spec (`reasons`);
- its words in ``explain`` (`explain`);
- its float64 reference piece (`reference_visible`, `reference_score`), which `_reference`
  composes; written from the definition, on purpose independent of the plugins' mask code;
- its conformance cases (`cases`, `sample`, `refusals`), which `attn_backends.testing.cases`
  turns into the suite's checks.

`AttentionSpec` validation and record, `check_capabilities`, `Capabilities.to_dict`, the spec
line of ``explain`` and the conformance generators are loops over `FEATURES`: a new feature is
one descriptor here (plus its field on `AttentionSpec`) and the plugins that serve it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import torch

from ._dtypes import dtype_name
from ._errors import SpecError
from ._features import (
    MAX_ALIBI_SLOPE,
    MAX_CHUNK_SIZE,
    MAX_WINDOW,
    SOFTCAP_RANGE,
    AlibiSpec,
    HeadwiseConfig,
    SlidingWindow,
    bloom_alibi_slopes,
    bounded_number,
    same_slopes,
)
from ._numbers import shown
from ._reasons import Reason, ReasonCode
from ._rope_scaling import RopeScaling
from ._rope_spec import RopeSpec


class LayerFields(Protocol):
    """The fields of a layer the descriptors read: what `AttentionSpec` (a frozen dataclass)
    carries, seen read-only. `_spec` imports this table to validate and record its features, so
    the table names the fields it reads, not the class, and the import runs one way."""

    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def causal(self) -> bool: ...
    @property
    def rope(self) -> RopeSpec | None: ...
    @property
    def use_logn_attn(self) -> bool: ...
    @property
    def use_mla(self) -> bool: ...
    @property
    def headwise(self) -> HeadwiseConfig | None: ...
    @property
    def window(self) -> SlidingWindow | None: ...
    @property
    def logit_softcap(self) -> float | None: ...
    @property
    def alibi(self) -> AlibiSpec | None: ...
    @property
    def chunk_size(self) -> int | None: ...
    @property
    def attention_sinks(self) -> bool: ...
    @property
    def is_fp8(self) -> bool: ...


@dataclass(frozen=True)
class FeatureSupport:
    """What a backend declares about one feature: that it serves it, and the feature's own
    limits as bool fields (True: served). A backend lists one per feature it serves in
    ``Capabilities.features``; a feature without its value there is refused."""

    feature: ClassVar[str] = ""
    """The `Feature.name` this value declares."""

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class WindowSupport(FeatureSupport):
    """Serves `SlidingWindow` masks (``spec.window``)."""

    feature: ClassVar[str] = "window"
    right: bool = True
    """Also windows reaching keys after the query (``right > 0``, bidirectional local
    attention); ``False``: left-only windows."""


@dataclass(frozen=True)
class SoftcapSupport(FeatureSupport):
    """Serves ``spec.logit_softcap`` (``cap * tanh(scores / cap)``)."""

    feature: ClassVar[str] = "logit_softcap"


@dataclass(frozen=True)
class AlibiSupport(FeatureSupport):
    """Serves ``spec.alibi`` biases."""

    feature: ClassVar[str] = "alibi"
    bidirectional: bool = True
    """Also the bidirectional bias ``-slope * |i - j|``; ``False``: causal only."""
    custom_slopes: bool = True
    """Any slopes; ``False``: only BLOOM's (the kernel computes its own)."""
    with_softcap: bool = True
    """ALiBi and ``logit_softcap`` on one spec."""


@dataclass(frozen=True)
class HeadwiseSupport(FeatureSupport):
    """Serves `HeadwiseConfig` masks (``spec.headwise``)."""

    feature: ClassVar[str] = "headwise"


@dataclass(frozen=True)
class ChunkSupport(FeatureSupport):
    """Serves chunked attention (``spec.chunk_size``)."""

    feature: ClassVar[str] = "chunk"


@dataclass(frozen=True)
class MlaSupport(FeatureSupport):
    """Serves MLA attention (``spec.use_mla``)."""

    feature: ClassVar[str] = "mla"


@dataclass(frozen=True)
class SinkSupport(FeatureSupport):
    """Serves attention sinks (``spec.attention_sinks``): the per-layer logits ``forward``
    receives as ``sinks`` (``QKVViews.sinks``) join every query's softmax denominator."""

    feature: ClassVar[str] = "attention_sinks"


@dataclass(frozen=True)
class Fp8Support(FeatureSupport):
    """FP8 input's options. FP8 itself is served by listing FP8 dtypes in
    ``Capabilities.dtypes``; this value is needed only for what goes beyond that."""

    feature: ClassVar[str] = "fp8"
    preprocess: bool = False
    """With RoPE or logn on FP8 input: the backend applies them before quantising (or on
    dequantised values). Without it such a spec is refused: rotating stored FP8 values in place
    and writing them back as FP8 loses the scales' range (NaN in e4m3fnuz, saturation in
    e4m3fn)."""


InputForm = Literal[
    "plain",
    "strided",
    "tuple-none",
    "tuple-empty",
    "separate",
    "separate-3d",
    "batch-major",
    "batch-major-dense",
]
"""How a case hands its QKV to ``forward``: the packed buffer (strided: a column slice of a
wider one), the tuple forms, separate ``[rows, ...]`` tensors, or batch-major
``[n, heads, L, D]`` tensors (views of the packed rows, as transformers hands them, or dense
copies whose rows no view reaches)."""


@dataclass(frozen=True)
class CaseSketch:
    """A conformance case as a feature proposes it: spec fields set on the suite's base case
    (the varlen RoPE case of the most precise dtype), and the batch to run it on."""

    name: str
    fields: Mapping[str, object]
    lengths: tuple[int, ...] | None = None
    """``None``: the suite's default varlen batch."""
    padding_rows: int = 0
    form: InputForm = "plain"


@dataclass(frozen=True)
class RefusalSketch:
    """A spec (fields set on the suite's refusal base) a backend must refuse with ``code``."""

    name: str
    fields: Mapping[str, object]
    code: ReasonCode


FEATURE_LENGTHS = (5, 17, 1, 32, 8)
"""Varlen batch for windows and chunks: windows (and chunks) of 8 are smaller than 17 and 32,
equal to 8, larger than 5 and 1."""

S = TypeVar("S", bound=FeatureSupport)


class Feature(Generic[S]):
    """One attention feature; subclasses override what applies to them (see the module)."""

    name: str
    """The key of its support in ``Capabilities.to_dict()["features"]``."""
    code: ReasonCode
    """The code of its refusal reasons."""
    support: type[S] | None
    """The capability value a backend declares; ``None``: served by every backend (nothing to
    declare, nothing refused)."""
    title: str
    """What it is, in a refusal: "sliding-window masks"."""
    field: str
    """The `AttentionSpec` field that carries it."""

    def used(self, spec: LayerFields) -> bool:
        """Whether the spec asks for the feature: its field is set (a feature whose field is
        never ``None`` says otherwise)."""
        return getattr(spec, self.field) is not None

    # -- the spec -------------------------------------------------------------------------

    def validate(self, spec: LayerFields) -> None:
        """Raise `SpecError` when the feature's value does not fit the rest of the layer."""

    def canonical(self, spec: LayerFields) -> object:
        """The one stored form of the feature's field (after `validate`), so that values that
        mean the same compare, hash and fingerprint the same."""
        return getattr(spec, self.field)

    def record(self, spec: LayerFields) -> dict[str, object]:
        """The feature's keys in `AttentionSpec.to_dict`. A new feature should list its key
        only when used, so that every earlier spec keeps its fingerprint."""
        value = getattr(spec, self.field)
        return {self.field: value.to_dict() if value is not None else None}

    def explain(self, spec: LayerFields) -> str | None:
        """Its words in ``explain``'s spec line when used; ``None``: nothing to add."""
        return self.name

    # -- capabilities ---------------------------------------------------------------------

    def reasons(self, support: S | None, spec: LayerFields) -> list[Reason]:
        """Why a backend declaring ``support`` (``None``: not declared) refuses ``spec``."""
        if self.support is None or not self.used(spec):
            return []
        if support is None:
            return [self.not_declared(spec)]
        return self.limits(support, spec)

    def not_declared(self, spec: LayerFields) -> Reason:
        assert self.support is not None
        return Reason(
            self.code,
            f"{self.title} not implemented; needs a backend declaring {self.support.__name__}()",
            self.field,
            self.got(spec),
            "None",
        )

    def got(self, spec: LayerFields) -> str:
        value = getattr(spec, self.field)
        return type(value).__name__

    def limits(self, support: S, spec: LayerFields) -> list[Reason]:
        """Reasons within a declared feature: the limits ``support`` does not lift."""
        return []

    # -- the float64 reference ------------------------------------------------------------

    def reference_visible(
        self, spec: LayerFields, i: torch.Tensor, j: torch.Tensor, heads: range
    ) -> torch.Tensor | None:
        """Bool, broadcastable to ``[heads, L, L]``: the keys the feature leaves visible in one
        sequence (``i``: int64 ``[L, 1]`` query positions, ``j``: ``[1, L]`` key positions);
        ``None``: all of them."""
        return None

    def reference_score(
        self,
        spec: LayerFields,
        scores: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
        heads: range,
    ) -> torch.Tensor:
        """The float64 ``[heads, L, L]`` scaled scores after the feature (table order is the
        spec's order: soft-cap, then ALiBi)."""
        return scores

    # -- conformance cases ----------------------------------------------------------------

    def cases(
        self, support: S | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        """Numeric cases for a backend declaring ``support``, on the ``masks`` it declares
        (True: causal). Names start with the mask ("causal-", "bidir-")."""
        return []

    def sample(self, support: S, causal: bool) -> dict[str, object] | None:
        """Spec fields turning the feature on in a mild form, for cases that combine features;
        ``None``: not on this mask."""
        return None

    def refusals(self, support: S | None, base: LayerFields) -> list[RefusalSketch]:
        """Specs a backend declaring ``support`` (``None``: not declared) must refuse."""
        if support is not None or self.support is None:
            return []
        fields_on = self.refusal_fields(base)
        if fields_on is None:
            return []
        return [RefusalSketch(self.name.replace("_", "-"), fields_on, self.code)]

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        """Fields turning the feature on for a refusal case; ``None``: none on this base."""
        return None


def mask_name(causal: bool) -> str:
    return "causal" if causal else "bidir"


class WindowFeature(Feature[WindowSupport]):
    name = "window"
    code = ReasonCode.SLIDING_WINDOW
    support = WindowSupport
    title = "sliding-window masks"
    field = "window"

    def validate(self, spec: LayerFields) -> None:
        window = spec.window
        if window is None:
            return
        if not isinstance(window, SlidingWindow):
            raise SpecError(
                "AttentionSpec.window must be a SlidingWindow or None, e.g. "
                f"SlidingWindow.causal(4096); got {window!r}"
            )
        if spec.causal and window.right:
            raise SpecError(
                f"AttentionSpec.window has right={window.right} on a causal spec, "
                "whose queries see no later key: set right=0 (SlidingWindow.causal(W)), or "
                "causal=False for a bidirectional window"
            )

    def explain(self, spec: LayerFields) -> str | None:
        assert spec.window is not None
        return f"window {spec.window.left}/{spec.window.right}"

    def got(self, spec: LayerFields) -> str:
        assert spec.window is not None
        return spec.window.describe()

    def limits(self, support: WindowSupport, spec: LayerFields) -> list[Reason]:
        assert spec.window is not None
        if spec.window.right and not support.right:
            return [
                Reason(
                    self.code,
                    "only left-only windows (keys up to the query) are implemented",
                    "window",
                    spec.window.describe(),
                    "right=0",
                )
            ]
        return []

    def reference_visible(
        self, spec: LayerFields, i: torch.Tensor, j: torch.Tensor, heads: range
    ) -> torch.Tensor | None:
        assert spec.window is not None
        # Differences, not i + right: a side up to MAX_WINDOW never overflows.
        return (i - j <= spec.window.left) & (j - i <= spec.window.right)

    def _windows(self, support: WindowSupport, causal: bool) -> list[tuple[str, SlidingWindow]]:
        if causal or not support.right:
            return [
                ("w8", SlidingWindow.causal(8)),
                ("w1", SlidingWindow.causal(1)),
                ("widest", SlidingWindow(MAX_WINDOW, 0)),
            ]
        return [
            ("w4-4", SlidingWindow(4, 4)),
            ("w0-3", SlidingWindow(0, 3)),
            ("w6-0", SlidingWindow(6, 0)),
            ("w64-64", SlidingWindow(64, 64)),
            ("widest", SlidingWindow(1, MAX_WINDOW)),
        ]

    def cases(
        self, support: WindowSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        assert support is not None
        out: list[CaseSketch] = []
        for causal in masks:
            mask = mask_name(causal)
            windows = self._windows(support, causal)
            for name, window in windows:
                out.append(
                    CaseSketch(
                        f"{mask}-window-{name}",
                        {"causal": causal, "window": window},
                        FEATURE_LENGTHS,
                    )
                )
            out.append(
                CaseSketch(
                    f"{mask}-window-mha-padding",
                    {"causal": causal, "num_kv_heads": base.num_heads, "window": windows[0][1]},
                    FEATURE_LENGTHS,
                    padding_rows=3,
                )
            )
        return out

    def sample(self, support: WindowSupport, causal: bool) -> dict[str, object] | None:
        return {"window": SlidingWindow(5, 2 if not causal and support.right else 0)}

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"window": SlidingWindow.causal(8) if base.causal else SlidingWindow(4, 4)}

    def refusals(self, support: WindowSupport | None, base: LayerFields) -> list[RefusalSketch]:
        if support is not None and not support.right:
            both = {"causal": False, "headwise": None, "window": SlidingWindow(4, 4)}
            return [RefusalSketch("window-right", both, self.code)]
        return super().refusals(support, base)


class SoftcapFeature(Feature[SoftcapSupport]):
    name = "logit_softcap"
    code = ReasonCode.SOFTCAP
    support = SoftcapSupport
    title = "logit soft-capping"
    field = "logit_softcap"

    def validate(self, spec: LayerFields) -> None:
        if spec.logit_softcap is not None:
            low, high = SOFTCAP_RANGE
            bounded_number(
                "AttentionSpec.logit_softcap", spec.logit_softcap, low, high, "Gemma 2: 50.0"
            )

    def canonical(self, spec: LayerFields) -> object:
        cap = spec.logit_softcap
        return float(cap) if cap is not None else None

    def record(self, spec: LayerFields) -> dict[str, object]:
        return {"logit_softcap": spec.logit_softcap}

    def explain(self, spec: LayerFields) -> str | None:
        return f"softcap {spec.logit_softcap:g}"

    def got(self, spec: LayerFields) -> str:
        return str(spec.logit_softcap)

    def reference_score(
        self,
        spec: LayerFields,
        scores: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
        heads: range,
    ) -> torch.Tensor:
        cap = spec.logit_softcap
        assert cap is not None
        return cap * torch.tanh(scores / cap)

    def cases(
        self, support: SoftcapSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        low, high = SOFTCAP_RANGE
        out: list[CaseSketch] = []
        for causal in masks:
            mask = mask_name(causal)
            mha = {"causal": causal, "num_kv_heads": base.num_heads}
            out += [
                CaseSketch(f"{mask}-softcap", {"causal": causal, "logit_softcap": 2.0}),
                CaseSketch(f"{mask}-softcap-mha", {**mha, "logit_softcap": 30.0}),
                CaseSketch(f"{mask}-softcap-largest", {"causal": causal, "logit_softcap": high}),
                CaseSketch(f"{mask}-softcap-smallest", {"causal": causal, "logit_softcap": low}),
            ]
        return out

    def sample(self, support: SoftcapSupport, causal: bool) -> dict[str, object] | None:
        return {"logit_softcap": 5.0}

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"logit_softcap": 30.0}


class AlibiFeature(Feature[AlibiSupport]):
    name = "alibi"
    code = ReasonCode.ALIBI
    support = AlibiSupport
    title = "ALiBi biases"
    field = "alibi"

    def validate(self, spec: LayerFields) -> None:
        alibi = spec.alibi
        if alibi is None:
            return
        if not isinstance(alibi, AlibiSpec):
            raise SpecError(
                "AttentionSpec.alibi must be an AlibiSpec or None, e.g. AlibiSpec() for "
                f"BLOOM's slopes; got {alibi!r}"
            )
        if alibi.slopes is not None and len(alibi.slopes) != spec.num_heads:
            raise SpecError(
                f"AttentionSpec.alibi has {len(alibi.slopes)} slopes for {spec.num_heads} query "
                "heads: give one slope per query head, or AlibiSpec() for BLOOM's slopes"
            )

    def canonical(self, spec: LayerFields) -> object:
        alibi = spec.alibi
        if alibi is None or alibi.slopes is None:
            return alibi
        bloom = bloom_alibi_slopes(spec.num_heads)
        return AlibiSpec() if same_slopes(alibi.slopes, bloom) else alibi

    def explain(self, spec: LayerFields) -> str | None:
        return "alibi"

    def got(self, spec: LayerFields) -> str:
        return "AlibiSpec"

    def limits(self, support: AlibiSupport, spec: LayerFields) -> list[Reason]:
        assert spec.alibi is not None
        reasons: list[Reason] = []
        if not spec.causal and not support.bidirectional:
            reasons.append(
                Reason(
                    self.code,
                    "only the causal ALiBi bias slope * (j - i) is implemented",
                    "causal",
                    "False with alibi",
                    "True",
                )
            )
        # Canonical specs store BLOOM's slopes as None: any slopes left are custom.
        if spec.alibi.slopes is not None and not support.custom_slopes:
            reasons.append(
                Reason(
                    self.code,
                    "the kernel computes BLOOM's ALiBi slopes itself; other slopes are not served",
                    "alibi.slopes",
                    "custom slopes",
                    "AlibiSpec() (BLOOM's slopes)",
                )
            )
        if spec.logit_softcap is not None and not support.with_softcap:
            reasons.append(
                Reason(
                    self.code,
                    "ALiBi and logit soft-capping together are not served",
                    "alibi",
                    "AlibiSpec with logit_softcap",
                    "one of them",
                )
            )
        return reasons

    def reference_score(
        self,
        spec: LayerFields,
        scores: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
        heads: range,
    ) -> torch.Tensor:
        assert spec.alibi is not None
        slopes = spec.alibi.slopes_for(spec.num_heads)
        slope = torch.tensor([slopes[h] for h in heads], dtype=torch.float64, device=i.device)
        distance = (j - i).to(torch.float64)
        if not spec.causal:
            distance = -distance.abs()
        return scores + slope[:, None, None] * distance

    def cases(
        self, support: AlibiSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        assert support is not None
        heads = base.num_heads
        out: list[CaseSketch] = []
        for causal in masks:
            if not (causal or support.bidirectional):
                continue
            mask = mask_name(causal)
            mha = {"causal": causal, "num_kv_heads": heads, "rope": None}
            out += [
                CaseSketch(f"{mask}-alibi", {"causal": causal, "rope": None, "alibi": AlibiSpec()}),
                CaseSketch(
                    f"{mask}-alibi-gqa-rope", {"causal": causal, "alibi": AlibiSpec()}, None, 2
                ),
            ]
            if support.custom_slopes:
                slopes = AlibiSpec(tuple(0.5 / (h + 1) for h in range(heads)))
                extremes = AlibiSpec(tuple((0.0, MAX_ALIBI_SLOPE)[h % 2] for h in range(heads)))
                out += [
                    CaseSketch(
                        f"{mask}-alibi-slopes-mha-strided", {**mha, "alibi": slopes}, form="strided"
                    ),
                    CaseSketch(f"{mask}-alibi-slopes-bounds", {**mha, "alibi": extremes}),
                ]
        return out

    def sample(self, support: AlibiSupport, causal: bool) -> dict[str, object] | None:
        return {"alibi": AlibiSpec()} if causal or support.bidirectional else None

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"alibi": AlibiSpec()}

    def refusals(self, support: AlibiSupport | None, base: LayerFields) -> list[RefusalSketch]:
        if support is None:
            return super().refusals(support, base)
        out: list[RefusalSketch] = []
        if not support.bidirectional:
            bidir = {"causal": False, "headwise": None, "alibi": AlibiSpec()}
            out.append(RefusalSketch("alibi-bidirectional", bidir, self.code))
        if not support.custom_slopes:
            custom = AlibiSpec(tuple(0.5 / (h + 1) for h in range(base.num_heads)))
            out.append(RefusalSketch("alibi-custom-slopes", {"alibi": custom}, self.code))
        if not support.with_softcap:
            both = {"alibi": AlibiSpec(), "logit_softcap": 30.0}
            out.append(RefusalSketch("alibi-with-softcap", both, self.code))
        return out


HEADWISE_SAMPLE = HeadwiseConfig(
    frozenset({0, 3}), sink_token_num=2, swa_token_num=4, seqlen_threshold=8
)
"""Retrieval heads 0 and 3, two sinks, a window of 5 keys, from 8 tokens on: the suite's
varlen batches hold sequences on both sides of the threshold."""


class HeadwiseFeature(Feature[HeadwiseSupport]):
    name = "headwise"
    code = ReasonCode.HEADWISE
    support = HeadwiseSupport
    title = "per-head (headwise) masks"
    field = "headwise"

    def validate(self, spec: LayerFields) -> None:
        config = spec.headwise
        if config is None:
            return
        if not isinstance(config, HeadwiseConfig):
            raise SpecError("AttentionSpec.headwise must be a HeadwiseConfig or None")
        if not spec.causal:
            raise SpecError("headwise masks are causal; set causal=True or drop headwise")
        bad = sorted(h for h in config.retrieval_heads if h >= spec.num_heads)
        if bad:
            raise SpecError(
                f"headwise retrieval heads {bad} are out of range for {spec.num_heads} heads"
            )

    def got(self, spec: LayerFields) -> str:
        return "HeadwiseConfig"

    def reference_visible(
        self, spec: LayerFields, i: torch.Tensor, j: torch.Tensor, heads: range
    ) -> torch.Tensor | None:
        config = spec.headwise
        assert config is not None
        if config.is_full_for(i.shape[0]):
            return None
        local = (j < config.sink_token_num) | (i - j <= config.swa_token_num)
        full = [h in config.retrieval_heads for h in heads]
        retrieval = torch.tensor(full, dtype=torch.bool, device=i.device)[:, None, None]
        return retrieval | local

    def cases(
        self, support: HeadwiseSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        if True not in masks:
            return []
        on = {"causal": True, "headwise": HEADWISE_SAMPLE}
        return [
            CaseSketch("causal-headwise", on),
            CaseSketch("causal-headwise-mixed-lengths", on, (5, 17, 7, 33)),
            CaseSketch(
                "causal-headwise-mha-norope-padding",
                {**on, "num_kv_heads": base.num_heads, "rope": None},
                padding_rows=3,
                form="strided",
            ),
        ]

    def sample(self, support: HeadwiseSupport, causal: bool) -> dict[str, object] | None:
        return {"headwise": HEADWISE_SAMPLE} if causal else None

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        if not base.causal:
            return None  # headwise masks are causal
        return {"headwise": HeadwiseConfig(frozenset({0}), 2, 4, 8)}


class MlaFeature(Feature[MlaSupport]):
    name = "mla"
    code = ReasonCode.MLA
    support = MlaSupport
    title = "MLA attention"
    field = "use_mla"

    def used(self, spec: LayerFields) -> bool:
        return spec.use_mla

    def record(self, spec: LayerFields) -> dict[str, object]:
        return {"use_mla": spec.use_mla}

    def explain(self, spec: LayerFields) -> str | None:
        return "MLA"

    def got(self, spec: LayerFields) -> str:
        return "True"

    def not_declared(self, spec: LayerFields) -> Reason:
        return Reason(self.code, "MLA attention not served", "use_mla", "True", "False")

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"use_mla": True}


class Fp8Feature(Feature[Fp8Support]):
    """FP8 input. Whether it is served at all is the dtype (``Capabilities.dtypes``); this
    descriptor holds the rule beyond it: RoPE or logn on FP8 only with `Fp8Support.preprocess`."""

    name = "fp8"
    code = ReasonCode.FP8
    support = Fp8Support
    title = "FP8 input"
    field = "dtype"

    def used(self, spec: LayerFields) -> bool:
        return spec.is_fp8

    def record(self, spec: LayerFields) -> dict[str, object]:
        return {}  # the dtype says it

    def explain(self, spec: LayerFields) -> str | None:
        return None  # the dtype says it

    def reasons(self, support: Fp8Support | None, spec: LayerFields) -> list[Reason]:
        if not spec.is_fp8 or (support is not None and support.preprocess):
            return []
        applied = " and ".join(
            name
            for name, on in (("RoPE", spec.rope is not None), ("logn", spec.use_logn_attn))
            if on
        )
        if not applied:
            return []
        return [
            Reason(
                self.code,
                f"{applied} on FP8 input would rotate the stored FP8 values in place and write "
                "them back as FP8; apply them before quantising, or pick a backend that declares "
                "Fp8Support(preprocess=True)",
                "dtype",
                f"{dtype_name(spec.dtype)} with {applied}",
                "FP8 without RoPE/logn, or a 16-bit dtype",
            )
        ]

    def refusals(self, support: Fp8Support | None, base: LayerFields) -> list[RefusalSketch]:
        if support is not None and support.preprocess:
            return []
        fields_on = {"dtype": torch.float8_e4m3fn, "rope": RopeSpec(1e4)}
        return [RefusalSketch("fp8-rope", fields_on, self.code)]


class RopeScalingFeature(Feature[FeatureSupport]):
    """Long-context RoPE scaling (``RopeSpec.scaling``). Every backend serves it: a kernel that
    computes only plain theta RoPE is handed rotated Q/K by the torch pass. Its values and
    their validation belong to `RopeScaling` (and `RopeSpec`), which this descriptor defers to."""

    name = "rope_scaling"
    code = ReasonCode.ROPE
    support = None
    title = "RoPE scaling"
    field = "rope"

    def used(self, spec: LayerFields) -> bool:
        return spec.rope is not None and not spec.rope.is_plain

    def validate(self, spec: LayerFields) -> None:
        """Nothing of its own: `RopeScaling` checks its values when built, and against the
        rotated dims when the spec takes its RoPE (``RopeScaling.check_rotary_dim``)."""

    def record(self, spec: LayerFields) -> dict[str, object]:
        return {}  # inside the record of ``rope`` (`RopeSpec.to_dict`)

    def explain(self, spec: LayerFields) -> str | None:
        assert spec.rope is not None and spec.rope.scaling is not None
        return f"rope scaling {spec.rope.scaling.rope_type}"

    def cases(
        self, support: FeatureSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        """One case per scaling rule on ``base``: the chosen pass must apply it (theta-only
        kernels refuse it, so the torch pass serves it) and match the float64 reference. The
        length-dependent rules (dynamic, longrope) run once below and once past their
        threshold of 16 tokens, so both sets of frequencies are checked; padding rows and
        strided input too."""
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
        out: list[CaseSketch] = []
        for name, rule in rules.items():
            on = {"rope": RopeSpec(1e4, scaling=rule)}
            out.append(CaseSketch(f"rope-{name}", on, padding_rows=3, form="strided"))
            if rule.length_dependent:
                out.append(CaseSketch(f"rope-{name}-short", on, (5, 1, 12)))
        return out


class ChunkFeature(Feature[ChunkSupport]):
    """Chunked attention: positions fall into aligned chunks of ``chunk_size`` (``0 ..
    c - 1``, ``c .. 2c - 1``, ...; positions restart with every sequence) and a query sees
    keys of its own chunk only, on top of every other mask term (Llama 4's
    ``attention_chunk_size`` on its causal layers)."""

    name = "chunk"
    code = ReasonCode.CHUNKED
    support = ChunkSupport
    title = "chunked attention"
    field = "chunk_size"

    def validate(self, spec: LayerFields) -> None:
        chunk = spec.chunk_size
        if chunk is None:
            return
        if (
            isinstance(chunk, bool)
            or not isinstance(chunk, int)
            or not 1 <= chunk <= MAX_CHUNK_SIZE
        ):
            raise SpecError(
                f"AttentionSpec.chunk_size must be an int from 1 to {MAX_CHUNK_SIZE} (2**31 - 1, "
                "the int32 range of kernel positions; Llama 4: 8192), or None for no chunks; "
                f"got {shown(chunk)}"
            )

    def record(self, spec: LayerFields) -> dict[str, object]:
        # Listed only when set: every spec without chunks keeps its fingerprint.
        return {} if spec.chunk_size is None else {"chunk_size": spec.chunk_size}

    def explain(self, spec: LayerFields) -> str | None:
        return f"chunk {spec.chunk_size}"

    def got(self, spec: LayerFields) -> str:
        return f"chunk_size={spec.chunk_size}"

    def reference_visible(
        self, spec: LayerFields, i: torch.Tensor, j: torch.Tensor, heads: range
    ) -> torch.Tensor | None:
        chunk = spec.chunk_size
        assert chunk is not None
        return torch.div(i, chunk, rounding_mode="floor") == torch.div(
            j, chunk, rounding_mode="floor"
        )

    def cases(
        self, support: ChunkSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        """Chunks that split the longer sequences at several offsets (8, 3), one token each
        (1), the bound (2**31 - 1: one chunk), with padding rows and MHA, and with a window
        reaching across chunk borders."""
        out: list[CaseSketch] = []
        for causal in masks:
            mask = mask_name(causal)
            for size in (8, 3, 1, MAX_CHUNK_SIZE):
                name = "largest" if size == MAX_CHUNK_SIZE else str(size)
                out.append(
                    CaseSketch(
                        f"{mask}-chunk-{name}",
                        {"causal": causal, "chunk_size": size},
                        FEATURE_LENGTHS,
                    )
                )
            out.append(
                CaseSketch(
                    f"{mask}-chunk-mha-padding-strided",
                    {"causal": causal, "num_kv_heads": base.num_heads, "chunk_size": 4},
                    (9, 4, 13, 2),
                    padding_rows=3,
                    form="strided",
                )
            )
        return out

    def sample(self, support: ChunkSupport, causal: bool) -> dict[str, object] | None:
        return {"chunk_size": 6}

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"chunk_size": 8}


class SinkFeature(Feature[SinkSupport]):
    """Attention sinks (GPT-OSS ``s_aux``): a learned logit per query head in the softmax's
    denominator, after every mask term (a sink is never masked, so even a query that sees a
    single key shares its weight with the sink). The logits are per-layer data, handed to
    ``forward``; the float64 reference takes them the same way
    (`attn_backends.reference_attention`'s ``sinks``), so there is no mask or score piece here.
    """

    name = "attention_sinks"
    code = ReasonCode.SINKS
    support = SinkSupport
    title = "attention sinks"
    field = "attention_sinks"

    def used(self, spec: LayerFields) -> bool:
        return spec.attention_sinks

    def record(self, spec: LayerFields) -> dict[str, object]:
        # Listed only when on: every spec without sinks keeps its fingerprint.
        return {"attention_sinks": True} if spec.attention_sinks else {}

    def explain(self, spec: LayerFields) -> str | None:
        return "sinks"

    def got(self, spec: LayerFields) -> str:
        return "True"

    def not_declared(self, spec: LayerFields) -> Reason:
        return Reason(
            self.code,
            "attention sinks not implemented; needs a backend declaring SinkSupport()",
            "attention_sinks",
            "True",
            "False",
        )

    def cases(
        self, support: SinkSupport | None, base: LayerFields, masks: Sequence[bool]
    ) -> list[CaseSketch]:
        """Sinks on varlen batches of both masks, with MHA, padding rows and strided input,
        and on single tokens (a query that sees only itself: the sink takes the largest share
        there)."""
        out: list[CaseSketch] = []
        for causal in masks:
            mask = mask_name(causal)
            on = {"causal": causal, "attention_sinks": True}
            out += [
                CaseSketch(f"{mask}-sinks", on, FEATURE_LENGTHS),
                CaseSketch(
                    f"{mask}-sinks-mha-padding-strided",
                    {**on, "num_kv_heads": base.num_heads},
                    (9, 4, 13, 2),
                    padding_rows=3,
                    form="strided",
                ),
                CaseSketch(f"{mask}-sinks-single-tokens", on, (1, 1, 1)),
            ]
        return out

    def sample(self, support: SinkSupport, causal: bool) -> dict[str, object] | None:
        return {"attention_sinks": True}

    def refusal_fields(self, base: LayerFields) -> dict[str, object] | None:
        return {"attention_sinks": True}


MLA = MlaFeature()
HEADWISE = HeadwiseFeature()
WINDOW = WindowFeature()
SOFTCAP = SoftcapFeature()
ALIBI = AlibiFeature()
FP8 = Fp8Feature()
ROPE_SCALING = RopeScalingFeature()
CHUNK = ChunkFeature()
SINKS = SinkFeature()

FEATURES: tuple[Feature[Any], ...] = (
    MLA,
    HEADWISE,
    WINDOW,
    SOFTCAP,
    ALIBI,
    FP8,
    ROPE_SCALING,
    CHUNK,
    SINKS,
)
"""Every feature, in the spec's order of application (the soft-cap before ALiBi, the sinks in
the softmax after every mask term) and of ``explain``."""


def feature_named(name: str) -> Feature[Any]:
    """The descriptor called ``name`` (`Feature.name`)."""
    for feature in FEATURES:
        if feature.name == name:
            return feature
    raise KeyError(name)
