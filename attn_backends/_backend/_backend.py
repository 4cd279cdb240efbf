"""`PrefillBackend`: the base that wires a kernel to the packed-QKV contract.

A backend subclass declares ``name`` and ``capabilities`` and writes two small methods:
``plan_kernel`` (per batch) and ``attend`` (per layer, on already-checked Q/K/V views). The base
runs the generic capability checks, the contract, RoPE/logn and output shaping, so a backend
cannot forget any of them. A backend that declares ``capabilities.cuda_graph`` also writes
``plan_graph_kernel`` and ``replan_graph_kernel`` for graph mode (`prepare_graph`).

A plugin registers the class; every instance is bound to one spec. What the class declares
(``name``, ``capabilities``) and judges (``supports``, a classmethod) needs no instance, so the
selector judges classes and constructs only the one it picked: one check per decision.
`PrefillBackend.bind` is the checked constructor for callers that pick a backend themselves;
the constructor resolves once everything that depends only on the spec and the platform (the
RoPE/logn pass as an object, the input layout, a backend's kernel variant) into a frozen
`Binding`. ``prepare``, ``describe`` and the per-layer path (`ForwardPath`, built at the same
time) read it; nothing is decided again per batch or layer.

An instance holds no per-batch state: everything a batch needs lives in its plan, so plans
prepared by any caller, in any order, never disturb each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, TypeVar, cast

import torch

from .._path._contract import (
    BoundForward,
    BufferMemo,
    ForwardPath,
    Fp8Scales,
    InputLayout,
    Kernel,
    PrefillPlan,
    QKVInput,
    QKVViews,
    prepare_plan,
)
from .._path._graph import GraphBucket, GraphPlan, slot_lengths
from .._path._preprocess import GRAPH_MODES, PreprocessChoice, platform_of, resolve_preprocess
from .._values._errors import (
    AttentionBackendError,
    BackendFailure,
    GraphModeError,
    NoBackendError,
    ParamsError,
)
from .._values._params import FMHAParams
from .._values._platform import Platform, detect_platform, indexed
from .._values._reasons import Reason, ReasonCode
from .._values._spec import AttentionSpec
from ._capabilities import Capabilities, check_capabilities


def _named_failure(backend: str, step: str, exc: Exception) -> BackendFailure:
    """A kernel's own exception as `BackendFailure` (the original is the cause), so callers
    catch one named error; the library's own errors pass through unchanged."""
    return BackendFailure(f"backend {backend} failed in {step}(): {type(exc).__name__}: {exc}")


@dataclass(frozen=True, eq=False)
class Binding:
    """What a backend bound to a spec decided for a platform, once: read by ``prepare``,
    ``describe`` (the decision record) and tools such as the benchmark.

    Per batch only one thing is left open, and it is data here: whether the batch fuses RoPE
    into the kernel (`choice_for`), for a backend that fuses only short batches.
    """

    spec: AttentionSpec
    platform: Platform
    layout: InputLayout
    """How the kernel wants its input (`PrefillBackend.input_layout`)."""
    unfused: PreprocessChoice
    """The RoPE/logn pass of a batch the kernel does not fuse RoPE for (the pass object in
    ``unfused.rope_pass`` when it is a separate pass)."""
    fused: PreprocessChoice | None
    """The ``fused`` choice when the kernel applies this spec's RoPE itself (None: never)."""
    fused_max_seqlen: int | None
    """With ``fused``: only batches whose longest sequence has at most this many tokens fuse
    (None: every batch)."""
    variant: object = None
    """The backend's own spec-level choice (`PrefillBackend.kernel_variant`, e.g. flashinfer's
    fa2/fa3 per fusion case); None for backends with none."""

    def choice_for(self, max_seqlen: int) -> PreprocessChoice:
        """The pass of a batch whose longest sequence has ``max_seqlen`` tokens."""
        fused = self.fused
        limit = self.fused_max_seqlen
        if fused is not None and (limit is None or max_seqlen <= limit):
            return fused
        return self.unfused

    @property
    def preprocess(self) -> PreprocessChoice:
        """The pass of a batch of one token (every batch, unless fusing depends on length)."""
        return self.choice_for(1)

    @property
    def separate_qkv_pass(self) -> str:
        """What runs RoPE/logn for separate ``(q, k, v)`` input of an unfused batch: the torch
        pass whenever anything rotates (the others work on packed rows), else nothing."""
        return "torch" if self.unfused.rotates else self.unfused.mode

    def details(self) -> dict[str, str]:
        """The generic part of the decision record."""
        first = self.preprocess
        details = {**first.details(), "input_layout": self.layout}
        if self.fused is not None and self.fused_max_seqlen is not None:
            details["preprocess"] = (
                f"fused for batches of max_seqlen <= {self.fused_max_seqlen}, "
                f"else {self.unfused.mode}"
            )
            if self.unfused.fallback is not None:
                details["preprocess_fallback"] = self.unfused.fallback
        if self.unfused.rotates and self.unfused.mode != "torch":
            details["preprocess_separate_qkv"] = (
                f"torch (separate (q, k, v) input; {self.unfused.mode} works on packed rows)"
            )
        return details


