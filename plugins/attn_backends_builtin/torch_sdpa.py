"""``torch-sdpa``: the reference backend. Runs wherever torch runs; the CPU default and the
last resort on GPUs.

Consecutive sequences of equal length form one ``[n, L, H, D]`` view of the packed rows, so a
batch of equal-length sequences (BERT-style) is a single SDPA call and no gather is needed.
Sequences of other lengths are grouped (`_groups`): longest first, a sequence joins the group
of longer ones while the work its padding adds costs less than one more kernel call, and each
group is one SDPA call on its rows gathered to ``[n, L, H, D]`` with the padded keys masked, its
valid rows gathered back. A short batch of queries is one call instead of one per length.

Sliding windows, chunks and ALiBi become one explicit mask per distinct sequence length, built in
``prepare`` (positions restart per sequence, so every sequence of a length shares it) from the same
elementwise definition flex runs (`_masks.dense_mask`): boolean ``[L, L]`` for a window or chunks,
additive ``[H, L, L]`` with ALiBi. Soft-capping acts between the two matmuls inside SDPA and cannot
be expressed, so it is not declared.

Attention sinks are one more key per sequence: K and V gain a zero row and the mask a column
holding each head's sink logit, so SDPA's softmax has exactly the sink's extra denominator term
and the zero value adds nothing. That run is computed in float32 (the mask column keeps the
logit unrounded; a 16-bit mask would round it to 8 bits) from a float32 additive mask per
length built in ``prepare``; it copies Q/K/V per layer, which the reference backend may.
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attn_backends import AttentionSpec, FMHAParams, PrefillPlan
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    AlibiSupport,
    Capabilities,
    ChunkSupport,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    SinkSupport,
    WindowSupport,
    hookimpl,
)
from attn_backends_builtin._masks import dense_mask as _dense_mask

API_VERSION = "2.0"


class _Run(NamedTuple):
    """``sequences`` consecutive sequences of ``length`` tokens starting at row ``start`` (a
    tuple: a batch of sequences of many lengths makes one per sequence, per batch)."""

    start: int
    sequences: int
    length: int


def _runs(lengths: tuple[int, ...]) -> tuple[_Run, ...]:
    runs: list[_Run] = []
    start = 0
    for length in lengths:
        last = runs[-1] if runs else None
        if last is not None and last.length == length:
            runs[-1] = _Run(last.start, last.sequences + 1, length)
        else:
            runs.append(_Run(start, 1, length))
        start += length
    return tuple(r for r in runs if r.length > 0)


MASK_CACHE_ELEMENTS = 1 << 20
"""Masks up to this many elements (1 MiB as bool) are kept (`dense_mask`); longer sequences
build theirs per batch, so the cache stays within 64 MiB."""


@functools.lru_cache(maxsize=64)
def _kept_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    return _dense_mask(spec, length, device)


def dense_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """`_masks.dense_mask`, kept per spec, length and device for sequences up to
    `MASK_CACHE_ELEMENTS` cells: a batch of short sequences (queries) builds no mask, and SDPA
    only reads it."""
    heads = spec.num_heads if spec.alibi is not None else 1
    if length * length * heads <= MASK_CACHE_ELEMENTS:
        return _kept_mask(spec, length, device)
    return _dense_mask(spec, length, device)


CALL_COST = {"cpu": 1 << 18, "cuda": 1 << 22}
"""One more SDPA call, in units of ``H * D`` times score cells: what padding may add to a group
before a separate call is cheaper (a launch on a GPU buys far more arithmetic than on a CPU)."""


@dataclass(frozen=True, eq=False)
class _Group:
    """Sequences padded to ``length`` and run as one ``[n, L, H, D]`` SDPA call."""

    gather: torch.Tensor
    """``[n * L]`` int64 rows of the packed input, sequence by sequence; a padded slot repeats
    its sequence's last row (a key it hides, a query whose output is dropped)."""
    mask: torch.Tensor
    """SDPA's ``attn_mask`` over ``[n, H or 1, L, L]``: the spec's mask and the padded keys."""
    count: int
    length: int


