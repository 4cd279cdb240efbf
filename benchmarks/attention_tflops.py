"""Absolute attention speed: TFLOP/s of the selected backend and of the raw kernel it wraps.

The grid FlashAttention-3's paper reports for its forward pass (bf16, about 16k tokens a batch
of fixed-length sequences, hidden width 2048: 32 heads of 64 or 16 heads of 128, causal and
not), so the numbers stand next to its published H100 figures (`FA3_H100`).

Paths, each checked against a float64 reference on one sequence before it is timed:

- ``api``: ``select`` + ``prepare`` once, then the public ``forward`` on the packed QKV rows;
- ``raw``: flashinfer's ragged prefill kernel on views of the same rows, planned as the
  backend plans it (the kernel the API's decision record names), when flashinfer is here.

Times are throughput (CUDA events around back-to-back calls, median of several blocks);
FLOPs are ``4 * B * S^2 * H * D``, halved for causal, as the paper counts them.

    python3 benchmarks/attention_tflops.py --out DIR          # on a CUDA GPU
    python3 benchmarks/attention_tflops.py --dry              # tiny shapes on CPU, no timing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import attn_backends as ab

TOKENS = 16 * 1024
WIDTH = 2048
SEQ_LENS = (512, 1024, 2048)
HEAD_DIMS = (64, 128)
FA3_H100: dict[tuple[int, bool], tuple[float, float, float]] = {
    (64, False): (333, 392, 460),
    (128, False): (467, 565, 625),
    (64, True): (197, 265, 371),
    (128, True): (292, 423, 521),
}
"""FlashAttention-3 forward, bf16, H100 SXM5 (its paper, figure 5), TFLOP/s at 512 / 1k / 2k."""
Step = Callable[[], torch.Tensor]
"""One call of a timed path, returning its output."""
TOLERANCE = 2e-2
"""Max relative error (per element, over the reference's max) a bf16 path may show."""


@dataclass
class Row:
    seq_len: int
    batch: int
    head_dim: int
    heads: int
    causal: bool
    path: str
    backend: str
    ms: float | None
    tflops: float | None
    fa3_h100: float
    error: float | None
    note: str = ""


def flops(batch: int, seq_len: int, heads: int, head_dim: int, causal: bool) -> float:
    full = 4.0 * batch * seq_len * seq_len * heads * head_dim
    return full / 2 if causal else full


def reference(qkv: torch.Tensor, spec: ab.AttentionSpec, length: int) -> torch.Tensor:
    """float64 attention of the first sequence: ``[length, H * D]``."""
    h, d = spec.num_heads, spec.head_dim
    rows = qkv[:length].double().view(length, 3, h, d)
    q, k, v = (rows[:, i].transpose(0, 1) for i in range(3))
    scores = (q @ k.transpose(1, 2)) * spec.scale
    if spec.causal:
        keep = torch.ones(length, length, dtype=torch.bool, device=qkv.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(0, 1).reshape(length, h * d)


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


def raw_kernel(spec: ab.AttentionSpec, params: ab.FMHAParams, qkv: torch.Tensor) -> Step | str:
    """flashinfer's ragged kernel planned as the benchmark's raw path plans it, called on
    strided views of the packed rows (as an engine would pass them), or why it cannot run."""
    try:
        from attn_backends_bench.paths import Skip
        from attn_backends_bench.ragged import flashinfer_ragged
    except ImportError as exc:
        return f"benchmark package not importable ({exc})"
    kernel = flashinfer_ragged(spec, params)
    if isinstance(kernel, Skip):
        return kernel.reason
    heads, dim = spec.num_heads, spec.head_dim  # MHA: q, k and v have the same heads
    q, k, v = (qkv.view(-1, 3, heads, dim)[:, i] for i in range(3))
    return lambda: kernel(q, k, v).reshape(-1, heads * dim)


def measure(
    seq_len: int, head_dim: int, causal: bool, *, device: torch.device, dry: bool
) -> list[Row]:
    tokens = 64 if dry else TOKENS
    heads = 2 if dry else WIDTH // head_dim
    batch = max(1, tokens // seq_len)
    fa3 = FA3_H100[(head_dim, causal)][SEQ_LENS.index(seq_len)] if not dry else 0.0
    spec = ab.AttentionSpec(heads, heads, head_dim, torch.bfloat16, causal=causal)
    params = ab.FMHAParams.from_lengths([seq_len] * batch, device=device)
    gen = torch.Generator(device=device).manual_seed(seq_len * 1000 + head_dim + int(causal))
    qkv = torch.randn(
        batch * seq_len, 3 * heads * head_dim, generator=gen, device=device, dtype=torch.bfloat16
    )
    want = reference(qkv, spec, seq_len)
    work = flops(batch, seq_len, heads, head_dim, causal)
    rows: list[Row] = []

    def row(path: str, backend: str, fn: Step | str) -> None:
        err = ms = tf = None
        if isinstance(fn, str):
            note = fn  # why the path cannot run here
        else:
            err, note = error(fn(), want), ""
            if err > TOLERANCE:
                note = f"wrong: relative error {err:.3g} > {TOLERANCE}; not timed"
            elif not dry:
                ms = timed_ms(fn, device=device, calls=20, blocks=7)
                tf = work / (ms * 1e-3) / 1e12
        rows.append(
            Row(seq_len, batch, head_dim, heads, causal, path, backend, ms, tf, fa3, err, note)
        )

    selection = ab.select(spec, device=device, has_kv_cache=False)
    backend = selection.backend
    plan = backend.prepare(params)
    row("api", backend.name, lambda: backend.forward(qkv, plan))
    if device.type == "cuda":
        row("raw", "flashinfer", raw_kernel(spec, params, qkv))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| D | causal | seq | batch | path | backend | ms | TFLOP/s | FA3 H100 | ratio | error |",
        "|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.tflops / r.fa3_h100:.2f}" if r.tflops and r.fa3_h100 else "-"
        lines.append(
            f"| {r.head_dim} | {'yes' if r.causal else 'no'} | {r.seq_len} | {r.batch} | {r.path} "
            f"| {r.backend} | {f'{r.ms:.3f}' if r.ms else '-'} "
            f"| {f'{r.tflops:.0f}' if r.tflops else '-'} | {r.fa3_h100:.0f} | {ratio} "
            f"| {f'{r.error:.2g}' if r.error is not None else '-'} |"
            + (f" {r.note}" if r.note else "")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for attention_tflops.json/.md")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, no timing")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry)")
    device = torch.device("cpu" if args.dry else "cuda")
    rows: list[Row] = []
    for causal in (False, True):
        for head_dim in HEAD_DIMS:
            for seq_len in SEQ_LENS:
                rows.extend(measure(seq_len, head_dim, causal, device=device, dry=args.dry))
                print(markdown(rows[-2:]).splitlines()[-1], flush=True)
    text = markdown(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "tokens_per_batch": TOKENS,
            "width": WIDTH,
        }
        (args.out / "attention_tflops.json").write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n"
        )
        (args.out / "attention_tflops.md").write_text(text)
    wrong = [r for r in rows if r.note.startswith("wrong")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
