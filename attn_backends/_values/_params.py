"""Per-batch metadata, built once with all host work done, then shared by every layer."""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._errors import ParamsError

_INT32_MAX = 2**31 - 1
_INT32_CODE = next(code for code in "ilh" if array.array(code).itemsize == 4)
"""The `array` type code of a 32-bit int on this platform."""


def _as_int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ParamsError(f"{name} must be a 1-D integer tensor or a sequence of ints")
        if values.device.type == "meta":
            raise ParamsError(f"{name} is on the meta device and has no values; pass host ints")
        return [int(v) for v in values.tolist()]
    try:
        items = list(values)
    except TypeError:
        raise ParamsError(
            f"{name} must be a sequence of ints or a 1-D integer tensor, got "
            f"{type(values).__name__}"
        ) from None
    out: list[int] = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ParamsError(f"{name} must hold ints, got {v!r}")
        out.append(v)
    return out


@dataclass(frozen=True, eq=False)
class FMHAParams:
    """Ragged-batch metadata for one no-cache prefill.

    Build it with `FMHAParams.from_lengths`; every tensor is int32 on the device the QKV
    buffer lives on (``positions`` made on first use, once), so no backend converts or moves
    anything per layer.
    """

    input_lengths: tuple[int, ...]
    """Tokens of each sequence, host side (used by planners that need host metadata)."""
    cu_seqlens_q: torch.Tensor
    """int32 ``[batch_size + 1]`` prefix sums of query lengths, on the QKV device."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[batch_size + 1]``; equals ``cu_seqlens_q`` on this path (no prefix)."""
    max_seqlen_q: int
    max_seqlen_k: int
    token_q_num: int
    """Valid query tokens; rows past this in the QKV buffer are padding."""
    token_kv_num: int
    batch_size: int
    rows: int
    """Rows of the packed QKV buffer the engine hands over (``>= token_q_num``)."""
    device: torch.device

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """int32 ``[token_q_num]`` position of each token in its own sequence (restarts at 0),
        on the QKV device. Made on first use, once: only RoPE passes and some checks read it,
        and a batch that never rotates pays nothing for it."""
        total = self.token_q_num
        positions = torch.arange(total, dtype=torch.int32)
        lengths = self.input_lengths
        if len(lengths) > 1:  # each sequence counts from 0: subtract its start from its rows
            starts = torch.tensor(list(itertools.accumulate(lengths[:-1], initial=0)))
            positions -= starts.repeat_interleave(torch.tensor(lengths), output_size=total).int()
        return positions.to(self.device)

    @classmethod
    def from_lengths(
        cls,
        input_lengths: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str,
        prefix_lengths: Sequence[int] | torch.Tensor | None = None,
        padded_rows: int | None = None,
    ) -> FMHAParams:
        """Build the metadata from per-sequence token counts.

        ``prefix_lengths`` exists so that engines can pass what they have: any non-zero prefix
        is refused, because cached-prefix attention reads K/V this path never holds.
        ``padded_rows`` is the row count of the QKV buffer when the engine pads it (CUDA
        graphs); the padding rows never reach the output.
        """
        lengths = _as_int_list("input_lengths", input_lengths)
        if not lengths:
            raise ParamsError("input_lengths is empty: a prefill batch needs at least one sequence")
        negative = [i for i, n in enumerate(lengths) if n < 0]
        if negative:
            raise ParamsError(f"input_lengths must be >= 0; sequences {negative} are negative")
        total = sum(lengths)
        if total == 0:
            raise ParamsError("input_lengths are all zero: the batch has no token to attend")
        if total > _INT32_MAX:
            raise ParamsError(
                f"{total} tokens overflow the int32 cu_seqlens kernels read (at most "
                f"{_INT32_MAX}); split the batch"
            )
        if prefix_lengths is not None:
            prefixes = _as_int_list("prefix_lengths", prefix_lengths)
            if len(prefixes) != len(lengths):
                raise ParamsError(
                    f"prefix_lengths has {len(prefixes)} entries for {len(lengths)} sequences"
                )
            cached = [i for i, p in enumerate(prefixes) if p != 0]
            if cached:
                raise ParamsError(
                    f"sequences {cached} have a cached prefix; the no-cache prefill path only "
                    "serves prefix length 0 (use the engine's KV-cache attention path)"
                )
        rows = total if padded_rows is None else padded_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < total:
            raise ParamsError(
                f"padded_rows must be an int >= token_q_num ({total}), got {padded_rows!r}"
            )
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ParamsError(f"device {device!r} is not a torch device: {exc}") from None

        # read in place from a host buffer: torch.tensor converts a list element by element
        host_cu = torch.frombuffer(
            array.array(_INT32_CODE, itertools.accumulate(lengths, initial=0)), dtype=torch.int32
        )
        try:
            cu_tensor = host_cu.to(dev)
        except (RuntimeError, AssertionError) as exc:
            raise ParamsError(f"cannot place batch metadata on {dev}: {exc}") from None
        return cls(
            input_lengths=tuple(lengths),
            cu_seqlens_q=cu_tensor,
            cu_seqlens_k=cu_tensor,
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
            token_q_num=total,
            token_kv_num=total,
            batch_size=len(lengths),
            rows=rows,
            device=cu_tensor.device,
        )

    @property
    def cu_seqlens_host(self) -> tuple[int, ...]:
        """Host copy of the prefix sums, derived without touching the device."""
        cu = [0]
        for n in self.input_lengths:
            cu.append(cu[-1] + n)
        return tuple(cu)

    def to_dict(self) -> dict[str, object]:
        return {
            "batch_size": self.batch_size,
            "token_q_num": self.token_q_num,
            "rows": self.rows,
            "max_seqlen_q": self.max_seqlen_q,
            "device": str(self.device),
        }
