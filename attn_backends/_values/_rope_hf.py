"""`RopeSpec` from a transformers config: theta, rotated dims and scaling rule in one place.

Reads the config by attribute only, so transformers itself is never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import SpecError
from ._numbers import finite_float, shown
from ._rope_scaling import RopeScaling
from ._spec import RopeSpec

HF_DEFAULT_THETA = 10000.0
"""transformers' theta for a config that names none."""


def rope_spec_from_hf(
    rope_parameters: Mapping[str, Any] | None,
    *,
    head_dim: int,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
) -> RopeSpec:
    """The RoPE a transformers model applies, from its RoPE dict and head size.

    ``rope_theta`` and ``partial_rotary_factor`` are the config's top-level values (older
    configs keep them outside the dict); the dict's own win, as in transformers. A
    ``partial_rotary_factor`` below 1 rotates the leading ``int(head_dim * factor)`` dims (0:
    none, a spec without RoPE), except for ``proportional``, whose rule keeps the whole head
    and zeroes the frequencies of the trailing pairs.
    """
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
        raise SpecError(
            "rope_parameters must be a dict such as {'rope_type': 'default', 'rope_theta': 1e4} "
            f"or None, got {type(rope_parameters).__name__}"
        )
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise SpecError(f"head_dim must be a positive int, got {shown(head_dim)}")
    params = dict(rope_parameters or {})
    # transformers moves the top-level values into the dict unless it has its own.
    for key, value in (
        ("rope_theta", rope_theta),
        ("partial_rotary_factor", partial_rotary_factor),
    ):
        if params.get(key) is None and value is not None:
            params[key] = value
    share = params.get("partial_rotary_factor")
    fraction = 1.0 if share is None else finite_float(share)
    if fraction is None or not 0.0 <= fraction <= 1.0:
        raise SpecError(
            "partial_rotary_factor must be a number in [0, 1], the share of each head that "
            f"rotates (e.g. 0.5), got {shown(share)}"
        )
    scaling = RopeScaling.from_hf(
        params,
        max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=original_max_position_embeddings,
    )
    theta = params.get("rope_theta")
    if theta is None:
        theta = HF_DEFAULT_THETA  # any other value RopeSpec checks
    rotary_dim: int | None = None
    if scaling.rope_type != "proportional" and fraction != 1.0:
        rotary_dim = int(head_dim * fraction)
        if rotary_dim == 0:  # nothing rotates, so no scaling rule applies
            return RopeSpec(theta=theta, rotary_dim=0)
    return RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling=scaling)


def rope_spec_from_hf_config(config: object) -> RopeSpec:
    """`rope_spec_from_hf` with every value read from a transformers ``PretrainedConfig``.

    The config is an untyped boundary: which of these attributes exist depends on the model
    family and the transformers release (``rope_parameters`` in 5.x, ``rope_scaling`` before),
    so each is read with a None default and validated by `rope_spec_from_hf`.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    head_dim = getattr(config, "head_dim", None)
    if not head_dim:
        hidden = getattr(config, "hidden_size", None)
        heads = getattr(config, "num_attention_heads", None)
        if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
            raise SpecError(
                "the config has neither head_dim nor hidden_size and num_attention_heads; pass "
                "head_dim to rope_spec_from_hf"
            )
        head_dim = hidden // heads
    return rope_spec_from_hf(
        params,
        head_dim=head_dim,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        original_max_position_embeddings=getattr(config, "original_max_position_embeddings", None),
        rope_theta=getattr(config, "rope_theta", None),
        partial_rotary_factor=getattr(config, "partial_rotary_factor", None),
    )
