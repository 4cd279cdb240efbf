"""The SGLang plugin on SGLang's own classes, on the CPU.

SGLang's plugin loader (``load_plugins``) runs the entry point; the backend is built through
SGLang's registry lookup (``_build_full_attention_backend_from_str``, what the model runner
calls for ``--attention-backend``) and run by SGLang's ``RadixAttention`` inside its forward
context, on a real ``ForwardBatch`` whose request and KV pools are SGLang's own
(``ReqToTokenPool``, ``MHATokenToKVPool``). The model runner, which needs a loaded model, is the
one stand-in: a namespace holding what backend factories read of it (device and pools).
``scripts/engines/test-cpu.sh sglang`` installs SGLang and runs this file; without SGLang it
is skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import attn_backends as ab
from attn_backends.errors import FeatureNotSupportedError, IntegrationError
from tests.engine_support import Projection, assert_matches_reference, projection

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/engines/test-cpu.sh)")
try:
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
except ModuleNotFoundError as exc:  # pragma: no cover - the environment, not the plugin
    pytest.skip(f"SGLang does not import here: {exc}", allow_module_level=True)

from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    compute_position_torch,
)
from sglang.srt.model_executor.forward_context import (
    ForwardContext,
    forward_context,
)
from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
    _build_full_attention_backend_from_str,
)

NAME = "attn_backends"
_layer_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _plugins_loaded() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_PLUGINS", "attn_backends")
        from sglang.srt.plugins import load_plugins

        load_plugins()


def pools(heads: int, dim: int) -> tuple[ReqToTokenPool, MHATokenToKVPool]:
    req = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=128,
        page_size=1,
        dtype=torch.float32,
        head_num=heads,
        head_dim=dim,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    return req, kv


def model_runner(kv_heads: int, dim: int, *, radix_cache: bool = False) -> SimpleNamespace:
    """What backend factories read of SGLang's model runner: device, pools, server arguments."""
    req, kv = pools(kv_heads, dim)
    server = SimpleNamespace(disable_radix_cache=not radix_cache)
    return SimpleNamespace(
        device="cpu", req_to_token_pool=req, token_to_kv_pool=kv, server_args=server
    )


def build_backend(kv_heads: int, dim: int, *, radix_cache: bool = False) -> Any:
    runner = model_runner(kv_heads, dim, radix_cache=radix_cache)
    return _build_full_attention_backend_from_str(
        model_runner=runner, backend_str=NAME, init_new_workspace=False
    )


def extend_batch(
    lengths: tuple[int, ...], rows: int, prefix: tuple[int, ...] | None = None
) -> ForwardBatch:
    """SGLang's extend batch of ``lengths`` (0: a request slot SGLang pads a graph batch
    with) over ``rows`` token rows."""
    count = len(lengths)
    seq = torch.tensor(lengths, dtype=torch.int32)
    before = torch.tensor(prefix or (0,) * count, dtype=torch.int32)
    positions, starts = compute_position_torch(before, seq)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=count,
        input_ids=torch.zeros(rows, dtype=torch.int64),
        req_pool_indices=torch.arange(count),
        seq_lens=seq + before,
        out_cache_loc=torch.arange(1, rows + 1, dtype=torch.int64),
        seq_lens_sum=int((seq + before).sum()),
        seq_lens_cpu=(seq + before).clone(),
        positions=positions,
        extend_num_tokens=rows,
        extend_seq_lens=seq,
        extend_prefix_lens=before,
        extend_start_loc=starts,
        extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=list(prefix or (0,) * count),
        is_prefill_only=True,
    )


def encoder_layer(heads: int, kv_heads: int, dim: int, **kw: Any) -> RadixAttention:
    kw.setdefault("attn_type", AttentionType.ENCODER_ONLY)
    return RadixAttention(
        num_heads=heads,
        head_dim=dim,
        scaling=kw.pop("scaling", dim**-0.5),
        num_kv_heads=kv_heads,
        layer_id=next(_layer_ids),
        **kw,
    )


def run(
    proj: Projection,
    lengths: tuple[int, ...],
    heads: int,
    kv_heads: int,
    dim: int,
    **kw: Any,
) -> tuple[torch.Tensor, Any]:
    backend = build_backend(kv_heads, dim)
    batch = extend_batch(lengths, proj.qkv.shape[0])
    backend.init_forward_metadata(batch)
    layer = encoder_layer(heads, kv_heads, dim, **kw)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
        out = layer(proj.q, proj.k, proj.v, batch)
    return out, backend


CASES = [
    pytest.param((5, 1, 7), 4, 4, 16, id="varlen-mha"),
    pytest.param((9, 3, 12, 2), 8, 2, 32, id="varlen-gqa"),
    pytest.param((1,), 2, 1, 16, id="single-token"),
]


@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"), CASES)
def test_encoder_batches_match_float64(lengths, heads, kv_heads, dim):
    proj = projection(lengths, heads, kv_heads, dim, seed=sum(lengths))
    out, backend = run(proj, lengths, heads, kv_heads, dim)
    assert_matches_reference(
        out, proj, ab.AttentionSpec(heads, kv_heads, dim, torch.float32, False)
    )
    # the KV pool was neither written nor read: every slot still holds its initial zeros
    assert not backend.token_to_kv_pool.get_key_buffer(0).any()


def test_request_slots_padded_for_graphs_hold_no_token():
    """SGLang pads a graph batch's request slots with zero-length sentinels."""
    proj = projection((6, 4), 4, 2, 16, pad=3, seed=2)
    out, _ = run(proj, (6, 4, 0, 0), 4, 2, 16)
    assert_matches_reference(out, proj, ab.AttentionSpec(4, 2, 16, torch.float32, False))


