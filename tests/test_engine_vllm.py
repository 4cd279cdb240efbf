"""The vLLM plugin on vLLM's own classes, on the CPU.

vLLM loads the plugin through its own entry-point loader (``load_general_plugins``); the backend
is found through vLLM's registry (``AttentionBackendEnum[...]``), wrapped by vLLM's own
encoder-only factory (what ``EncoderOnlyAttention`` does with the backend it selected), built
into vLLM's ``Attention`` layer, given metadata by the builder from a real
``CommonAttentionMetadata`` and run by vLLM's ``unified_attention_with_output`` inside its
forward context. Nothing of vLLM is replaced. ``scripts/engines/test-cpu.sh vllm`` installs
vLLM and runs this file; without vLLM it is skipped.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import torch

import attn_backends as ab
from attn_backends.errors import FeatureNotSupportedError, IntegrationError, KVCacheFlagError
from tests.engine_support import Projection, assert_matches_reference, projection

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/engines/test-cpu.sh)")

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention.encoder_only_attention import (  # noqa: E402
    create_encoder_only_attention_backend,
)
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec  # noqa: E402

NAME = "ATTN_BACKENDS"
_names = itertools.count()


@pytest.fixture(scope="module")
def backend() -> Any:
    """The backend class as vLLM finds it, after vLLM's own plugin loader ran."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", "attn_backends")
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    return AttentionBackendEnum[NAME].get_class()


@pytest.fixture(scope="module")
def config(backend: Any) -> VllmConfig:
    from vllm.config.attention import AttentionConfig

    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend=NAME),
    )


def common_metadata(lengths: tuple[int, ...], rows: int) -> CommonAttentionMetadata:
    """vLLM's metadata of an encoder-only batch, as its encoder-only model state builds it:
    ``rows`` token rows (padding after the batch's tokens), dummy block table and slots."""
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq = torch.tensor(lengths, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        seq_lens=seq,
        num_reqs=len(lengths),
        num_actual_tokens=rows,
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        block_table_tensor=torch.zeros(len(lengths), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def encoder_cache_spec(
    kv_heads: int, dim: int, dtype: torch.dtype = torch.float32
) -> EncoderOnlyAttentionSpec:
    """The (empty) cache spec vLLM gives an encoder-only layer group's metadata builder."""
    return EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=kv_heads, head_size=dim, dtype=dtype
    )


def encoder_layer(backend: Any, config: VllmConfig, **kw: Any) -> tuple[Attention, Any]:
    """vLLM's Attention layer of type ENCODER_ONLY on the registered backend, as
    ``EncoderOnlyAttention`` builds it, and that backend class."""
    wrapped = create_encoder_only_attention_backend(backend)
    prefix = f"layers.{next(_names)}.attn"
    with set_current_vllm_config(config):
        layer = Attention(
            prefix=prefix, attn_backend=wrapped, attn_type=AttentionType.ENCODER_ONLY, **kw
        )
    layer.kv_cache = torch.empty(0)  # what vLLM binds to encoder-only layers
    return layer, wrapped


def run(
    backend: Any,
    config: VllmConfig,
    proj: Projection,
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    **kw: Any,
) -> torch.Tensor:
    layer, wrapped = encoder_layer(
        backend,
        config,
        num_heads=heads,
        head_size=dim,
        scale=kw.pop("scale", 1 / math.sqrt(dim)),
        num_kv_heads=kv_heads,
        **kw,
    )
    spec = encoder_cache_spec(kv_heads, dim, proj.qkv.dtype)
    builder = wrapped.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    meta = builder.build(0, common_metadata(proj.lengths, proj.qkv.shape[0]))
    with set_forward_context({layer.layer_name: meta}, config):
        out: torch.Tensor = layer(proj.q, proj.k, proj.v)
    return out


CASES = [
    pytest.param((5, 1, 7), 4, 4, 16, 0, id="varlen-mha"),
    pytest.param((9, 3, 12, 2), 8, 2, 32, 0, id="varlen-gqa"),
    pytest.param((1,), 2, 1, 16, 0, id="single-token"),
    pytest.param((6, 4), 4, 2, 16, 5, id="padding-rows"),
]


@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim", "pad"), CASES)
def test_encoder_batches_match_float64(backend, config, lengths, heads, kv_heads, dim, pad):
    proj = projection(lengths, heads, kv_heads, dim, pad=pad, seed=sum(lengths))
    out = run(backend, config, proj, heads=heads, kv_heads=kv_heads, dim=dim)
    spec = ab.AttentionSpec(heads, kv_heads, dim, torch.float32, causal=False)
    assert_matches_reference(out, proj, spec)


def test_window_is_read_as_vllms_encoder_path_reads_it(backend, config):
    """vLLM's FlashAttention passes ``(w - 1, w - 1)`` for an encoder-only window ``w``."""
    proj = projection((20, 9), 4, 2, 16, pad=2, seed=3)
    out = run(backend, config, proj, heads=4, kv_heads=2, dim=16, per_layer_sliding_window=4)
    window = ab.SlidingWindow(left=3, right=3)
    spec = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False, window=window)
    assert_matches_reference(out, proj, spec)
    wider = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False, window=ab.SlidingWindow(4, 4))
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches_reference(out, proj, wider)


