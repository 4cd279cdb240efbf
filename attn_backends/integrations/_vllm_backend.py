"""The ``ATTN_BACKENDS`` attention backend of vLLM: encoder-only layers on this library.

vLLM imports this module only when a model asks for the backend (`vllm.register` told vLLM its
qualified name); it needs vLLM 0.33-0.34. The three classes vLLM asks of a backend:

- `AttnBackendsBackend` declares what it serves: attention type ``ENCODER_ONLY`` only, and
  ``validate_configuration`` adds this library's own reasons (`select`'s, for a probe spec of
  the layer's head size, dtype, window and sinks on this machine) to vLLM's generic ones;
- `AttnBackendsMetadataBuilder` turns vLLM's ``CommonAttentionMetadata`` into an
  `EngineBatch` once per batch, from the host copy of ``query_start_loc`` (no device sync);
- `AttnBackendsImpl` is one layer: its spec from the layer's arguments (heads, scale, window as
  vLLM's encoder path reads it, soft-cap, ALiBi, sinks), run by `EngineLayer`, the output
  written into vLLM's buffer. A KV cache handed to it is refused by this library's selector
  (`KVCacheFlagError`), never ignored.

CUDA graphs: the builder declares ``NEVER`` (a plan is made per batch on the host), so vLLM
runs these layers eagerly between its piecewise graphs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from .._select._selector import select
from .._values._errors import AttentionBackendError, FeatureNotSupportedError, IntegrationError
from .._values._features import SlidingWindow
from ._engine_layer import EngineBatch, EngineLayer, LayerShape, refusals
from .vllm import BACKEND_NAME

__all__ = ["AttnBackendsBackend", "AttnBackendsImpl", "AttnBackendsMetadata"]


@dataclass
class AttnBackendsMetadata:
    """One batch of vLLM's encoder-only layers."""

    batch: EngineBatch
    num_actual_tokens: int


def encoder_window(sliding_window: int) -> SlidingWindow:
    """vLLM's ``sliding_window`` on an encoder-only layer: its FlashAttention path passes
    ``window_size=(w - 1, w - 1)``, keys within ``w - 1`` positions on either side."""
    return SlidingWindow(left=sliding_window - 1, right=sliding_window - 1)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class AttnBackendsBackend(AttentionBackend):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's view of this library: encoder-only attention, no KV cache."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[AttnBackendsImpl]:
        return AttnBackendsImpl

    @staticmethod
    def get_builder_cls() -> type[AttnBackendsMetadataBuilder]:
        return AttnBackendsMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return bool(attn_type == AttentionType.ENCODER_ONLY)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: Any,
        attn_type: str,
        has_sliding_window: bool = False,
        **flags: bool,
    ) -> list[str]:
        """vLLM's generic reasons, then this library's for a probe spec of the layer (one
        head: vLLM does not say how many here; the layer's own heads are checked when it
        first runs, by `select`, with a named error)."""
        reasons: list[str] = super().validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            use_mm_prefix,
            use_per_head_quant_scales,
            device_capability,
            attn_type,
            has_sliding_window=has_sliding_window,
            **flags,
        )
        if reasons and attn_type == AttentionType.ENCODER_ONLY:
            return reasons
        shape = LayerShape(
            num_heads=1,
            num_kv_heads=1,
            head_dim=head_size,
            softmax_scale=1 / math.sqrt(head_size) if head_size > 0 else 1.0,
            window=encoder_window(2) if has_sliding_window else None,
            attention_sinks=has_sink,
        )
        try:
            spec = shape.spec(dtype)
        except AttentionBackendError as exc:  # a spec this library cannot even state
            return [*reasons, f"attn_backends: {exc}"]
        # every other attention type reads a cache (decoder) or another sequence
        has_cache = attn_type != AttentionType.ENCODER_ONLY
        return [*reasons, *refusals(spec, device=_device(), has_kv_cache=has_cache)]


