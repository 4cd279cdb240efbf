"""Absolute attention speed: TFLOP/s and host time of each CUDA backend and of the raw kernels.

Two grids, bf16:

- FlashAttention-3's paper grid for its forward pass (about 16k tokens a batch of fixed-length
  sequences, hidden width 2048: 32 heads of 64 or 16 heads of 128, causal and not, 512 to 16k
  tokens a sequence), so the numbers stand next to its published H100 figures (`FA3_H100`,
  512 / 1k / 2k; longer sequences have no anchor here);
- the embedding models' varlen batches (`VARLEN`): BGE-M3's 64 texts of 16..512 tokens
  (16 x 64, bidirectional) and Qwen3-Embedding-0.6B's 32 texts of 64..2048 (16/8 x 128, causal).

Paths, each checked against a float64 reference on the batch's first sequence before it is
timed:

- ``api``: ``select(spec, backend=NAME)`` + ``prepare`` once, then the public ``forward`` on
  the packed QKV rows, for each backend of ``--backends`` (default: flashinfer, torch-varlen,
  fa4; one the platform refuses is listed with its reason);
- ``raw``: the kernel a backend wraps, called directly on views of the same rows: flashinfer's
  ragged prefill planned as the backend plans it, ``torch.nn.attention.varlen.varlen_attn`` and
  ``flash_attn.cute.flash_attn_varlen_func``, where installed.

Times: ``ms`` is throughput (CUDA events around back-to-back calls, median of several blocks);
``host_us`` the host time of one call (``perf_counter`` around back-to-back calls, no sync, the
queue kept short), which the GPU queue hides in ``ms``. FLOPs are ``4 * sum(L^2) * H * D``,
halved for causal, as the paper counts them.

    python3 benchmarks/attention_tflops.py --out DIR          # on a CUDA GPU
    python3 benchmarks/attention_tflops.py --dry              # tiny shapes on CPU, no timing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import attn_backends as ab

TOKENS = 16 * 1024
WIDTH = 2048
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
BACKENDS = ("flashinfer", "torch-varlen", "fa4")
FA3_H100: dict[tuple[int, bool], tuple[float, float, float]] = {
    (64, False): (333, 392, 460),
    (128, False): (467, 565, 625),
    (64, True): (197, 265, 371),
    (128, True): (292, 423, 521),
}
"""FlashAttention-3 forward, bf16, H100 SXM5 (its paper, figure 5), TFLOP/s at 512 / 1k / 2k."""


@dataclass(frozen=True)
class Varlen:
    """An embedding model's attention on a batch of texts of spread lengths."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    count: int
    shortest: int
    longest: int

    def lengths(self) -> list[int]:
        """Evenly spread from ``shortest`` to ``longest``, longest first (the first sequence is
        the one checked against the reference: the longest exercises the most tiles)."""
        step = (self.longest - self.shortest) / max(1, self.count - 1)
        return [round(self.longest - i * step) for i in range(self.count)]


VARLEN = (
    Varlen("bge-m3", 16, 16, 64, False, 64, 16, 512),
    Varlen("qwen3-embedding-0.6b", 16, 8, 128, True, 32, 64, 2048),
)
Step = Callable[[], torch.Tensor]
"""One call of a timed path, returning its output."""
TOLERANCE = 2e-2
"""Max relative error (per element, over the reference's max) a bf16 path may show."""
HOST_CALLS = 200


@dataclass
class Row:
    shape: str
    """``fa3-grid`` or the varlen workload's name."""
    seq_len: int
    """The grid's sequence length; a varlen batch's longest."""
    batch: int
    head_dim: int
    heads: int
    kv_heads: int
    causal: bool
    path: str
    backend: str
    ms: float | None
    tflops: float | None
    host_us: float | None
    fa3_h100: float | None
    error: float | None
    note: str = ""


def flops(batch: int, seq_len: int, heads: int, head_dim: int, causal: bool) -> float:
    full = 4.0 * batch * seq_len * seq_len * heads * head_dim
    return full / 2 if causal else full


def varlen_flops(lengths: Sequence[int], heads: int, head_dim: int, causal: bool) -> float:
    return sum(flops(1, n, heads, head_dim, causal) for n in lengths)


def reference(qkv: torch.Tensor, spec: ab.AttentionSpec, length: int) -> torch.Tensor:
    """float64 attention of the first sequence: ``[length, Hq * D]`` (the library's own float64
    reference on that sequence's rows)."""
    params = ab.FMHAParams.from_lengths([length], device=qkv.device)
    return ab.reference_attention(qkv[:length], spec, params)