def test_scale_and_softcap_reach_the_spec(backend, config):
    proj = projection((7, 5), 2, 2, 16, seed=4)
    out = run(backend, config, proj, heads=2, kv_heads=2, dim=16, scale=0.7, logits_soft_cap=2.0)
    spec = ab.AttentionSpec(
        2, 2, 16, torch.float32, causal=False, softmax_scale=0.7, logit_softcap=2.0
    )
    assert_matches_reference(out, proj, spec)


def test_registry_lookup_names_the_plugins_backend(backend):
    assert backend.get_name() == NAME
    assert AttentionBackendEnum[NAME].get_path() == (
        "attn_backends.integrations._vllm_backend.AttnBackendsBackend"
    )
    assert backend.supports_attn_type(AttentionType.ENCODER_ONLY)
    assert not backend.supports_attn_type(AttentionType.DECODER)


def test_registering_again_is_harmless(backend):
    from attn_backends.integrations import vllm as plugin

    plugin.register()
    assert AttentionBackendEnum[NAME].get_class() is backend


def validate(backend: Any, **fields: Any) -> list[str]:
    """``validate_configuration`` called as vLLM's CUDA platform calls it."""
    selector = AttentionSelectorConfig(
        head_size=fields.pop("head_size", 64),
        dtype=fields.pop("dtype", torch.float32),
        kv_cache_dtype=fields.pop("kv_cache_dtype", "auto"),
        block_size=None,
        **fields,
    )
    reasons: list[str] = backend.validate_configuration(
        device_capability=None, **selector._asdict()
    )
    return reasons


def test_encoder_only_configuration_is_valid(backend):
    assert validate(backend, attn_type=AttentionType.ENCODER_ONLY) == []
    assert validate(backend, attn_type=AttentionType.ENCODER_ONLY, has_sliding_window=True) == []


def test_decoder_layers_are_refused_with_the_librarys_reason(backend):
    """Qwen3-Embedding runs vLLM's decoder path with a paged cache: a cache-present call."""
    reasons = validate(backend, attn_type=AttentionType.DECODER)
    # vLLM's own reason (0.33 prints the enum member, 0.34 its value)
    assert any(re.fullmatch(r"attention type \S*decoder not supported", r, re.I) for r in reasons)
    assert any("[kv_cache_present]" in r for r in reasons), reasons


def test_the_librarys_refusal_reaches_vllms_validation(backend, monkeypatch):
    """With every backend switched off, vLLM is told why, in this library's words."""
    from attn_backends.deploy import clear_selection_cache, get_registry

    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", ",".join(e.name for e in get_registry().entries()))
    clear_selection_cache()
    try:
        reasons = validate(backend, attn_type=AttentionType.ENCODER_ONLY)
    finally:
        monkeypatch.undo()
        clear_selection_cache()
    assert reasons[0].startswith("attn_backends: no backend serves"), reasons
    assert any("[disabled]" in r for r in reasons), reasons


def test_a_layer_no_backend_serves_is_refused_at_its_first_batch(backend, config):
    """vLLM's validation does not see soft-capping; the layer's own spec is judged when it
    first runs, and refused by name."""
    proj = projection((3, 2), 2, 2, 16)
    sinks = torch.zeros(2)
    with pytest.raises(ab.NoBackendError, match="softcap 2, sinks"):
        run(backend, config, proj, heads=2, kv_heads=2, dim=16, logits_soft_cap=2.0, sinks=sinks)