class AttnBackendsMetadataBuilder(AttentionMetadataBuilder[AttnBackendsMetadata]):  # type: ignore[misc]
    """vLLM's batch metadata -> one `EngineBatch` for every encoder-only layer of the batch."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnBackendsMetadata:
        meta = common_attn_metadata
        if not isinstance(meta.causal, bool) or meta.causal:
            raise IntegrationError(
                f"vLLM built causal metadata for {BACKEND_NAME}, which serves encoder-only "
                "(bidirectional) layers only; select it for encoder-only attention "
                "(backend_per_kind encoder_only_attention)"
            )
        starts = [int(x) for x in meta.query_start_loc_cpu[: meta.num_reqs + 1].tolist()]
        lengths = [b - a for a, b in itertools.pairwise(starts)]
        if any(n < 0 for n in lengths) or (starts and starts[0] != 0):
            raise IntegrationError(
                f"vLLM's query_start_loc {starts[:8]} are not prefix sums from 0"
            )
        bound = meta.seq_lens_cpu_upper_bound
        if bound is not None:
            longer = [
                i for i, (s, n) in enumerate(zip(bound.tolist(), lengths, strict=True)) if s > n
            ]
            if longer:
                raise IntegrationError(
                    f"vLLM requests {longer[:8]} continue tokens computed in an earlier step "
                    "(sequence longer than its query): that reads a KV cache, which an "
                    f"encoder-only layer on {BACKEND_NAME} never keeps; disable chunked "
                    "prefill for this model"
                )
        return AttnBackendsMetadata(
            EngineBatch.from_lengths(lengths, self.device), int(meta.num_actual_tokens)
        )


class AttnBackendsImpl(AttentionImpl[AttnBackendsMetadata]):  # type: ignore[misc]
    """One encoder-only attention layer of a vLLM model."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unknown: Any,
    ) -> None:
        if attn_type != AttentionType.ENCODER_ONLY:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME} serves encoder-only attention; this layer is {attn_type} "
                "(it keeps a KV cache or reads another sequence): leave it on vLLM's own "
                "backend (backend_per_kind encoder_only_attention selects only those layers)"
            )
        if unknown:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME} does not know the attention arguments {sorted(unknown)} "
                "this model passes, so it cannot tell what they change; use vLLM's own backend"
            )
        if kv_sharing_target_layer_name is not None:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME}: KV sharing with {kv_sharing_target_layer_name} reads another "
                "layer's cache, which encoder-only layers never keep"
            )
        if kv_cache_dtype not in AttnBackendsBackend.supported_kv_cache_dtypes:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME}: kv_cache_dtype {kv_cache_dtype} asks for quantized attention "
                "inputs, which the encoder-only path does not take; leave it 'auto'"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sinks = sinks
        self.layer = EngineLayer(
            LayerShape(
                num_heads=num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=head_size,
                softmax_scale=self.scale,
                window=encoder_window(sliding_window) if sliding_window is not None else None,
                logit_softcap=logits_soft_cap or None,  # vLLM passes 0 for none
                alibi_slopes=tuple(alibi_slopes) if alibi_slopes is not None else None,
                attention_sinks=sinks is not None,
            ),
            engine="vLLM",
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttnBackendsMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME} writes the attention output unquantized; vLLM asked for a "
                "fused output quantization"
            )
        if attn_metadata is None:  # vLLM's memory-profiling run: no batch
            return output.zero_()
        if kv_cache is not None and kv_cache.numel() > 0:
            # the library's own rule: a cache present where the no-cache path runs
            spec, _ = self.layer.selection(query.dtype, query.device)
            select(spec, device=query.device, has_kv_cache=True, need_rope_kv_cache=False)
        if key is None or value is None:
            raise IntegrationError(f"{BACKEND_NAME}: the layer was given no key or value")
        return self.layer.run(attn_metadata.batch, query, key, value, output, sinks=self.sinks)