def error(out: torch.Tensor, want: torch.Tensor) -> float:
    got = out[: want.shape[0]].double().reshape(want.shape)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def timed_ms(fn: Step, *, device: torch.device, calls: int, blocks: int) -> float:
    """Median over ``blocks`` of the mean time of ``calls`` back-to-back calls."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(blocks):
        start = torch.Event(device, enable_timing=True)
        end = torch.Event(device, enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return float(statistics.median(samples))


def host_us(fn: Step, *, device: torch.device, calls: int = HOST_CALLS) -> float:
    """Median host time of one call in µs; a sync every 20 calls keeps the queue short, so a
    call never waits for room in it."""
    samples = []
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    torch.cuda.synchronize(device)
    return float(statistics.median(samples)) * 1e6


def views(qkv: torch.Tensor, spec: ab.AttentionSpec) -> tuple[torch.Tensor, ...]:
    """Q, K, V as ``[tokens, heads, D]`` strided views of the packed rows, as an engine holds
    them (the library's own split)."""
    return tuple(ab.split_views(qkv, spec, qkv.shape[0]))


def raw_flashinfer(spec: ab.AttentionSpec, params: ab.FMHAParams, qkv: torch.Tensor) -> Step | str:
    """flashinfer's ragged kernel planned as the benchmark's raw path plans it."""
    try:
        from attn_backends_bench.paths import Skip
        from attn_backends_bench.ragged import flashinfer_ragged
    except ImportError as exc:
        return f"benchmark package not importable ({exc})"
    kernel = flashinfer_ragged(spec, params)
    if isinstance(kernel, Skip):
        return kernel.reason
    q, k, v = views(qkv, spec)
    return lambda: kernel(q, k, v)


def _offsets(params: ab.FMHAParams) -> tuple[torch.Tensor, int]:
    lengths = params.input_lengths
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu.to(params.device), max(lengths)


def raw_varlen(spec: ab.AttentionSpec, params: ab.FMHAParams, qkv: torch.Tensor) -> Step | str:
    """``torch.nn.attention.varlen.varlen_attn`` on the views (K/V expanded for GQA where this
    torch has no ``enable_gqa``)."""
    try:
        from torch.nn.attention import varlen
    except ImportError as exc:
        return f"torch {torch.__version__} has no varlen_attn ({exc})"
    import inspect

    # Any: the call's keywords depend on the installed torch (probed here, as the backend does)
    attend: Any = varlen.varlen_attn
    q, k, v = views(qkv, spec)
    cu, longest = _offsets(params)
    window = (-1, 0) if spec.causal else (-1, -1)
    gqa = "enable_gqa" in inspect.signature(attend).parameters
    if spec.is_gqa and not gqa:
        k = k.repeat_interleave(spec.group_size, dim=1)
        v = v.repeat_interleave(spec.group_size, dim=1)
    extra = {"enable_gqa": True} if spec.is_gqa and gqa else {}

    def call() -> torch.Tensor:
        out: torch.Tensor = attend(
            q, k, v, cu, cu, longest, longest, scale=spec.scale, window_size=window, **extra
        )
        return out

    return call


def raw_fa4(spec: ab.AttentionSpec, params: ab.FMHAParams, qkv: torch.Tensor) -> Step | str:
    """``flash_attn.cute.flash_attn_varlen_func`` on the views."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        return f"flash-attn-4 not importable ({exc})"
    q, k, v = views(qkv, spec)
    cu, longest = _offsets(params)

    def call() -> torch.Tensor:
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=spec.scale,
            causal=spec.causal,
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    return call


RAW: dict[str, Callable[[ab.AttentionSpec, ab.FMHAParams, torch.Tensor], Step | str]] = {
    "flashinfer": raw_flashinfer,
    "torch-varlen": raw_varlen,
    "fa4": raw_fa4,
}


def api_path(
    spec: ab.AttentionSpec, params: ab.FMHAParams, qkv: torch.Tensor, name: str | None
) -> tuple[str, Step | str]:
    """The public path through backend ``name`` (None: the selector's choice), or why the
    selector refuses it here."""
    try:
        selection = ab.select(spec, device=qkv.device, backend=name, has_kv_cache=False)
    except ab.NoBackendError as exc:
        return name or "-", f"refused: {exc}"[:300]
    backend = selection.backend
    try:
        plan = backend.prepare(params)
    except ab.AttentionBackendError as exc:  # e.g. a kernel library that fails to import
        return backend.name, f"failed: {exc}"[:300]
    return backend.name, lambda: backend.forward(qkv, plan)


def measure_batch(
    shape: str,
    spec: ab.AttentionSpec,
    lengths: list[int],
    *,
    device: torch.device,
    dry: bool,
    backends: Sequence[str],
    fa3: float | None,
) -> list[Row]:
    params = ab.FMHAParams.from_lengths(lengths, device=device)
    seed = sum(lengths) * 1000 + spec.head_dim + int(spec.causal)
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(params.rows, spec.qkv_width, generator=gen, device=device, dtype=spec.dtype)
    pristine = qkv.clone()
    want = reference(pristine, spec, lengths[0])
    work = varlen_flops(lengths, spec.num_heads, spec.head_dim, spec.causal)
    rows: list[Row] = []

    def row(path: str, backend: str, fn: Step | str) -> None:
        err = ms = tf = us = None
        if isinstance(fn, str):
            note = fn  # why the path cannot run here
        else:
            qkv.copy_(pristine)
            err, note = error(fn().reshape(params.token_q_num, -1), want), ""
            if err > TOLERANCE:
                note = f"wrong: relative error {err:.3g} > {TOLERANCE}; not timed"
            elif not dry:
                ms = timed_ms(fn, device=device, calls=20, blocks=7)
                tf = work / (ms * 1e-3) / 1e12
                us = host_us(fn, device=device)
        rows.append(
            Row(
                shape,
                max(lengths),
                len(lengths),
                spec.head_dim,
                spec.num_heads,
                spec.num_kv_heads,
                spec.causal,
                path,
                backend,
                ms,
                tf,
                us,
                fa3,
                err,
                note,
            )
        )

    names: Sequence[str | None] = [None] if dry else backends
    for name in names:
        served, fn = api_path(spec, params, qkv, name)
        row("api", served, fn)
        raw = RAW.get(served) if device.type == "cuda" else None
        if raw is not None:
            row("raw", served, raw(spec, params, qkv))
    return rows


def grid(
    device: torch.device, dry: bool, backends: Sequence[str], seq_lens: Sequence[int] = SEQ_LENS
) -> list[Row]:
    rows: list[Row] = []
    for causal in (False, True):
        for head_dim in HEAD_DIMS:
            for seq_len in seq_lens:
                index = SEQ_LENS.index(seq_len)
                # dry: the grid's shape at 1/64 of its lengths and one batch of 256 tokens
                tokens, length = (256, seq_len // 64) if dry else (TOKENS, seq_len)
                heads = 2 if dry else WIDTH // head_dim
                anchors = FA3_H100[(head_dim, causal)]
                fa3 = anchors[index] if not dry and index < len(anchors) else None
                spec = ab.AttentionSpec(heads, heads, head_dim, torch.bfloat16, causal=causal)
                rows += measure_batch(
                    "fa3-grid",
                    spec,
                    [length] * max(1, tokens // length),
                    device=device,
                    dry=dry,
                    backends=backends,
                    fa3=fa3,
                )
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def varlen(device: torch.device, dry: bool, backends: Sequence[str]) -> list[Row]:
    rows: list[Row] = []
    for w in VARLEN:
        heads, kv = (2, 1 if w.kv_heads < w.heads else 2) if dry else (w.heads, w.kv_heads)
        spec = ab.AttentionSpec(heads, kv, w.head_dim, torch.bfloat16, causal=w.causal)
        lengths = [max(1, n // 64) for n in w.lengths()[:4]] if dry else w.lengths()
        rows += measure_batch(
            w.name, spec, lengths, device=device, dry=dry, backends=backends, fa3=None
        )
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| shape | D | heads | causal | seq | batch | path | backend | ms | TFLOP/s | host µs "
        "| FA3 H100 | ratio | error |",
        "|---|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.tflops / r.fa3_h100:.2f}" if r.tflops and r.fa3_h100 else "-"
        lines.append(
            f"| {r.shape} | {r.head_dim} | {r.heads}/{r.kv_heads} | {'yes' if r.causal else 'no'} "
            f"| {r.seq_len} | {r.batch} | {r.path} | {r.backend} "
            f"| {f'{r.ms:.3f}' if r.ms else '-'} | {f'{r.tflops:.0f}' if r.tflops else '-'} "
            f"| {f'{r.host_us:.1f}' if r.host_us else '-'} "
            f"| {f'{r.fa3_h100:.0f}' if r.fa3_h100 else '-'} | {ratio} "
            f"| {f'{r.error:.2g}' if r.error is not None else '-'} |"
            + (f" {r.note}" if r.note else "")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for attention_tflops.json/.md")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, no timing")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated backends timed through the API (default: %(default)s); each "
        "also times the raw kernel it wraps where one is known",
    )
    parser.add_argument(
        "--seq-lens",
        default=",".join(str(n) for n in SEQ_LENS),
        help="the FA3 grid's sequence lengths to run (default: %(default)s)",
    )
    parser.add_argument(
        "--shapes",
        choices=("all", "grid", "varlen"),
        default="all",
        help="the FA3 paper grid, the embedding varlen batches, or both",
    )
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry)")
    backends = [b for b in args.backends.split(",") if b]
    try:
        seq_lens = tuple(int(n) for n in args.seq_lens.split(",") if n)
    except ValueError:
        parser.error(f"--seq-lens takes comma-separated integers, got {args.seq_lens!r}")
    unknown = sorted(set(seq_lens) - set(SEQ_LENS))
    if unknown:
        parser.error(f"--seq-lens: {unknown} not in the grid {list(SEQ_LENS)}")
    device = torch.device("cpu" if args.dry else "cuda")
    rows: list[Row] = []
    if args.shapes in ("all", "varlen"):
        rows += varlen(device, args.dry, backends)
    if args.shapes in ("all", "grid"):
        rows += grid(device, args.dry, backends, seq_lens)
    text = markdown(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "tokens_per_batch": TOKENS,
            "width": WIDTH,
            "backends": backends,
        }
        (args.out / "attention_tflops.json").write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n"
        )
        (args.out / "attention_tflops.md").write_text(text)
    wrong = [r for r in rows if r.note.startswith("wrong")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
