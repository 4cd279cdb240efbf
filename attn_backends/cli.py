"""``attn-backends``: list backends, explain a selection, check a backend on this machine."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from ._canary import run_canary
from ._capabilities import check_platform
from ._dtypes import parse_dtype
from ._errors import AttentionBackendError
from ._platform import Platform, detect_platform, parse_platform
from ._presets import PRESETS
from ._registry import get_registry
from ._selector import Selection, select
from ._spec import AttentionSpec, RopeSpec
from .bench import cli as bench_cli


def _platform_of(args: argparse.Namespace) -> Platform:
    if args.platform:
        return parse_platform(args.platform)
    return detect_platform(args.device)


def _add_platform_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--platform",
        metavar="P",
        help="dry run for another machine: cpu, cuda:sm90, rocm:gfx942 (library checks assumed)",
    )
    parser.add_argument(
        "--device", metavar="DEV", help="device to inspect (default: cuda if present)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention spec (a preset, overridden by any flag given)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a model's spec")
    g.add_argument("--heads", type=int, help="query heads")
    g.add_argument("--kv-heads", type=int, help="KV heads (default: --heads)")
    g.add_argument("--head-dim", type=int, help="head dim")
    g.add_argument("--dtype", help="fp16, bf16, fp32, fp8 ... (default bf16)")
    mask = g.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=None)
    mask.add_argument("--bidirectional", dest="causal", action="store_false")
    g.add_argument("--rope-theta", type=float, help="enable RoPE with this theta")
    g.add_argument("--rotary-dim", type=int, help="partial rotary dims (default: head dim)")
    g.add_argument("--interleaved", action="store_true", help="GPT-J style RoPE pairs")
    g.add_argument("--no-rope", action="store_true", help="drop the preset's RoPE")
    g.add_argument("--logn-base", type=int, help="enable logn scaling with this base")
    g.add_argument("--mla", action="store_true", help="the layer uses MLA")
    s = parser.add_argument_group("selection")
    s.add_argument("--backend", help="explicit backend (refused with reasons if it does not fit)")
    s.add_argument("--kv-cache", action="store_true", help="a KV cache is present")
    s.add_argument(
        "--need-rope-kv-cache",
        choices=("true", "false"),
        help="explicit flag value (default: derived)",
    )


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    """Build the spec from a preset and/or flags; a missing required field is a usage error."""
    base = PRESETS[args.preset] if args.preset else None
    heads = args.heads if args.heads is not None else (base.num_heads if base else None)
    dim = args.head_dim if args.head_dim is not None else (base.head_dim if base else None)
    if heads is None or dim is None:
        raise SystemExit("error: give --preset, or at least --heads and --head-dim")
    kv = (
        args.kv_heads
        if args.kv_heads is not None
        else (base.num_kv_heads if base and args.heads is None else heads)
    )
    dtype = parse_dtype(args.dtype) if args.dtype else (base.dtype if base else torch.bfloat16)
    causal = args.causal if args.causal is not None else (base.causal if base else True)
    rope = base.rope if base else None
    if args.no_rope:
        rope = None
    if args.rope_theta is not None:
        rope = RopeSpec(args.rope_theta, args.rotary_dim, args.interleaved)
    elif rope is not None and (args.rotary_dim is not None or args.interleaved):
        rope = replace(rope, rotary_dim=args.rotary_dim, interleaved=args.interleaved)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=dim,
        dtype=dtype,
        causal=causal,
        rope=rope,
        use_logn_attn=args.logn_base is not None,
        logn_base=args.logn_base,
        use_mla=args.mla,
    )


def _select_from_args(args: argparse.Namespace) -> Selection:
    flag = None if args.need_rope_kv_cache is None else args.need_rope_kv_cache == "true"
    return select(
        spec_from_args(args),
        device=args.device,
        has_kv_cache=args.kv_cache,
        need_rope_kv_cache=flag,
        backend=args.backend,
        platform=_platform_of(args),
    )


def cmd_list(args: argparse.Namespace) -> int:
    registry = get_registry()
    platform = _platform_of(args)
    rows = []
    for entry in registry.entries():
        caps = entry.backend.capabilities
        reasons = check_platform(caps, platform)
        rows.append(
            {
                "name": entry.backend.name,
                "plugin": entry.plugin,
                "available": not reasons,
                "reasons": [r.to_dict() for r in reasons],
                "capabilities": caps.to_dict(),
            }
        )
    plugins = [r.to_dict() for r in registry.records()]
    if args.json:
        print(
            json.dumps(
                {"platform": platform.to_dict(), "backends": rows, "plugins": plugins}, indent=2
            )
        )
        return 0
    print(f"platform: {platform}" + (" (dry run)" if platform.assumed else ""))
    for row, entry in zip(rows, registry.entries(), strict=True):
        state = "available" if row["available"] else "unavailable"
        declared = entry.backend.capabilities.to_dict()
        print(f"\n{row['name']}  [{state}]  plugin {row['plugin']}")
        for reason in check_platform(entry.backend.capabilities, platform):
            print(f"    - {reason}")
        for key in (
            "platforms",
            "dtypes",
            "head_dims",
            "gqa",
            "causal",
            "bidirectional",
            "needs_contiguous",
            "fused_rope",
            "headwise",
            "requires",
            "priority",
        ):
            print(f"    {key}: {declared[key]}")
    problems = [p for p in registry.records() if p.status != "loaded" or p.error]
    if problems:
        print("\nplugin problems:")
        for p in problems:
            print(f"  {p.name}: {p.status}: {p.error}  ({p.source})")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    selection = _select_from_args(args)
    print(json.dumps(selection.to_dict(), indent=2) if args.json else selection.explain())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.platform:
        raise SystemExit("error: check runs kernels on this machine; --platform is for explain")
    selection = _select_from_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = run_canary(selection.backend, selection.spec, device, seed=args.seed)
    ok = result.status == "passed"
    if args.json:
        print(
            json.dumps(
                {"backend": selection.name, "device": str(device), **result.to_dict()}, indent=2
            )
        )
    else:
        print(f"{'OK' if ok else 'MISMATCH'}: {selection.name}: {result.detail}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attn-backends",
        description="Pick, explain and check no-KV-cache prefill attention backends.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log selection details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_list = sub.add_parser(
        "list",
        help="every registered backend, available or not and why",
        description="List registered backends, their capabilities, "
        "availability on this machine (or --platform) and plugin errors.",
    )
    _add_platform_args(p_list)
    p_list.set_defaults(func=cmd_list)
    p_explain = sub.add_parser(
        "explain",
        help="which backend a spec gets, and why",
        description="Explain the selection for a spec: every candidate "
        "with its verdict and reasons, and where the decision came from.",
    )
    _add_platform_args(p_explain)
    _add_spec_args(p_explain)
    p_explain.set_defaults(func=cmd_explain)
    p_check = sub.add_parser(
        "check",
        help="run a canary through the selected backend",
        description="Run a small varlen batch through the selected backend "
        "on this machine and compare it with the float64 reference; exit 1 "
        "on mismatch.",
    )
    _add_platform_args(p_check)
    _add_spec_args(p_check)
    p_check.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p_check.set_defaults(func=cmd_check)
    p_bench = sub.add_parser("bench", help="benchmark the no-cache prefill paths on a CUDA GPU")
    bench_cli.add_arguments(p_bench)
    p_bench.set_defaults(func=bench_cli.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except AttentionBackendError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
