"""Host time per call of the contract around one backend's kernel, split into its parts.

`bench.py` reports API - raw (the public ``forward`` against flashinfer's kernel called by
hand) on a GPU only. This times, on any device and for any backend, one batch's calls back
to back (host time: no synchronisation inside a round):

- ``forward`` on the packed ``[tokens, (Hq + 2 Hkv) * D]`` buffer, and on separate q/k/v views
  of it (what the transformers integration passes);
- ``attend`` on views cut once, the backend's kernel call with no contract around it;
- the cut itself (the view of the rows as heads, split into q/k/v) and the output's row view,
  which a hand-written engine pays too.

``forward`` minus ``attend`` minus the cut and the row view is what the contract adds. Each
figure is the best of ``--rounds`` rounds of ``--calls`` calls. The output is checked against
the float64 reference once before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from attn_backends import AttentionSpec, FMHAParams, select
from attn_backends.plugin import QKVViews
from attn_backends.reference import TOLERANCE, reference_attention, relative_error

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _host_us(call: Callable[[], object], calls: int, rounds: int, device: torch.device) -> float:
    """Best round's host µs per call of ``calls`` back-to-back calls (synchronised between
    rounds, so one round's kernels do not run into the next's timing)."""
    for _ in range(max(10, calls // 10)):
        call()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return best / calls * 1e6


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths takes integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths takes positive integers, got {text!r}")
    return lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", help="a registered backend (default: the selector's pick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--lengths", type=_lengths, default=[32, 32, 32, 32], help="comma-separated tokens"
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    device = torch.device(args.device)
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = DTYPES[args.dtype] if args.dtype else default
    kv_heads = args.kv_heads or args.heads
    spec = AttentionSpec(
        num_heads=args.heads,
        num_kv_heads=kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        causal=False,
    )
    backend = select(spec, device=device, backend=args.backend).backend
    params = FMHAParams.from_lengths(args.lengths, device=device)
    plan = backend.prepare(params)
    tokens, d = params.token_q_num, args.head_dim
    heads = args.heads + 2 * kv_heads
    split = (args.heads, kv_heads, kv_heads)
    torch.manual_seed(0)
    qkv = torch.randn(tokens, heads * d, device=device, dtype=dtype)
    q, k, v = qkv.view(tokens, heads, d).split_with_sizes(split, 1)

    error = relative_error(backend.forward(qkv, plan), reference_attention(qkv, spec, params))
    if not error <= TOLERANCE[dtype]:
        print(
            f"{backend.name}: relative error {error:.3g} against the float64 reference "
            f"(tolerance {TOLERANCE[dtype]})",
            file=sys.stderr,
        )
        return 1

    views = QKVViews(qkv, q, k, v)
    kernel_out = backend.attend(views, plan)
    rows = (tokens, args.heads * d)

    def cut() -> object:
        return qkv.view(tokens, heads, d).split_with_sizes(split, 1), kernel_out.view(*rows)

    timed = {
        "forward_packed": lambda: backend.forward(qkv, plan),
        "forward_separate": lambda: backend.forward((q, k, v), plan),
        "attend": lambda: backend.attend(views, plan),
        "cut_and_rows": cut,
    }
    us = {name: _host_us(call, args.calls, args.rounds, device) for name, call in timed.items()}
    base = us["attend"] + us["cut_and_rows"]
    report = {
        "backend": backend.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "heads": [args.heads, kv_heads, d],
        "lengths": args.lengths,
        "relative_error": error,
        "host_us": {name: round(value, 2) for name, value in us.items()},
        "contract_us_packed": round(us["forward_packed"] - base, 2),
        "contract_us_separate": round(us["forward_separate"] - base, 2),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
