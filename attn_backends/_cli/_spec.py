"""The attention spec that ``explain`` and ``check`` ask about, built from a preset and flags.

Rule: each spec flag given replaces that one field of the preset; every field not given keeps
the preset's value (without a preset: MHA, bf16, causal, no RoPE, no logn, no window, soft-cap
or ALiBi). Nothing given is dropped silently: a flag that cannot take effect, or two that
contradict each other, is a `CommandLineError` that names both and says what to give instead.
The cross-field checks run here, before `AttentionSpec`, so that the message speaks of flags
rather than of fields.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from .._values._errors import SpecError
from .._values._features import AlibiSpec, SlidingWindow
from .._values._rope_scaling import RopeScaling
from .._values._spec import PRESETS, AttentionSpec, RopeSpec
from ._args import CommandLineError

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
            ("--rope-scaling", args.rope_scaling is not None),
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
    return _scaled(args, rope)


_MAX_POSITIONS_UNUSED = frozenset({"default", "linear", "proportional"})
"""Scaling rules that never read ``max_position_embeddings``."""


def _scaled(args: argparse.Namespace, rope: RopeSpec) -> RopeSpec:
    """``rope`` with the ``--rope-scaling`` rule, read as transformers reads the dict."""
    parameters: dict[str, object] | None = args.rope_scaling
    max_positions: int | None = args.max_position_embeddings
    if parameters is None:
        return rope
    try:
        scaling = RopeScaling.from_hf(parameters, max_position_embeddings=max_positions)
    except SpecError as exc:
        raise CommandLineError(
            f"--rope-scaling: {exc} (--max-position-embeddings N gives the config's "
            "max_position_embeddings)"
        ) from exc
    if max_positions is not None and scaling.rope_type in _MAX_POSITIONS_UNUSED:
        raise CommandLineError(
            f"--max-position-embeddings {max_positions} has no effect on rope_type "
            f"{scaling.rope_type!r} (only dynamic, yarn, longrope and llama3 read it): drop it"
        )
    try:
        return replace(rope, scaling=scaling)
    except SpecError as exc:
        raise CommandLineError(f"--rope-scaling does not fit this RoPE: {exc}") from exc


def _window(
    args: argparse.Namespace, start: AttentionSpec, causal: bool, preset: str | None
) -> SlidingWindow | None:
    given: tuple[int, int] | None = args.window
    if given is None:
        return start.window
    left, right = given
    if causal and right:
        if args.causal is not None:
            source = "--causal"
        elif preset is not None:
            source = f"the causal mask of preset {preset}"
        else:
            source = "the default causal mask"
        raise CommandLineError(
            f"--window {left},{right} reaches {right} keys after the query, but {source} "
            f"hides them: give --window {left},0, or --bidirectional for a two-sided window"
        )
    return SlidingWindow(left, right)


def _max_positions_alone(args: argparse.Namespace) -> None:
    if args.max_position_embeddings is not None and args.rope_scaling is None:
        raise CommandLineError(
            "--max-position-embeddings only feeds --rope-scaling: add --rope-scaling JSON "
            '(e.g. \'{"rope_type": "dynamic", "factor": 2}\') or drop it'
        )


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
    _max_positions_alone(args)
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
        if args.rope_scaling is not None and rope.scaling is not None:
            rotated = head_dim if rope.rotary_dim is None else rope.rotary_dim
            try:
                rope.scaling.check_rotary_dim(rotated)
            except SpecError as exc:
                raise CommandLineError(f"--rope-scaling does not fit {dim_text}: {exc}") from exc
    logn: int | None = args.logn_base if args.logn_base is not None else start.logn_base
    causal: bool = args.causal if args.causal is not None else start.causal
    window = _window(args, start, causal, preset)
    softcap: float | None = (
        args.logit_softcap if args.logit_softcap is not None else start.logit_softcap
    )
    alibi = AlibiSpec() if args.alibi else start.alibi
    chunk: int | None = args.chunk_size if args.chunk_size is not None else start.chunk_size
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
            window=window,
            logit_softcap=softcap,
            alibi=alibi,
            chunk_size=chunk,
        )
    except SpecError as exc:
        raise CommandLineError(f"these flags describe no valid attention layer: {exc}") from exc
