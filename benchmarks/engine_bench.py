"""Encoder attention through an engine's own attention call: this library's backend vs the
engine's default, tokens/s.

A BGE-M3-sized encoder's attention (24 layers, 16 heads of 64, bf16 on a GPU) runs per batch as
the engine runs it: the engine's metadata built once per batch (vLLM's builder from a
``CommonAttentionMetadata``, SGLang's ``init_forward_metadata`` on a ``ForwardBatch``), then each
layer's call through the engine's layer object (vLLM's ``Attention`` in its forward context,
SGLang's ``RadixAttention``) on views of one packed QKV projection per layer. Only attention
runs: the projections are random and fixed, so the figures isolate what the backend choice
changes.

Backends: ``ours`` (``ATTN_BACKENDS`` / ``attn_backends``) and the engine's default for the
device (vLLM: ``FLASH_ATTN``; SGLang: ``flashinfer`` on CUDA, ``torch_native`` on CPU), or
``--baseline NAME``. Before timing, each backend's output is compared with the first's (max
relative error per layer output). Reported per backend: latency (p50, synchronised per batch),
throughput (batches back to back, synchronised once) and host time per batch (until the last
layer returns, before synchronising), each as tokens/s where it is a rate.

    python3 benchmarks/engine_bench.py --engine sglang --device cpu --layers 2 --repeats 5
    python3 benchmarks/engine_bench.py --engine vllm --device cuda --out OUT.json

Needs the engine installed (on a CPU machine, as `scripts/engines/test-cpu.sh` installs it; for
SGLang put ``scripts/engines/placeholders`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

WORKLOADS = {
    "documents": (64, 16, 512),  # texts, shortest, longest (lognormal lengths, clipped)
    "queries": (8, 8, 40),
}

Step = Callable[[], torch.Tensor]


@dataclass
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def lengths_of(workload: str, seed: int = 0) -> list[int]:
    count, low, high = WORKLOADS[workload]
    rng = random.Random(seed)
    middle = math.log((low * high) ** 0.5)
    return [min(high, max(low, round(math.exp(rng.gauss(middle, 0.6))))) for _ in range(count)]


def projections(shape: Shape, tokens: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [
        torch.randn(tokens, width, generator=gen).to(shape.device, shape.dtype)
        for _ in range(shape.layers)
    ]


def split(qkv: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, ...]:
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return tuple(qkv.split([q_width, kv_width, kv_width], dim=-1))


def vllm_step(name: str, shape: Shape, lengths: list[int], qkvs: list[torch.Tensor]) -> Step:
    """One batch through vLLM: the builder's metadata, then every layer's ``Attention``."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.attention import AttentionConfig
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.encoder_only_attention import (
        create_encoder_only_attention_backend,
    )
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    load_general_plugins()
    config = VllmConfig(
        device_config=DeviceConfig(device=shape.device.type),
        attention_config=AttentionConfig(backend=name),
    )
    backend = create_encoder_only_attention_backend(AttentionBackendEnum[name].get_class())
    layers = []
    with set_current_vllm_config(config), torch.device(shape.device):
        torch.set_default_dtype(shape.dtype)
        for i in range(shape.layers):
            layer = Attention(
                num_heads=shape.heads,
                head_size=shape.head_dim,
                scale=shape.head_dim**-0.5,
                num_kv_heads=shape.kv_heads,
                prefix=f"bench.{name}.{i}.attn",
                attn_backend=backend,
                attn_type=AttentionType.ENCODER_ONLY,
            )
            layer.kv_cache = torch.empty(0, device=shape.device)
            layers.append(layer)
        torch.set_default_dtype(torch.float32)
    cache_spec = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=shape.kv_heads, head_size=shape.head_dim, dtype=shape.dtype
    )
    names = [layer.layer_name for layer in layers]
    builder = backend.get_builder_cls()(cache_spec, names, config, shape.device)
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq = torch.tensor(lengths, dtype=torch.int32)
    tokens = int(starts[-1])
    common = CommonAttentionMetadata(
        query_start_loc=starts.to(shape.device),
        query_start_loc_cpu=starts,
        seq_lens=seq.to(shape.device),
        num_reqs=len(lengths),
        num_actual_tokens=tokens,
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        block_table_tensor=torch.zeros(len(lengths), 1, dtype=torch.int32, device=shape.device),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=shape.device),
        seq_lens_cpu_upper_bound=seq,
    )
    views = [split(qkv, shape) for qkv in qkvs]

    def step() -> torch.Tensor:
        meta = builder.build(0, common)
        out = None
        with set_forward_context(dict.fromkeys(names, meta), config):
            for layer, (q, k, v) in zip(layers, views, strict=True):
                out = layer(q, k, v)
        assert out is not None
        return out

    return step