@dataclass(frozen=True, eq=False)
class SdpaPlan:
    """The batch's runs or groups, and the explicit mask of each run length when the spec
    needs one."""

    runs: tuple[_Run, ...]
    masks: dict[int, torch.Tensor]
    """Length -> mask for SDPA's ``attn_mask``; empty when ``is_causal`` says it all. With
    sinks: float32 additive ``[H or 1, L, L]`` for every length (0 visible, -inf hidden)."""
    groups: tuple[_Group, ...] = ()
    """When not empty, the batch runs as these groups instead of ``runs``."""
    take: torch.Tensor | None = None
    """``[tokens]`` int64: where each packed row's output lies in the groups' outputs laid
    end to end (set with ``groups``)."""


def _group_members(lengths: tuple[int, ...], unit: int, call_cost: int) -> list[list[int]]:
    """Sequence indices by group (`_groups`' rule), longest sequences first."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            if (longest * longest - lengths[i] * lengths[i]) * unit <= call_cost:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _spec_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor | None:
    """The mask of one sequence of ``length`` (`dense_mask`; causal alone as a lower
    triangle), None when every key is visible."""
    if spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
        return dense_mask(spec, length, device)
    if spec.causal:
        return torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return None


HOST_INDEX_SLOTS = 1024
"""Padded slots up to which a plan writes its gather indices as host lists (a few µs plus
tens of ns per slot); beyond, a fixed dozen tensor ops build them (`_indices`)."""


def _groups(spec: AttentionSpec, params: FMHAParams) -> tuple[tuple[_Group, ...], torch.Tensor]:
    """The batch's groups, and where each packed row's output lands in their outputs laid
    end to end; a few tensor ops for the whole batch, none per group or token."""
    lengths = params.input_lengths
    device = params.device
    unit = spec.num_heads * spec.head_dim
    members = _group_members(lengths, unit, CALL_COST.get(device.type, CALL_COST["cuda"]))
    if len(members) == 1 and device.type == "cpu":
        # one group: the batch's own order, whose indices follow from the valid slots
        members = [sorted(members[0])]
        rows, valid_keys, take = _one_group_indices(members[0], lengths)
    else:
        rows, valid_keys, take = _indices(members, lengths, params.token_q_num, device)
    groups: list[_Group] = []
    offset = 0
    for group in members:
        count, length = len(group), max(lengths[i] for i in group)
        cells = slice(offset, offset + count * length)
        valid = valid_keys[cells].view(count, 1, 1, length)  # the padded keys hidden
        spec_mask = _spec_mask(spec, length, device)
        if spec_mask is None:
            mask = valid
        elif spec_mask.dtype == torch.bool:
            mask = spec_mask & valid
        else:  # additive (ALiBi): the padded keys get -inf too
            mask = spec_mask.masked_fill(~valid, float("-inf"))
        groups.append(_Group(rows[cells], mask, count, length))
        offset += count * length
    return tuple(groups), take


def _indices(
    members: list[list[int]], lengths: tuple[int, ...], tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the groups' slots laid end to end (each sequence padded to its group's length, in
    group order): the packed row each slot reads (a padded slot repeats its sequence's last
    row), whether it holds a real key, and each packed row's slot."""
    starts = list(itertools.accumulate(lengths, initial=0))
    order = [i for group in members for i in group]
    padded = [lengths[group[0]] for group in members for _ in group]
    slots = list(itertools.accumulate(padded, initial=0))
    if slots[-1] <= HOST_INDEX_SLOTS:
        gather: list[int] = []
        keys = bytearray()
        take = [0] * tokens
        for i, length in zip(order, padded, strict=True):
            first, size = starts[i], lengths[i]
            take[first : first + size] = range(len(gather), len(gather) + size)
            gather += range(first, first + size)
            gather += [first + size - 1] * (length - size)
            keys += b"\x01" * size + b"\x00" * (length - size)
        return (
            _host_tensor(array.array("q", gather), torch.int64, device),
            _host_tensor(keys, torch.bool, device),
            _host_tensor(array.array("q", take), torch.int64, device),
        )
    shift = [0] * len(lengths)  # slot minus packed row, per sequence
    for at, i in zip(slots, order, strict=False):
        shift[i] = at - starts[i]
    first, last, base, width = torch.tensor(
        [[starts[i] for i in order], [lengths[i] - 1 for i in order], slots[:-1], padded],
        dtype=torch.int64,
    ).to(device)
    seq = torch.repeat_interleave(width, output_size=slots[-1])  # each slot's sequence
    offset = torch.arange(slots[-1], device=device) - base[seq]
    last_of = last[seq]
    rows = first[seq] + torch.minimum(offset, last_of)
    per_row = torch.tensor([shift, list(lengths)], dtype=torch.int64).to(device)
    slot_of = torch.repeat_interleave(per_row[0], per_row[1], output_size=tokens)
    return rows, offset <= last_of, slot_of + torch.arange(tokens, device=device)