def test_window_is_read_as_sglangs_flash_and_triton_backends_read_it():
    """FlashAttention and Triton in SGLang keep ``|i - j| <= w`` on an encoder-only layer."""
    proj = projection((20, 9), 4, 2, 16, seed=3)
    out, _ = run(proj, (20, 9), 4, 2, 16, sliding_window_size=3)
    window = ab.SlidingWindow(left=3, right=3)
    assert_matches_reference(
        out, proj, ab.AttentionSpec(4, 2, 16, torch.float32, False, window=window)
    )
    narrower = ab.AttentionSpec(4, 2, 16, torch.float32, False, window=ab.SlidingWindow(2, 2))
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches_reference(out, proj, narrower)


def test_scale_and_softcap_reach_the_spec():
    proj = projection((7, 5), 2, 2, 16, seed=4)
    out, _ = run(proj, (7, 5), 2, 2, 16, scaling=0.7, logit_cap=2.0)
    spec = ab.AttentionSpec(2, 2, 16, torch.float32, False, softmax_scale=0.7, logit_softcap=2.0)
    assert_matches_reference(out, proj, spec)


def test_the_flag_takes_the_name_once_the_plugin_loaded():
    from sglang.srt.server_args import ServerArgs

    assert NAME in ATTENTION_BACKEND_CHOICES
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "x", "--attention-backend", NAME])
    assert args.attention_backend == NAME


def test_registering_again_is_harmless():
    from attn_backends.integrations import sglang as plugin

    plugin.register()
    assert ATTENTION_BACKEND_CHOICES.count(NAME) == 1
    assert build_backend(2, 16) is not None


def test_a_server_with_the_radix_cache_on_is_refused_at_startup():
    with pytest.raises(IntegrationError, match="--disable-radix-cache"):
        build_backend(2, 16, radix_cache=True)
    assert build_backend(2, 16, radix_cache=False)


def test_cached_prefix_tokens_are_refused():
    backend = build_backend(2, 16)
    with pytest.raises(IntegrationError, match=r"requests \[1\] reuse cached prefix"):
        backend.init_forward_metadata(extend_batch((3, 2), 5, prefix=(0, 4)))


def test_decode_batches_are_refused():
    backend = build_backend(2, 16)
    proj = projection((1, 1), 2, 2, 16)
    batch = extend_batch((1, 1), 2)
    batch.forward_mode = ForwardMode.DECODE
    backend.init_forward_metadata(batch)
    layer = encoder_layer(2, 2, 16)
    with (
        forward_context(ForwardContext(attn_backend=backend), forward_batch=batch),
        pytest.raises(IntegrationError, match="decode batch reads the KV cache"),
    ):
        layer(proj.q, proj.k, proj.v, batch)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"attn_type": AttentionType.DECODER}, "this layer is decoder"),
        ({"is_cross_attention": True}, "cross-attention"),
        ({"logit_cap": 2.0, "logit_capping_method": "other"}, "logit_capping_method"),
    ],
)
def test_layers_it_does_not_serve_are_refused_by_name(kw, match):
    proj = projection((3, 2), 2, 2, 16)
    with pytest.raises(FeatureNotSupportedError, match=match):
        run(proj, (3, 2), 2, 2, 16, **kw)


def test_arguments_it_does_not_know_are_refused():
    backend = build_backend(2, 16)
    proj = projection((3, 2), 2, 2, 16)
    batch = extend_batch((3, 2), 5)
    backend.init_forward_metadata(batch)
    layer = encoder_layer(2, 2, 16)
    with pytest.raises(FeatureNotSupportedError, match="sinks"):
        backend.forward_extend(
            proj.q, proj.k.view(5, 2, 16), proj.v.view(5, 2, 16), layer, batch, sinks=torch.zeros(2)
        )


def test_equal_to_sglangs_own_torch_native_attention():
    """The same batch and layer through SGLang's torch-native backend (which writes the K/V to
    its pool and reads them back per sequence): the engine's own meaning of the layer."""
    proj = projection((9, 1, 6), 4, 2, 16, seed=8)
    ours, _ = run(proj, (9, 1, 6), 4, 2, 16, scaling=0.3)
    runner = model_runner(2, 16)
    slots = torch.arange(1, proj.tokens + 1, dtype=torch.int64)
    for i, (a, b) in enumerate(itertools.pairwise([0, 9, 10, 16])):
        runner.req_to_token_pool.write((i, slice(0, b - a)), slots[a:b].to(torch.int32))
    native = _build_full_attention_backend_from_str(
        model_runner=runner, backend_str="torch_native", init_new_workspace=False
    )
    batch = extend_batch((9, 1, 6), proj.tokens)
    native.init_forward_metadata(batch)
    layer = encoder_layer(4, 2, 16, scaling=0.3)
    layer.layer_id = 0  # the pool holds one layer
    with forward_context(ForwardContext(attn_backend=native), forward_batch=batch):
        theirs = layer(proj.q, proj.k, proj.v, batch)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_engine_benchmark_runs_both_backends(tmp_path):
    """benchmarks/engine_bench.py on one small batch: this library and torch_native agree."""
    from tests.script_support import load_script

    bench = load_script("benchmarks/engine_bench.py")
    out = tmp_path / "engine.json"
    args = ["--engine", "sglang", "--device", "cpu", "--layers", "1", "--repeats", "1"]
    assert bench.main([*args, "--workload", "queries", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ours, native = result["backends"]["attn_backends"], result["backends"]["torch_native"]
    assert ours["latency_tokens_per_s"] > 0 and native["latency_tokens_per_s"] > 0
    assert native["relative_error_vs_first"] < 1e-5
