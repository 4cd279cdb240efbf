"""`RopeSpec`, the rotary position embedding of a layer, apart from `AttentionSpec`: the
feature table builds RoPE specs for its conformance cases, and `_spec` imports the table, so the
value lives below both and every import runs one way."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import SpecError
from ._numbers import finite_float, shown
from ._rope_scaling import RopeScaling

MAX_ROPE_THETA = 2.0**126
"""Largest RoPE theta (about 8.5e37; real models use 1e4 to 1e7): fused RoPE kernels take theta
as a float32 and use ``1 / theta``, which must stay a normal float32."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding applied to Q and K before attention."""

    theta: float
    """Base of the inverse frequencies, e.g. 10000 for Llama-2, 1e6 for Qwen3."""
    rotary_dim: int | None = None
    """Leading dims of each head that rotate; ``None`` means the whole head. ``0`` rotates
    nothing (transformers' ``partial_rotary_factor=0``): a spec with it has no RoPE."""
    interleaved: bool = False
    """``False``: rotate-half pairs ``(i, i + r/2)`` (Llama/Qwen in HF transformers).
    ``True``: adjacent pairs ``(2i, 2i + 1)`` (GPT-J)."""
    scaling: RopeScaling | None = None
    """Long-context scaling of the frequencies (transformers' ``rope_type``); ``None`` is plain
    RoPE. ``RopeScaling()`` (plain) is stored as ``None``, so that both compare, hash and
    fingerprint alike."""

    def __post_init__(self) -> None:
        theta = finite_float(self.theta)
        if theta is None or not 1.0 < theta <= MAX_ROPE_THETA:
            raise SpecError(
                "RopeSpec.theta must be > 1, finite and at most 2**126 (e.g. 10000.0; fused "
                f"kernels read 1/theta as a float32), got {shown(self.theta)}"
            )
        object.__setattr__(self, "theta", theta)
        if self.rotary_dim is not None and (
            isinstance(self.rotary_dim, bool)
            or not isinstance(self.rotary_dim, int)
            or self.rotary_dim < 0
            or self.rotary_dim % 2
        ):
            raise SpecError(
                "RopeSpec.rotary_dim must be an even int >= 0 (0 rotates nothing) or None, got "
                f"{shown(self.rotary_dim)}"
            )
        check_flag("RopeSpec.interleaved", self.interleaved)
        if self.scaling is not None:
            if not isinstance(self.scaling, RopeScaling):
                raise SpecError(
                    f"RopeSpec.scaling must be a RopeScaling or None, got {shown(self.scaling)}"
                )
            if self.scaling.is_plain:
                object.__setattr__(self, "scaling", None)
            elif self.rotary_dim:
                self.scaling.check_rotary_dim(self.rotary_dim)

    @property
    def is_plain(self) -> bool:
        """Plain theta RoPE (no scaling rule): what the native and fused kernels compute."""
        return self.scaling is None or self.scaling.is_plain

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "theta": self.theta,
            "rotary_dim": self.rotary_dim,
            "interleaved": self.interleaved,
        }
        if self.scaling is not None:  # absent when unset: plain specs keep their fingerprints
            out["scaling"] = self.scaling.to_dict()
        return out


def check_flag(name: str, value: object) -> None:
    """Flags are real bools: a truthy string such as "false" must not switch a mask on."""
    if not isinstance(value, bool):
        raise SpecError(f"{name} must be True or False, got {value!r}")
