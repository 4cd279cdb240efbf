"""Separate Q, K, V input: ``forward((q, k, v), plan)`` for models with separate projections.

BERT-style checkpoints, LoRA on q/v and separately quantised linears produce three tensors;
concatenating them into a packed buffer every layer is the copy this library exists to remove.
Each tensor is ``[rows, heads * D]`` or ``[rows, heads, D]`` (heads dense within a row, any row
stride), the rows those of the plan. The rules are the packed contract's: every check before
the first write, RoPE/logn in place on the valid rows of ``q`` and ``k`` (V and padding rows never
written), views trimmed to the valid tokens reach the kernel, copied only for a backend that
declares it needs dense memory. The RoPE/logn pass here is the torch one: the native kernel and
flashinfer's work on packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._dtypes import dtype_name
from ._errors import PackedQKVError
from ._params import FMHAParams
from ._rope import PositionTables, apply_rope_logn, build_position_tables
from ._spec import AttentionSpec


@dataclass(frozen=True, eq=False)
class SeparateQKV:
    """The three tensors of a ``(q, k, v)`` input, as given."""

    q: object
    k: object
    v: object


def _fail(problem: str, expected: str) -> PackedQKVError:
    return PackedQKVError(f"{problem}; expected {expected}")


def _as_heads(
    name: str, t: object, heads: int, spec: AttentionSpec, params: FMHAParams
) -> torch.Tensor:
    """``t`` checked and viewed as ``[rows, heads, D]`` (a view: nothing is copied)."""
    width = heads * spec.head_dim
    layout = f"[rows, {heads} * {spec.head_dim}] or [rows, {heads}, {spec.head_dim}]"
    if not isinstance(t, torch.Tensor):
        raise _fail(f"{name} is a {type(t).__name__}", f"a torch.Tensor {layout}")
    shape = tuple(t.shape)
    if not ((t.dim() == 2 and shape[1] == width) or shape[1:] == (heads, spec.head_dim)):
        raise _fail(f"{name} of shape {shape}", f"{layout} for the spec's heads")
    dense_row = t.stride(-1) == 1 and (t.dim() == 2 or heads == 1 or t.stride(1) == spec.head_dim)
    if not dense_row:
        raise _fail(
            f"{name} with strides {tuple(t.stride())}",
            "heads dense within a row (unit stride inside a row; rows may be strided)",
        )
    grid = t if t.dim() == 3 else t.view(shape[0], heads, spec.head_dim)
    if t.dtype != spec.dtype:
        raise _fail(
            f"{name} of dtype {dtype_name(t.dtype)}", f"the spec's {dtype_name(spec.dtype)}"
        )
    if t.device != params.device:
        raise _fail(
            f"{name} on {t.device} but FMHAParams on {params.device}",
            "every tensor on the plan's device",
        )
    if shape[0] != params.rows:
        raise _fail(
            f"{name} with {shape[0]} rows for a plan of {params.rows} rows",
            "the rows the plan was made for (padded_rows when the tensors carry padding)",
        )
    if shape[0] > 1 and grid.stride(0) < width:
        raise _fail(f"{name} whose rows overlap (row stride {grid.stride(0)})", f">= {width}")
    return grid


def check_separate(
    given: SeparateQKV, spec: AttentionSpec, params: FMHAParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V as ``[rows, heads, D]`` views after every rule; raises `PackedQKVError`."""
    q = _as_heads("q", given.q, spec.num_heads, spec, params)
    k = _as_heads("k", given.k, spec.num_kv_heads, spec, params)
    v = _as_heads("v", given.v, spec.num_kv_heads, spec, params)
    if q.data_ptr() == k.data_ptr() and q.untyped_storage().data_ptr() == (
        k.untyped_storage().data_ptr()
    ):
        raise _fail(
            "q and k are the same memory (RoPE would rotate it twice)",
            "three distinct tensors, or the packed buffer",
        )
    return q, k, v


def rotate_separate(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    tables: PositionTables | None,
) -> None:
    """RoPE on the valid rows of ``q`` and ``k`` and logn on ``q``, in place (torch ops)."""
    if tables is None:
        tables = build_position_tables(spec, params.positions, params.max_seqlen_q)
    tokens = params.token_q_num
    apply_rope_logn(q[:tokens], spec.num_heads, spec, tables)
    apply_rope_logn(k[:tokens], 0, spec, tables)


def separate_note(tokens: int, *, certain: bool) -> str:
    was = "WAS MODIFIED" if certain else "MAY HAVE BEEN MODIFIED"
    return (
        f"the input {was}: RoPE/logn were applied in place to rows [0, {tokens}) of q and k; "
        "v and padding rows are untouched. Recompute q and k (or restore copies) before "
        "retrying or falling back"
    )


def packed_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[tokens, (Hq + 2*Hkv) * D]`` rows of separate views: a copy, made only for a
    kernel that reads packed rows."""
    return torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
