"""Where the host time of one packed sentence-transformers encode goes, on the device.

Builds one serving-benchmark model (random weights), warms both paths, then profiles
``encodes`` packed encodes of one workload with cProfile and prints the library's functions
by own time and by cumulative time, and the share of the forward the mask hook takes::

    python3 benchmarks/gpu/profile_serving.py --model bge-m3 --workload "queries 8"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serving_bench as sb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bge-m3")
    parser.add_argument("--workload", default="queries 8")
    parser.add_argument("--encodes", type=int, default=20)
    parser.add_argument("--top", type=int, default=35)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = sb._cases()[args.model]
    tiny = device.type == "cpu"
    chosen = sb._chosen(sb.workloads(False, tiny), args.workload)
    if not chosen:
        parser.error(f"no workload starts with {args.workload!r}")
    name, batch = chosen[0]
    with tempfile.TemporaryDirectory() as tmp:
        st_dir = sb.build_model(args.model, case, Path(tmp), tiny, 64 if tiny else 8192)
        paths = sb.Paths(st_dir, case, device, tiny)
        for model in (paths.padded, paths.packed):
            for _ in range(3):
                model.encode(batch, batch_size=sb.ST_BATCH, convert_to_tensor=True)
        for label, model in (("padded", paths.padded), ("packed", paths.packed)):
            torch.cuda.synchronize() if device.type == "cuda" else None
            start = time.perf_counter()
            for _ in range(args.encodes):
                model.encode(batch, batch_size=sb.ST_BATCH, convert_to_tensor=True)
            torch.cuda.synchronize() if device.type == "cuda" else None
            took = (time.perf_counter() - start) / args.encodes * 1e3
            print(f"{args.model} {name} {label}: {took:.2f} ms per encode")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.encodes):
            paths.packed.encode(batch, batch_size=sb.ST_BATCH, convert_to_tensor=True)
        torch.cuda.synchronize() if device.type == "cuda" else None
        profile.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out).sort_stats(order)
        stats.print_stats(args.top)
        print(f"===== by {order} (per {args.encodes} encodes)")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