def _one_group_indices(
    group: list[int], lengths: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_indices` of a single group whose sequences keep the batch's order (on the CPU): the
    valid slots, in order, are the packed rows, so a slot reads the last valid row at or
    before it (a running count of them) and each row's slot is the next valid one; three
    tensor ops over one host buffer of the slots' flags, no per-slot Python."""
    length = max(lengths[i] for i in group)
    keys = bytearray()
    for i in group:
        keys += b"\x01" * lengths[i] + b"\x00" * (length - lengths[i])
    valid = torch.frombuffer(keys, dtype=torch.bool)
    return valid.cumsum(0) - 1, valid, valid.nonzero().view(-1)


def _host_tensor(
    values: array.array[int] | bytearray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host buffer as a tensor on ``device``, read in place (``torch.tensor`` on a list
    converts element by element, several times slower)."""
    host = torch.frombuffer(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device)


class TorchSdpaBackend(PrefillBackend):
    name = "torch-sdpa"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        features=(WindowSupport(), AlibiSupport(), ChunkSupport(), SinkSupport()),
    )

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> SdpaPlan:
        runs = _runs(params.input_lengths)
        if len(runs) > 1 and not spec.attention_sinks:
            groups, take = _groups(spec, params)
            return SdpaPlan(runs, {}, groups, take)
        masks: dict[int, torch.Tensor] = {}
        if spec.attention_sinks:
            for length in sorted({run.length for run in runs}):
                masks[length] = _additive_mask(spec, length, params.device)
        elif spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
            for length in sorted({run.length for run in runs}):
                masks[length] = dense_mask(spec, length, params.device)
        return SdpaPlan(runs, masks)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        spec = plan.spec
        kernel = plan.kernel
        if not isinstance(kernel, SdpaPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        batch = views.batch
        if batch is not None and len(kernel.runs) == 1:  # one run: n sequences of one length
            return _attend_batch(spec, kernel.masks.get(kernel.runs[0].length), batch, views.sinks)
        q, k, v = views.q, views.k, views.v
        if kernel.groups and kernel.take is not None:
            return _attend_groups(spec, kernel.groups, kernel.take, q, k, v)
        if len(kernel.runs) == 1 and views.sinks is None:
            return _attend_whole(spec, kernel.runs[0], kernel.masks, q, k, v)
        out = torch.empty(q.shape, dtype=spec.output_dtype, device=q.device)
        for run in kernel.runs:
            mask = kernel.masks.get(run.length)
            rows = slice(run.start, run.start + run.sequences * run.length)
            n, length = run.sequences, run.length
            run_views = (
                _run_view(q[rows], n, length),
                _run_view(k[rows], n, length),
                _run_view(v[rows], n, length),
            )
            result = _sdpa(spec, mask, run_views, views.sinks)
            out[rows].view(n, length, *out.shape[1:]).copy_(result.transpose(1, 2))
        return out


def _attend_whole(
    spec: AttentionSpec,
    run: _Run,
    masks: dict[int, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """A batch of one run (one sequence, or sequences of one length) as one SDPA call on
    batch-major views of the rows (`_attend_batch`)."""
    n, length = run.sequences, run.length
    views = (_run_view(q, n, length), _run_view(k, n, length), _run_view(v, n, length))
    return _attend_batch(spec, masks.get(length), views, None)


def _attend_batch(
    spec: AttentionSpec,
    mask: torch.Tensor | None,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Batch-major input (``[n, H, L, D]`` each, one run): SDPA on the tensors as given, the
    layout it takes; its output as rows, a view for one sequence (the caller copies if it
    must), else one copy."""
    result = _sdpa(spec, mask, batch, sinks)
    if result.dtype != spec.output_dtype:
        result = result.to(spec.output_dtype)
    count, heads, length, dim = result.shape
    if count == 1:  # one sequence: its rows are a view, and the caller copies if it must
        _, s_head, s_token, s_dim = result.stride()
        return result.as_strided((length, heads, dim), (s_token, s_head, s_dim))
    return result.transpose(1, 2).reshape(-1, heads, dim)


def _sdpa(
    spec: AttentionSpec,
    mask: torch.Tensor | None,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One run's attention on batch-major ``[n, H, L, D]`` tensors, ``[n, Hq, L, D]`` out:
    SDPA with the run's mask (or the causal flag where it has none), or the sinks' form."""
    q, k, v = batch
    if sinks is not None:
        assert mask is not None  # built for every length of a spec with sinks
        return _attend_with_sinks(spec, q, k, v, mask, sinks)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=spec.causal and mask is None,
        scale=spec.scale,
        enable_gqa=spec.is_gqa,
    )


def _run_view(x: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Rows ``x [count * length, H, D]`` as ``[count, H, length, D]``: one strided view."""
    rows, heads, dim = x.stride()
    return x.as_strided(
        (count, x.shape[1], length, x.shape[2]),
        (length * rows, heads, rows, dim),
        x.storage_offset(),
    )


def _padded(x: torch.Tensor, group: _Group) -> torch.Tensor:
    """The group's rows of ``x [T, H, D]`` gathered to ``[n, H, L, D]``."""
    rows = x.index_select(0, group.gather)
    return rows.view(group.count, group.length, *x.shape[1:]).transpose(1, 2)


def _attend_groups(
    spec: AttentionSpec,
    groups: tuple[_Group, ...],
    take: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """Each group as one SDPA call on its gathered rows; the valid rows taken back in order."""
    outputs = []
    for group in groups:
        result = F.scaled_dot_product_attention(
            _padded(q, group),
            _padded(k, group),
            _padded(v, group),
            attn_mask=group.mask,
            scale=spec.scale,
            enable_gqa=spec.is_gqa,
        )
        outputs.append(result.transpose(1, 2).reshape(group.count * group.length, *q.shape[1:]))
    flat = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return flat.index_select(0, take).to(spec.output_dtype)


def _additive_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """float32 additive ``[H or 1, L, L]`` of one sequence: 0 where visible (plus the ALiBi
    bias), -inf where hidden; the same `dense_mask` terms, or the causal rule alone."""
    if spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
        mask = dense_mask(spec, length, device)
    else:
        idx = torch.arange(length, device=device)
        mask = idx[None, :] <= idx[:, None] if spec.causal else idx[None, :] >= 0
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        mask = zeros.masked_fill(~mask, float("-inf"))
    mask = mask.float()
    return mask if mask.dim() == 3 else mask[None]


def _attend_with_sinks(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``[n, Hq, L, D]`` attention with one sink key per sequence (see the module), float32."""
    n, heads, length, _ = q.shape
    f32 = torch.float32
    zero = k.new_zeros(n, k.shape[1], 1, k.shape[3], dtype=f32)
    k = torch.cat((k.to(f32), zero), dim=2)
    v = torch.cat((v.to(f32), zero), dim=2)
    column = sinks.to(f32)[:, None, None].expand(heads, length, 1)
    bias = torch.cat((mask.expand(heads, length, length), column), dim=-1)
    out = F.scaled_dot_product_attention(
        q.to(f32), k, v, attn_mask=bias, scale=spec.scale, enable_gqa=spec.is_gqa
    )
    return out.to(spec.output_dtype)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TorchSdpaBackend])
