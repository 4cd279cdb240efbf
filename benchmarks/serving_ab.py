"""Padded sdpa and the library's packed path of one model, timed in alternating rounds.

`serving_bench.py` times each path in one block, so a drift of the machine between blocks
(clocks, a neighbour on the host) lands in the ratio. Here the two paths alternate, round by
round, in one process; each round takes the median of ``--repeats`` encodes (synchronised per
call) and the report keeps each path's best round. Run it once per code tree in one session
to compare trees (``--label`` names the tree in the JSON lines it prints), e.g.::

    python3 benchmarks/serving_ab.py --label new --workloads "documents,queries 8"
    PYTHONPATH=/tmp/old:/tmp/old/plugins python3 benchmarks/serving_ab.py --label old ...

The packed path drops the shared layouts before every encode, as `serving_bench.py` does (each
batch pays for its boundaries as a batch of new lengths does).

``--floor`` adds a third path to the rounds of a one-text workload: the packed encode with the
library's attention and mask hooks swapped for transformers' own sdpa attention and no mask,
i.e. what the packed path would cost if attention proved and checked nothing. No library can
beat it; where it equals padded sdpa, packing has nothing to save on that workload. (Exact
for one sequence without padding only; a workload of several texts reports no floor.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_bench as bench


def _round(encode: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``repeats`` encodes, each synchronised."""
    return statistics.median(bench.synchronised_ms(encode, repeats, device))


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The floor's mask function: no mask (transformers' sdpa attention then runs unmasked)."""
    return None


@contextlib.contextmanager
def _hooks_free(name: str) -> Iterator[None]:
    """transformers' attention and mask functions registered as ``name`` swapped for the
    floor's (transformers' own ``sdpa`` attention, the padded path's, given no mask), restored
    on exit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention, masks = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    kept = attention[name], masks[name]
    attention[name], masks[name] = attention["sdpa"], _no_mask
    try:
        yield
    finally:
        attention[name], masks[name] = kept


def _floor(packed: Callable[[], object]) -> Callable[[], object]:
    """``packed`` run with the library's hooks free (`_hooks_free`)."""
    from attn_backends.integrations.transformers import DEFAULT_NAME

    def encode() -> object:
        with _hooks_free(DEFAULT_NAME):
            return packed()

    return encode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="this tree", help="names the code tree in the output")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time a one-text workload's packed encode with the library's hooks free",
    )
    bench.add_one_model_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    device = torch.device(args.device)
    import attn_backends

    for workload in bench.one_model_workloads(parser, args):
        encodes = {"padded": workload.padded, "packed": workload.packed}
        floor_wrong: str | None = None
        if args.floor and workload.texts == 1:
            floor = _floor(workload.packed)
            cosine = bench.min_cosine(floor(), workload.padded())
            if cosine >= bench.cosine_bound(workload.dtype):
                encodes["floor"] = floor
            else:  # a window, soft cap, sinks...: unmasked SDPA is not this model's attention
                floor_wrong = (
                    f"unmasked SDPA is not this model's attention: min cosine {cosine:.6f}"
                )
        for _ in range(2):  # warm-up, every path
            for encode in encodes.values():
                encode()
        rounds: dict[str, list[float]] = {name: [] for name in encodes}
        for _ in range(args.rounds):
            for name, encode in encodes.items():
                rounds[name].append(_round(encode, args.repeats, device))
        best = {name: min(values) for name, values in rounds.items()}
        report = {
            "label": args.label,
            "library": str(Path(attn_backends.__file__).parent),
            "model": args.model,
            "workload": workload.name,
            "padded_ms": round(best["padded"], 3),
            "packed_ms": round(best["packed"], 3),
            "packed_over_padded": round(best["packed"] / best["padded"], 3),
        }
        if "floor" in best:
            report["floor_ms"] = round(best["floor"], 3)
            report["floor_over_padded"] = round(best["floor"] / best["padded"], 3)
        elif args.floor:
            report["floor_ms"] = None
            report["no_floor"] = floor_wrong or "several texts: unmasked SDPA would mix them"
        report["rounds_ms"] = {k: [round(v, 3) for v in vs] for k, vs in rounds.items()}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
