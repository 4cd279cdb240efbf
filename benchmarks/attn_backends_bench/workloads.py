"""The benchmark workloads, as data, and the work each one represents (FLOPs and bytes).

Each workload is one attention layer of a real embedding model on a typical batch: document
batches (thousands of tokens) and query batches (a few short requests, where the host time of
each call decides what a request waits). Variable lengths come from a seeded generator, so a
run can be repeated exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from attn_backends import PRESETS, AttentionSpec

API_WITHIN = 1.05
"""Public API time over the fastest correct backend time, on every workload."""
HOST_OVERHEAD_US = 5.0
"""Host microseconds the public ``forward`` may add to the raw kernel call it wraps."""
LATENCY_WITHIN = 1.05
"""Public API latency (synchronised call) over the raw kernel's, on every workload."""


@dataclass(frozen=True)
class Targets:
    """What a workload is judged against; ``None`` means no such target on this workload."""

    api_within: float = API_WITHIN
    """``public API ms / fastest correct backend ms`` must be at most this."""
    legacy_speedup: float | None = None
    """``legacy ms / public API ms`` must be at least this."""
    padded_speedup: float | None = None
    """``padded SDPA ms / public API ms`` must be at least this."""
    rope_overhead: float | None = None
    """``public API ms (RoPE + attention) / attention alone ms`` must be at most this."""
    host_overhead_us: float | None = HOST_OVERHEAD_US
    """``public API host µs - raw kernel host µs`` per call must be at most this."""
    latency_within: float | None = LATENCY_WITHIN
    """``public API latency / raw kernel latency`` must be at most this."""

    def to_dict(self) -> dict[str, float | None]:
        return {
            "api_within": self.api_within,
            "legacy_speedup": self.legacy_speedup,
            "padded_speedup": self.padded_speedup,
            "rope_overhead": self.rope_overhead,
            "host_overhead_us": self.host_overhead_us,
            "latency_within": self.latency_within,
        }


@dataclass(frozen=True)
class Workload:
    """A batch shape and the attention layer it runs through."""

    name: str
    """Stable id used on the command line and in the JSON."""
    title: str
    batch: int
    min_len: int
    max_len: int
    """Lengths are drawn uniformly from ``[min_len, max_len]``; equal bounds mean fixed."""
    preset: str
    """Key of `attn_backends.PRESETS`: the model's attention layer, so that
    ``attn-backends explain --preset NAME`` shows the decision the workload measures."""
    targets: Targets
    salt: int = 0
    """Mixed into the seed so that workloads draw different lengths from one ``--seed``."""

    @property
    def varlen(self) -> bool:
        return self.min_len != self.max_len

    def lengths(self, seed: int) -> tuple[int, ...]:
        """Sequence lengths of the batch; the same for the same seed."""
        if not self.varlen:
            return (self.max_len,) * self.batch
        rng = random.Random(seed * 1_000_003 + self.salt)
        return tuple(rng.randint(self.min_len, self.max_len) for _ in range(self.batch))

    def spec(self, dtype: torch.dtype = torch.bfloat16) -> AttentionSpec:
        return replace(PRESETS[self.preset], dtype=dtype)

    def shape_text(self) -> str:
        """``32 x 512, 12/12 heads x 64, bidirectional, no RoPE``."""
        layer = PRESETS[self.preset]
        lengths = (
            f"{self.batch} x {self.max_len}"
            if not self.varlen
            else f"{self.batch} seqs of {self.min_len}..{self.max_len}"
        )
        rope = f"RoPE theta {layer.rope.theta:g}" if layer.rope is not None else "no RoPE"
        mask = "causal" if layer.causal else "bidirectional"
        return (
            f"{lengths}, {layer.num_heads}/{layer.num_kv_heads} heads x {layer.head_dim}, "
            f"{mask}, {rope}"
        )

    def to_dict(self) -> dict[str, object]:
        layer = PRESETS[self.preset]
        return {
            "name": self.name,
            "title": self.title,
            "batch": self.batch,
            "min_len": self.min_len,
            "max_len": self.max_len,
            "num_heads": layer.num_heads,
            "num_kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim,
            "causal": layer.causal,
            "rope_theta": layer.rope.theta if layer.rope is not None else None,
        }