def test_fp8_cache_dtype_is_refused(backend):
    reasons = validate(backend, attn_type=AttentionType.ENCODER_ONLY, kv_cache_dtype="fp8")
    assert "kv_cache_dtype not supported" in reasons


def test_a_kv_cache_handed_to_the_layer_is_refused_by_the_selector(backend, config):
    proj = projection((4, 3), 2, 2, 16)
    layer, wrapped = encoder_layer(
        backend, config, num_heads=2, head_size=16, scale=0.25, num_kv_heads=2
    )
    layer.kv_cache = torch.zeros(2, 16, 2, 32)
    spec = encoder_cache_spec(2, 16)
    builder = wrapped.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    meta = builder.build(0, common_metadata(proj.lengths, proj.tokens))
    with (
        set_forward_context({layer.layer_name: meta}, config),
        pytest.raises(KVCacheFlagError, match="KV cache is present"),
    ):
        layer(proj.q, proj.k, proj.v)


def test_causal_metadata_is_refused(backend, config):
    """The plain (decoder) builder keeps ``causal=True``; only the encoder-only wrapper clears
    it, and the plugin serves nothing else."""
    spec = encoder_cache_spec(2, 16)
    builder = backend.get_builder_cls()(spec, ["x"], config, torch.device("cpu"))
    with pytest.raises(IntegrationError, match="causal"):
        builder.build(0, common_metadata((3, 2), 5))


def test_a_request_continuing_earlier_tokens_is_refused(backend, config):
    wrapped = create_encoder_only_attention_backend(backend)
    spec = encoder_cache_spec(2, 16)
    builder = wrapped.get_builder_cls()(spec, ["x"], config, torch.device("cpu"))
    meta = common_metadata((3, 2), 5)
    meta.seq_lens_cpu_upper_bound = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(IntegrationError, match=r"requests \[1\] continue"):
        builder.build(0, meta)


def test_unknown_layer_arguments_are_refused(backend, config):
    with pytest.raises(FeatureNotSupportedError, match="chunk_lookback"):
        encoder_layer(backend, config, num_heads=2, head_size=16, scale=0.25, chunk_lookback=-2)


def test_decoder_impl_is_refused_by_name(backend):
    with pytest.raises(FeatureNotSupportedError, match="encoder-only"):
        backend.get_impl_cls()(2, 16, 0.25, 2, None, None, "auto", None, AttentionType.DECODER)


def test_alibi_slopes_are_the_bidirectional_bias(backend, config):
    """vLLM hands ALiBi slopes to the layer; on an encoder the bias is ``-slope * |i - j|``."""
    slopes = [0.5, 0.125]
    proj = projection((8, 5), 2, 2, 16, seed=6)
    out = run(backend, config, proj, heads=2, kv_heads=2, dim=16, alibi_slopes=slopes)
    spec = ab.AttentionSpec(
        2, 2, 16, torch.float32, causal=False, alibi=ab.AlibiSpec(tuple(slopes))
    )
    assert_matches_reference(out, proj, spec)


def test_attention_sinks_reach_the_backend(backend, config):
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0])
    proj = projection((6, 3), 4, 2, 16, pad=1, seed=7)
    out = run(backend, config, proj, heads=4, kv_heads=2, dim=16, sinks=sinks)
    spec = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False, attention_sinks=True)
    assert_matches_reference(out, proj, spec, sinks=sinks)


def test_engine_benchmark_runs_this_librarys_backend(tmp_path):
    """benchmarks/engine_bench.py through vLLM's layers; the default baseline (FLASH_ATTN)
    needs a GPU and vLLM's compiled kernels, so on a CPU machine it is reported as not run."""
    import json

    from tests.script_support import load_script

    bench = load_script("benchmarks/engine_bench.py")
    out = tmp_path / "engine.json"
    args = ["--engine", "vllm", "--device", "cpu", "--layers", "1", "--repeats", "1"]
    assert bench.main([*args, "--workload", "queries", "--out", str(out)]) == 0
    backends = json.loads(out.read_text())["backends"]
    assert backends[NAME]["latency_tokens_per_s"] > 0
    if not torch.cuda.is_available():
        assert "error" in backends["FLASH_ATTN"]


def test_a_head_size_no_spec_can_state_is_a_reason_not_a_crash(backend):
    reasons = validate(backend, attn_type=AttentionType.ENCODER_ONLY, head_size=0)
    assert len(reasons) == 1 and reasons[0].startswith("attn_backends:"), reasons