def sglang_step(name: str, shape: Shape, lengths: list[int], qkvs: list[torch.Tensor]) -> Step:
    """One batch through SGLang: ``init_forward_metadata``, then every ``RadixAttention``."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import (
        ForwardBatch,
        ForwardMode,
        compute_position_torch,
    )
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        _build_full_attention_backend_from_str,
    )
    from sglang.srt.plugins import load_plugins

    load_plugins()
    tokens, count, device = sum(lengths), len(lengths), shape.device
    req = ReqToTokenPool(
        size=count, max_context_len=max(lengths), device=str(device), enable_memory_saver=False
    )
    kv = MHATokenToKVPool(
        size=tokens + 1,
        page_size=1,
        dtype=shape.dtype,
        head_num=shape.kv_heads,
        head_dim=shape.head_dim,
        layer_num=shape.layers,
        device=str(device),
        enable_memory_saver=False,
    )
    slots = torch.arange(1, tokens + 1, dtype=torch.int64, device=device)
    for i, (a, b) in enumerate(itertools.pairwise([0, *itertools.accumulate(lengths)])):
        req.write((i, slice(0, b - a)), slots[a:b].to(torch.int32))
    server = SimpleNamespace(disable_radix_cache=True)
    runner = SimpleNamespace(
        device=str(device), req_to_token_pool=req, token_to_kv_pool=kv, server_args=server
    )
    backend = _build_full_attention_backend_from_str(
        model_runner=runner, backend_str=name, init_new_workspace=False
    )
    seq = torch.tensor(lengths, dtype=torch.int32, device=device)
    before = torch.zeros(count, dtype=torch.int32, device=device)
    positions, starts = compute_position_torch(before, seq)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=count,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(count, device=device),
        seq_lens=seq,
        out_cache_loc=slots,
        seq_lens_sum=tokens,
        seq_lens_cpu=seq.cpu(),
        positions=positions,
        extend_num_tokens=tokens,
        extend_seq_lens=seq,
        extend_prefix_lens=before,
        extend_start_loc=starts,
        extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=[0] * count,
        is_prefill_only=True,
    )
    layers = [
        RadixAttention(
            num_heads=shape.heads,
            head_dim=shape.head_dim,
            scaling=shape.head_dim**-0.5,
            num_kv_heads=shape.kv_heads,
            layer_id=i,
            attn_type=AttentionType.ENCODER_ONLY,
        )
        for i in range(shape.layers)
    ]
    views = [split(qkv, shape) for qkv in qkvs]

    def step() -> torch.Tensor:
        backend.init_forward_metadata(batch)
        out = None
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
            for layer, (q, k, v) in zip(layers, views, strict=True):
                out = layer(q, k, v, batch)
        assert out is not None
        return out  # type: ignore[no-any-return]

    return step


ENGINES: dict[str, tuple[str, Callable[[str, Shape, list[int], list[torch.Tensor]], Step]]] = {
    "vllm": ("ATTN_BACKENDS", vllm_step),
    "sglang": ("attn_backends", sglang_step),
}


def default_baseline(engine: str, device: torch.device) -> str:
    if engine == "vllm":
        return "FLASH_ATTN"
    return "flashinfer" if device.type == "cuda" else "torch_native"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step: Step, device: torch.device, repeats: int, tokens: int) -> dict[str, float]:
    for _ in range(2):
        step()
    _sync(device)
    latency, host = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        _sync(device)
        latency.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    throughput = (time.perf_counter() - start) / repeats
    p50 = statistics.median(latency)
    return {
        "latency_p50_ms": p50 * 1e3,
        "latency_tokens_per_s": tokens / p50,
        "throughput_tokens_per_s": tokens / throughput,
        "host_ms_per_batch": statistics.median(host) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--baseline", help="the engine's backend to compare with")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="documents")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = Shape(args.layers, args.heads, args.kv_heads, args.head_dim, dtype, device)
    lengths = lengths_of(args.workload)
    tokens = sum(lengths)
    qkvs = projections(shape, tokens)
    ours, build = ENGINES[args.engine]
    baseline = args.baseline or default_baseline(args.engine, device)
    results: dict[str, Any] = {
        "engine": args.engine,
        "device": str(device),
        "dtype": str(dtype),
        "workload": args.workload,
        "tokens": tokens,
        "sequences": len(lengths),
        "shape": {
            k: v for k, v in vars(args).items() if k in ("layers", "heads", "kv_heads", "head_dim")
        },
        "backends": {},
    }
    first: torch.Tensor | None = None
    for name in (ours, baseline):
        try:
            step = build(name, shape, lengths, qkvs)
            out = step().float()
        except Exception as exc:  # a backend the engine cannot run here is reported, not fatal
            results["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{name}: not run: {results['backends'][name]['error']}")
            continue
        row = measure(step, device, args.repeats, tokens)
        if first is None:
            first = out
        else:
            diff = (out - first).norm() / first.norm()
            row["relative_error_vs_first"] = float(diff)
        results["backends"][name] = row
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