QUERY_BATCHES: tuple[tuple[int, int], ...] = ((1, 16), (4, 32), (16, 64))
"""(sequences, tokens each) of the query-time batches: one short query, a few, a small burst."""


def _query_workloads(model: str, title: str, preset: str, salt: int) -> tuple[Workload, ...]:
    """The query batches of one model: fixed lengths, judged on the engine-view targets."""
    return tuple(
        Workload(
            name=f"{model}-q{batch}x{length}",
            title=f"{title} query {batch} x {length}",
            batch=batch,
            min_len=length,
            max_len=length,
            preset=preset,
            targets=Targets(),
            salt=salt + i,
        )
        for i, (batch, length) in enumerate(QUERY_BATCHES)
    )


# Ordered so that the workloads the targets speak about run first; the long GTE batch, with
# the most expensive float64 reference, comes last and is the one a tight budget drops.
WORKLOADS: tuple[Workload, ...] = (
    Workload(
        name="bert-base",
        title="BERT-base",
        batch=32,
        min_len=512,
        max_len=512,
        preset="bert-base",
        targets=Targets(legacy_speedup=2.0),
    ),
    Workload(
        name="bge-m3",
        title="BGE-M3-like",
        batch=64,
        min_len=16,
        max_len=512,
        preset="bge-m3",
        targets=Targets(padded_speedup=8.0),
        salt=1,
    ),
    Workload(
        name="qwen3-emb-0.6b",
        title="Qwen3-Embedding-0.6B",
        batch=32,
        min_len=64,
        max_len=2048,
        preset="qwen3-embedding-0.6b",
        targets=Targets(legacy_speedup=2.0, padded_speedup=8.0, rope_overhead=1.10),
        salt=2,
    ),
    Workload(
        name="short",
        title="short",
        batch=256,
        min_len=64,
        max_len=64,
        preset="short",
        targets=Targets(legacy_speedup=2.0, rope_overhead=1.10),
        salt=3,
    ),
    *_query_workloads("bge-m3", "BGE-M3", "bge-m3", salt=10),
    *_query_workloads("qwen3-emb", "Qwen3-Embedding-0.6B", "qwen3-embedding-0.6b", salt=20),
    Workload(
        name="gte-qwen2-7b",
        title="GTE-Qwen2-7B-like",
        batch=4,
        min_len=8192,
        max_len=8192,
        preset="gte-qwen2-7b",
        targets=Targets(),
        salt=4,
    ),
)


def workload_names() -> tuple[str, ...]:
    return tuple(w.name for w in WORKLOADS)


def get_workload(name: str) -> Workload:
    """The workload called ``name``; raises `ValueError` listing the known names."""
    for workload in WORKLOADS:
        if workload.name == name:
            return workload
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names())}")


def attention_flops(lengths: Sequence[int], num_heads: int, head_dim: int, causal: bool) -> float:
    """``4 * sum(L^2) * Hq * D`` (QK^T and PV, 2 FLOPs per multiply-add), halved for causal."""
    full = 4.0 * sum(n * n for n in lengths) * num_heads * head_dim
    return full / 2.0 if causal else full


def attention_bytes(tokens: int, spec: AttentionSpec) -> int:
    """Bytes an ideal kernel moves: read Q, K, V and write O of the valid tokens."""
    read = tokens * spec.qkv_width * spec.dtype.itemsize
    write = tokens * spec.q_width * spec.output_dtype.itemsize
    return read + write


def rope_bytes(tokens: int, spec: AttentionSpec) -> int:
    """Bytes an in-place RoPE pass moves: read and write the Q and K columns."""
    return 2 * tokens * (spec.q_width + spec.kv_width) * spec.dtype.itemsize
