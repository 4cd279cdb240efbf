"""The ``attn_backends`` attention backend of SGLang: encoder-only layers on this library.

SGLang builds it through the factory `sglang.register` put in its registry, once per model
runner; it needs SGLang 0.5.23 or a later 0.5 release. Per batch, ``init_forward_metadata``
turns the ``ForwardBatch``'s host lengths (``extend_seq_lens_cpu``) into an `EngineBatch`; per
layer, ``forward_extend`` runs the ``RadixAttention`` layer through `EngineLayer` (its spec from
the layer's heads, scale, window and soft-cap) and returns ``[tokens, Hq * D]``.

What an encoder-only layer never needs, it never touches: SGLang's KV pool is neither written
nor read (``save_kv_cache`` asks for a write no later batch reads, as SGLang's own FlashInfer
path also skips for these layers). What would need it is refused with `IntegrationError`, by
name: decode batches, decoder and cross-attention layers, and batches whose requests reuse
cached prefix tokens; a server whose radix cache is on (it hands batches such prefixes) is
refused when the backend is built.

The window of an encoder-only layer (``sliding_window_size`` w) is read as SGLang's FlashAttention
and Triton backends read it there: keys within ``w`` positions on either side.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType

from .._values._errors import FeatureNotSupportedError, IntegrationError
from .._values._features import SlidingWindow
from ._engine_layer import EngineBatch, EngineLayer, LayerShape
from .sglang import BACKEND_NAME

__all__ = ["AttnBackendsSGLangBackend", "layer_shape"]


def layer_shape(layer: Any) -> LayerShape:
    """The spec fields of a ``RadixAttention`` layer, or `FeatureNotSupportedError` naming
    what the layer asks for that this backend does not serve."""
    name = f"{BACKEND_NAME} (layer {layer.layer_id})"
    if layer.attn_type != AttentionType.ENCODER_ONLY or layer.is_cross_attention:
        kind = "cross-attention" if layer.is_cross_attention else layer.attn_type.value
        raise FeatureNotSupportedError(
            f"{name} serves encoder-only self-attention; this layer is {kind}, which reads a "
            "KV cache or another sequence: serve this model with another --attention-backend"
        )
    if layer.qk_head_dim != layer.v_head_dim:
        raise FeatureNotSupportedError(
            f"{name}: q/k head dim {layer.qk_head_dim} differs from v head dim "
            f"{layer.v_head_dim}; attn_backends needs one head dim"
        )
    extras = {
        "pos_encoding_mode": (layer.pos_encoding_mode, "NONE"),
        "use_irope": (layer.use_irope, False),
        "xai_temperature_len": (layer.xai_temperature_len, -1),
    }
    odd = {key: got for key, (got, plain) in extras.items() if got != plain}
    if layer.logit_cap and layer.logit_capping_method != "tanh":
        odd["logit_capping_method"] = layer.logit_capping_method
    if odd:
        raise FeatureNotSupportedError(
            f"{name} does not serve {odd}: use SGLang's own backend for this model"
        )
    window = layer.sliding_window_size
    return LayerShape(
        num_heads=layer.tp_q_head_num,
        num_kv_heads=layer.tp_k_head_num,
        head_dim=layer.qk_head_dim,
        softmax_scale=float(layer.scaling),
        window=SlidingWindow(left=window, right=window)
        if window is not None and window >= 0
        else None,
        logit_softcap=float(layer.logit_cap) if layer.logit_cap else None,
    )


class AttnBackendsSGLangBackend(AttentionBackend):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's view of this library: encoder-only extend batches, no KV pool."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        if not model_runner.server_args.disable_radix_cache:
            raise IntegrationError(
                f"{BACKEND_NAME} keeps no KV cache for encoder-only layers, but SGLang's radix "
                "cache is on: it would hand later batches cached prefix tokens that were never "
                "written. Launch with --disable-radix-cache"
            )
        self.device = torch.device(model_runner.device)
        # SGLang reads the pools through the backend; this one reads neither
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: EngineBatch | None = None
        self._layers: dict[int, tuple[Any, EngineLayer]] = {}

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Once per batch: the extend batch's lengths as an `EngineBatch` (host values only)."""
        self.forward_metadata = None
        if not forward_batch.forward_mode.is_extend():
            return  # decode and idle batches: forward_decode refuses, idle runs no layer
        prefix = forward_batch.extend_prefix_lens_cpu
        if prefix is not None and any(int(n) for n in prefix):
            reused = [i for i, n in enumerate(prefix) if int(n)]
            raise IntegrationError(
                f"{BACKEND_NAME}: requests {reused[:8]} reuse cached prefix tokens; an "
                "encoder-only layer on attn_backends keeps no KV cache to read them from. "
                "Launch with --disable-radix-cache and --chunked-prefill-size -1"
            )
        lengths = forward_batch.extend_seq_lens_cpu
        if lengths is None:
            lengths = forward_batch.extend_seq_lens.tolist()
        self.forward_metadata = EngineBatch.from_lengths(lengths, self.device)

    def _layer(self, layer: Any) -> EngineLayer:
        found = self._layers.get(id(layer))
        if found is None or found[0] is not layer:
            found = (layer, EngineLayer(layer_shape(layer), engine="SGLang"))
            self._layers[id(layer)] = found
        return found[1]

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        runner = self._layer(layer)
        # sinks, score_mod, return_lse, k_rope...: each changes what the layer computes
        asked = sorted(
            key for key, value in kwargs.items() if value is not None and value is not False
        )
        if forward_batch.mha_return_lse:
            asked.append("mha_return_lse")
        if asked:
            raise FeatureNotSupportedError(
                f"{BACKEND_NAME} does not serve {asked} on layer {layer.layer_id}: use SGLang's "
                "own backend for this model"
            )
        if k is None or v is None:
            raise IntegrationError(f"{BACKEND_NAME}: layer {layer.layer_id} gave no key or value")
        batch = self.forward_metadata
        if batch is None:
            raise IntegrationError(
                f"{BACKEND_NAME}: layer {layer.layer_id} ran before init_forward_metadata "
                "prepared an extend batch"
            )
        width = layer.tp_q_head_num * layer.v_head_dim
        given = forward_batch._attn_output  # SGLang's buffer for the layer, when it has one
        if given is not None and tuple(given.shape) == (q.shape[0], width):
            output = given
        else:
            output = q.new_empty(q.shape[0], width)
        return runner.run(batch, q, k, v, output)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        raise IntegrationError(
            f"{BACKEND_NAME} serves encoder-only prefill: a decode batch reads the KV cache of "
            "earlier tokens, which this backend never keeps; serve generation with another "
            "--attention-backend"
        )
