"""What the tests of one backend on the CPU share (torch-varlen, fa4, flex): a spec by its few
varying fields, the reason codes a backend gives, a packed batch, the numeric check, a registry
of chosen built-in plugins."""

from __future__ import annotations

from types import ModuleType

import torch

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends.deploy import Registry
from attn_backends.reference import TOLERANCE, relative_error


def spec_of(
    dtype: torch.dtype = torch.bfloat16,
    heads: tuple[int, int] = (8, 2),
    dim: int = 128,
    causal: bool = True,
    **kw: object,
) -> ab.AttentionSpec:
    return ab.AttentionSpec(heads[0], heads[1], dim, dtype, causal, **kw)  # type: ignore[arg-type]


def reason_codes(
    backend: type[abp.PrefillBackend], spec: ab.AttentionSpec, platform: ab.Platform | str
) -> set[ab.ReasonCode]:
    """The codes of ``backend``'s refusal of ``spec`` on ``platform`` (empty: it serves it)."""
    where = ab.parse_platform(platform) if isinstance(platform, str) else platform
    return {r.code for r in backend.supports(spec, where)}


def packed_input(
    spec: ab.AttentionSpec, lengths: tuple[int, ...], pad: int = 3, extra: int = 0, seed: int = 0
) -> tuple[ab.FMHAParams, torch.Tensor]:
    """Random packed rows with ``pad`` padding rows; with ``extra`` columns on each side the
    rows are a strided column slice of a wider buffer."""
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=tokens + pad)
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens + pad, spec.qkv_width + 2 * extra, generator=gen).to(spec.dtype)
    return params, wide[:, extra : extra + spec.qkv_width]


def check_numbers(
    out: torch.Tensor, pristine: torch.Tensor, spec: ab.AttentionSpec, params: ab.FMHAParams
) -> None:
    ref = ab.reference_attention(pristine, spec, params)
    err = relative_error(out, ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g}"


def registry_of(plugins: dict[str, ModuleType]) -> Registry:
    """A registry holding only ``plugins`` (name -> built-in plugin module), for rank tests."""
    reg = Registry()
    for name, module in plugins.items():
        reg.register_plugin(module, name=name)
    return reg