B = TypeVar("B", bound="PrefillBackend")


class PrefillBackend(ABC):
    """Base class implementing `NoCachePrefill` around a kernel; an instance is one binding."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, spec: AttentionSpec, platform: Platform) -> None:
        """Bound to ``spec`` on ``platform``, decided once. The selector constructs the class
        it judged (``supports`` was empty); `bind` is the checked way to construct one."""
        self._spec = spec
        self._elsewhere: dict[Platform, Binding] = {}
        binding = self._decide(spec, platform)
        self._binding = binding
        # attend() is typed for PrefillPlan; graph plans reach it only for backends that
        # declared graph mode (`prepare_graph` refuses the others), hence the wider type.
        self._forward = ForwardPath(
            self.name,
            spec,
            binding.layout,
            cast(Kernel, self),
            reads_addresses=type(self).accepts_rows is not PrefillBackend.accepts_rows,
        )

    @property
    def spec(self) -> AttentionSpec:
        return self._spec

    @classmethod
    def supports(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return check_capabilities(cls.capabilities, spec, platform) + cls.extra_reasons(
            spec, platform
        )

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Backend-specific refusals beyond the declared capabilities."""
        return []

    @classmethod
    def bind(cls: type[B], spec: AttentionSpec, platform: Platform | None = None) -> B:
        """An instance bound to ``spec``: `NoBackendError` with the reasons when ``supports``
        refuses it on ``platform`` (default: this machine's accelerator, else the CPU)."""
        if platform is None:
            platform = detect_platform(extra_libraries=cls.capabilities.requires)
        reasons = cls.supports(spec, platform)
        if reasons:
            raise NoBackendError(
                f"{cls.name} cannot serve this spec on {platform}: "
                + "; ".join(map(str, reasons))
                + "; use attn_backends.select(spec) to pick a backend that can",
                [(cls.name, reasons)],
            )
        return cls(spec, platform)

    # The decision ---------------------------------------------------------------------------

    def kernel_variant(self, spec: AttentionSpec, platform: Platform) -> object:
        """A backend's own choice that depends only on the spec and the platform (a kernel
        implementation, an entry point), made once at bind and kept in `Binding.variant`."""
        return None

    def _decide(self, spec: AttentionSpec, platform: Platform) -> Binding:
        caps = self.capabilities
        unfused = resolve_preprocess(spec, platform, False)
        fused = resolve_preprocess(spec, platform, True) if caps.fused_rope else None
        return Binding(
            spec=spec,
            platform=platform,
            layout=self.input_layout(spec),
            unfused=unfused,
            fused=fused if fused is not None and fused.mode == "fused" else None,
            fused_max_seqlen=caps.fused_rope_max_seqlen,
            variant=self.kernel_variant(spec, platform),
        )

    @property
    def binding(self) -> Binding:
        """The decision made when this instance was bound."""
        return self._binding

    def binding_on(self, platform: Platform) -> Binding:
        """The decision for ``platform``: the bound one for the platform it was bound for
        (always, in an engine), else made once for that platform and kept (a dry-run
        binding run on the device at hand, a test's CPU stand-in for a GPU library)."""
        bound = self.binding
        if platform == bound.platform:
            return bound
        known = self._elsewhere.get(platform)
        if known is None:
            known = self._elsewhere.setdefault(platform, self._decide(bound.spec, platform))
        return known

    def _binding_for(self, device: torch.device) -> Binding:
        """The decision for a batch on ``device``: the bound one on every device of the bound
        platform (same kind, architecture and dry-run flag; a library probe taken at another
        moment does not make another machine), else `binding_on` the device's platform."""
        bound = self.binding
        here, there = platform_of(device), bound.platform
        if here.kind == there.kind and here.arch == there.arch and here.assumed == there.assumed:
            return bound
        return self.binding_on(here)

    def describe(self, platform: Platform) -> dict[str, str]:
        return self.binding_on(platform).details()

    def prepare(self, params: FMHAParams) -> PrefillPlan:
        spec = self._spec
        if not isinstance(params, FMHAParams):
            raise ParamsError(f"prepare() takes FMHAParams, got {type(params).__name__}")
        choice = self._binding_for(params.device).choice_for(params.max_seqlen_q)
        fused = choice.mode == "fused"
        try:
            kernel = self.plan_kernel(spec, params, fused_rope=fused)
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "plan_kernel", exc) from exc
        return prepare_plan(self.name, spec, params, choice, kernel)

    def forward(
        self,
        qkv: QKVInput,
        plan: PrefillPlan | GraphPlan,
        *,
        fp8_scales: Fp8Scales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._forward.run(qkv, plan, fp8_scales, sinks)

    def bind_forward(self, qkv: QKVInput, plan: PrefillPlan) -> BoundForward | None:
        """``forward`` bound to the signature of ``qkv`` (`BoundForward`): ``qkv`` is checked
        in full now, and each later call with an input of that signature (shapes, strides,
        offsets, dtypes, devices), which the caller vouches for, runs the kernel and the
        output check only, returning ``[tokens, Hq, D]``. None where every call takes
        ``forward``: packed input, a plan that rotates, FP8, or a subclass with a ``forward``
        of its own."""
        if type(self).forward is not PrefillBackend.forward:
            return None
        return self._forward.bind(qkv, plan)

    def accepts_rows(self, rows: torch.Tensor) -> bool:
        """Whether the kernel can read these packed rows in place (e.g. an alignment rule); if
        not, the contract hands it a dense copy. Asked once per plan and buffer signature: for
        separate q/k/v that the plan does not write, the signature holds the address only as
        its alignment (the largest power of two up to 256 bytes dividing it), so the rule may
        depend on no more than that."""
        return True

    @classmethod
    def kernel_modules(cls, spec: AttentionSpec, device: torch.device) -> tuple[KernelModule, ...]:
        """Compiled kernel modules ``spec`` loads on ``device`` (every per-batch path), for
        warm-up's estimate; empty for a backend whose kernels need no build."""
        return ()

    def input_layout(self, spec: AttentionSpec) -> InputLayout:
        """Memory layout the kernel needs; by default from ``capabilities.needs_contiguous``."""
        return "dense-tensors" if self.capabilities.needs_contiguous else "views"

    # Graph mode ---------------------------------------------------------------------------

    def graph_reasons(self, spec: AttentionSpec, device: torch.device) -> list[Reason]:
        """Why this backend cannot serve graph mode for ``spec`` on ``device`` (empty: it can)."""
        if not self.capabilities.cuda_graph:
            return [
                Reason(
                    ReasonCode.CUDA_GRAPH,
                    "does not declare graph mode (capture once per bucket, re-plan per batch)",
                    "capabilities.cuda_graph",
                    "False",
                    "True (a backend that declares graph mode)",
                )
            ]
        return []

    def prepare_graph(
        self, bucket: GraphBucket, *, device: torch.device | str | None = None
    ) -> GraphPlan:
        """A plan for every batch of ``bucket``: capture ``forward`` with it once, then
        ``plan.update(params)`` per batch and replay. Raises `GraphModeError` with the reasons
        when this backend cannot serve graph mode for its spec."""
        spec = self._spec
        if not isinstance(bucket, GraphBucket):
            raise ParamsError(f"prepare_graph() takes a GraphBucket, got {type(bucket).__name__}")
        try:
            # FMHAParams carry the indexed device their tensors landed on ("cuda:0").
            dev = indexed(device if device is not None else "cuda")
        except (RuntimeError, TypeError, AssertionError) as exc:
            raise ParamsError(f"device {device!r} cannot hold a graph plan: {exc}") from None
        choice = self._binding_for(dev).choice_for(bucket.seqlen_limit)
        fused = choice.mode == "fused"
        mode = choice.mode
        reasons = self.graph_reasons(spec, dev)
        if mode not in GRAPH_MODES:
            skipped = f" ({choice.fallback})" if choice.fallback else ""
            reasons.append(
                Reason(
                    ReasonCode.CUDA_GRAPH,
                    f"the {mode} RoPE/logn pass takes the token count on the host and cannot be "
                    "replayed for another batch; graph mode needs the native kernel, fused RoPE "
                    f"or no RoPE/logn{skipped}",
                    "preprocess",
                    mode,
                    ", ".join(sorted(GRAPH_MODES)),
                )
            )
        if reasons:
            raise GraphModeError(
                f"{self.name} cannot serve graph mode here: " + "; ".join(map(str, reasons)),
                [(self.name, reasons)],
            )
        try:
            kernel = self.plan_graph_kernel(spec, bucket, dev, fused_rope=fused)
            self.replan_graph_kernel(spec, kernel, slot_lengths(bucket, ()))
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "plan_graph_kernel", exc) from exc
        return GraphPlan(
            backend=self.name,
            spec=spec,
            bucket=bucket,
            device=dev,
            preprocess=mode,
            kernel=kernel,
            replan=self._replan_graph,
            memo=BufferMemo(),
        )

    def _replan_graph(self, plan: GraphPlan, slots: tuple[int, ...]) -> None:
        try:
            self.replan_graph_kernel(plan.spec, plan.kernel, slots)
        except AttentionBackendError:
            raise
        except Exception as exc:
            raise _named_failure(self.name, "replan_graph_kernel", exc) from exc

    def plan_graph_kernel(
        self, spec: AttentionSpec, bucket: GraphBucket, device: torch.device, *, fused_rope: bool
    ) -> object:
        """Fixed device state for ``bucket`` (graph-mode backends override it)."""
        raise GraphModeError(f"{self.name} has no graph mode", [(self.name, [])])

    def replan_graph_kernel(
        self, spec: AttentionSpec, kernel: object, slots: tuple[int, ...]
    ) -> None:
        """Plan the fixed-size sequence list ``slots`` into ``kernel``'s state, in place."""
        raise GraphModeError(f"{self.name} has no graph mode", [(self.name, [])])

    # Per batch and per layer ----------------------------------------------------------------

    @abstractmethod
    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> object:
        """Per-batch kernel planning; ``fused_rope`` says the kernel must apply RoPE itself.

        What it returns is the plan's own state: it must not be shared with other plans."""

    @abstractmethod
    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        """Attention on checked views; returns ``[tokens, Hq, D]`` in the output dtype.

        A backend that declares ``capabilities.cuda_graph`` also receives `GraphPlan`s here
        (and types ``plan`` as `AnyPlan`); any other never does: `prepare_graph` refuses it."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} bound to {self._spec.num_heads} heads>"


# `KernelModule`: one compiled kernel library a backend loads, as warm-up reports it.


@dataclass(frozen=True)
class KernelModule:
    name: str
    """What the library calls it, e.g. ``flashinfer fa3 bfloat16 d128 posenc=NONE``."""
    cached: bool | None
    """Built already (a load, not a compile); None when the library cannot tell."""
    build_cpu_seconds: float | None
    """Rough CPU-seconds to compile it; divide by the build's parallel jobs for wall time."""
    longest_object_seconds: float | None
    """Rough seconds of its slowest object file: no number of jobs builds it faster."""
    cache_dir: str | None
    """Where the library keeps it once built."""
