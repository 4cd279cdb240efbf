"""The attention spec that ``explain`` and ``check`` ask about, built from a preset and flags.

Rule: each spec flag given replaces that one field of the preset; every field not given keeps
the preset's value (without a preset: MHA, bf16, causal, no RoPE, no logn). Nothing given is
dropped silently: a flag that cannot take effect, or two that contradict each other, is a
`CommandLineError` that names both and says what to give instead. The cross-field checks run
here, before `AttentionSpec`, so that the message speaks of flags rather than of fields.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from ._cli_args import CommandLineError
from ._errors import SpecError
from ._presets import PRESETS
from ._spec import AttentionSpec, RopeSpec

_DEFAULT = AttentionSpec(1, 1, 2, torch.bfloat16, causal=True)
"""The fields a spec without a preset starts from (heads and head dim are always given)."""


def _origin(flag: str, given: object, what: str, preset: str | None, value: object) -> str:
    """How a value arrived, for messages: ``--heads 8`` or ``the 12 KV heads of preset x``."""
    if given is not None:
        return f"{flag} {given}"
    return f"the {value} {what} of preset {preset}"


def _rope(args: argparse.Namespace, base: RopeSpec | None, preset: str | None) -> RopeSpec | None:
    theta: float | None = args.rope_theta
    rotary_dim: int | None = args.rotary_dim
    interleaved: bool = args.interleaved
    shaping = [
        flag
        for flag, given in (
            ("--rope-theta", theta is not None),
            ("--rotary-dim", rotary_dim is not None),
            ("--interleaved", interleaved),
        )
        if given
    ]
    if args.no_rope:
        if shaping:
            raise CommandLineError(
                f"--no-rope contradicts {' and '.join(shaping)}: give --no-rope to drop RoPE, or "
                "the RoPE flags to shape it, not both"
            )
        return None
    rope = base
    if theta is not None:
        rope = RopeSpec(theta) if rope is None else replace(rope, theta=theta)
    if rope is None:
        if shaping:
            source = f"preset {preset}" if preset else "this spec"
            raise CommandLineError(
                f"{' and '.join(shaping)} {'shape' if len(shaping) > 1 else 'shapes'} RoPE, "
                f"but {source} has none: add --rope-theta THETA (e.g. 10000) to enable it, or "
                f"drop {'them' if len(shaping) > 1 else 'it'}"
            )
        return None
    if rotary_dim is not None:
        rope = replace(rope, rotary_dim=rotary_dim)
    if interleaved:
        rope = replace(rope, interleaved=True)
    return rope


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    """The spec the flags describe; a missing, contradicting or unused flag is refused."""
    preset: str | None = args.preset
    base = PRESETS[preset] if preset is not None else None
    heads: int | None = args.heads if args.heads is not None else (base.num_heads if base else None)
    head_dim: int | None = (
        args.head_dim if args.head_dim is not None else (base.head_dim if base else None)
    )
    if heads is None or head_dim is None:
        raise CommandLineError(
            f"give --preset NAME ({', '.join(sorted(PRESETS))}), or at least --heads and --head-dim"
        )
    start = base if base is not None else replace(_DEFAULT, num_heads=heads, num_kv_heads=heads)
    kv_heads: int = args.kv_heads if args.kv_heads is not None else start.num_kv_heads
    if heads % kv_heads:
        raise CommandLineError(
            f"{_origin('--heads', args.heads, 'query heads', preset, heads)} is not a multiple "
            f"of {_origin('--kv-heads', args.kv_heads, 'KV heads', preset, kv_heads)}: give "
            f"--kv-heads N with N dividing {heads} (N = {heads} for plain multi-head attention)"
        )
    rope = _rope(args, start.rope, preset)
    if rope is not None:
        dim_text = _origin("--head-dim", args.head_dim, "head dim", preset, head_dim)
        if rope.rotary_dim is not None and rope.rotary_dim > head_dim:
            raise CommandLineError(
                f"--rotary-dim {rope.rotary_dim} exceeds {dim_text}: give at most {head_dim}"
            )
        if rope.rotary_dim is None and head_dim % 2:
            raise CommandLineError(
                f"RoPE over the whole head needs an even head dim, got {dim_text}: give "
                "--rotary-dim with the even number of rotated dims, or --no-rope"
            )
    logn: int | None = args.logn_base if args.logn_base is not None else start.logn_base
    causal: bool = args.causal if args.causal is not None else start.causal
    try:
        return replace(
            start,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=args.dtype if args.dtype is not None else start.dtype,
            causal=causal,
            rope=rope,
            use_logn_attn=logn is not None,
            logn_base=logn,
            use_mla=bool(args.mla) or start.use_mla,
        )
    except SpecError as exc:
        raise CommandLineError(f"these flags describe no valid attention layer: {exc}") from exc
