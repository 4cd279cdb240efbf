"""What the model's own attention mask allows, checked against what attn_backends will compute.

transformers builds a layer's mask from a ``mask_function(batch, head, q_idx, kv_idx)`` that can
say more than padding and causality: a window, chunks, packed-sequence ids, a remapping of
indices to positions, custom ``and_mask_function``/``or_mask_function`` overlays. Rather than
recognising the kinds known today, the mask hook records the function it was handed (with the
padding and the index ranges) and the attention function evaluates it, once per batch and
per distinct (layout, causal flag, window, chunk), on the index grid of the batch with
transformers' own ``sdpa_mask``, and compares it with the mask that the spec and the layout
imply. A difference anywhere a valid query looks is refused with `MaskMismatchError`; a new
kind of mask cannot slip past, it can only be refused.

What attn_backends computes for a layout (``BatchLayout``):

- rows of one sequence (padding anywhere, or none): the row's valid tokens, in order, form the
  sequence; the causal rule, the window and the chunks count *valid tokens*, not columns (so a
  masked token between valid ones is not counted; transformers counts columns, from the first
  valid one for chunks, hence a hole under a window or chunks differs and is refused);
- rows packed with several sequences: each ``(row, start, stop)`` is its own sequence. Only
  the diagonal blocks are compared (the packing is the caller's intent: transformers'
  bidirectional masks ignore it), plus, on causal layers, the column just before each
  sequence: transformers marks restarting ``position_ids`` as separate sequences there, and
  when it does not (a KV cache, positions that do not restart) the model means one sequence.

The cost is what transformers' sdpa path pays for its own mask (rows x seq x seq booleans for
a padded batch, the sum of squared lengths for a packed one), evaluated in tiles, once per
forward and mask kind, not per layer. A mask built only from functions recognised to broadcast
(`_hf_mask_kinds`: transformers' own primitives) is evaluated by plain broadcasting, exactly;
one with a function of the model's own goes through vmap, which costs milliseconds of host
time per evaluation whatever its size, so packed sequences of similar length share one
(`hook_blocks`), and tiles are larger on a CUDA device than on a CPU (`tile_elements`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._values._errors import IntegrationError, MaskMismatchError
from .._values._spec import AttentionSpec
from . import _hf_mask_kinds, _layout
from ._layout import BatchLayout

__all__ = [
    "MaskGuard",
    "MaskRequest",
    "ModelBlocks",
    "ModelMask",
    "check_mask",
    "guard",
    "hook_blocks",
    "layout_of_4d",
    "mask_4d_is_causal",
    "newest_serial",
    "record",
    "request_of",
    "splits_rows",
]

ModelMask = Callable[[int, int, int, int, int], torch.Tensor]
"""``(rows, q_start, q_len, kv_start, kv_len)`` -> bool ``[rows, q_len, kv_len]``: what the
model's mask allows on that index grid, for batch rows ``0 .. rows - 1``."""

TILE_ELEMENTS = 1 << 22
"""Mask cells evaluated at once on a CPU (where an evaluation costs its cells); bounds the
memory of a check on a long batch."""
CUDA_TILE_ELEMENTS = 1 << 27
"""The most on a CUDA device, where an evaluation costs about 10 ms of host time whatever its
size (H200: 4 Mi and 128 Mi cells alike through transformers' vmap path), so fewer, larger
tiles decide the check's cost: 2^25-cell tiles made an EmbeddingGemma-sized packed forward
0.98x the padded sdpa path, 2^27-cell tiles 1.76x."""
CELL_BYTES = 17
"""Device memory one cell holds at the peak of an evaluation (H200, transformers' vmap path:
68 MiB for 4 Mi cells, 2.1 GiB for 128 Mi)."""


ModelBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
"""``(rows, starts, stops, q_len, lead)`` -> bool ``[blocks, q_len, lead + q_len]``: block
``g``'s cell ``(i, j)`` is what the model's mask allows query column ``starts[g] + i`` of batch
row ``rows[g]`` against key column ``starts[g] - lead + j``; cells at or beyond ``stops[g]``
(and before column 0) are not read and may hold anything. The packed sequences' blocks, in
one evaluation."""


def tile_elements(device: torch.device) -> int:
    """Mask cells one evaluation of the model's mask may cover on ``device``: on CUDA up to
    `CUDA_TILE_ELEMENTS`, and at most what a quarter of the memory left (free, plus what the
    caching allocator holds unused) can hold; `TILE_ELEMENTS` elsewhere."""
    if device.type != "cuda":
        return TILE_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    spare = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(TILE_ELEMENTS, min(CUDA_TILE_ELEMENTS, spare // (4 * CELL_BYTES)))


@dataclass(eq=False)
class MaskRequest:
    """One call of the mask hook: enough to evaluate the model's own mask, and what one forward
    derives from it (layouts, checks passed, backend selections), dropped with the forward."""

    model: str
    batch: int
    length: int
    device: torch.device
    padding: torch.Tensor | None
    """``[batch, length]`` bool copy of the padding mask; None when every token is valid."""
    evaluate: ModelMask | None = None
    """The model's mask as an evaluator, when given; else made from ``function`` on first use
    (`model_mask`): a batch of a proved class never evaluates it, so it is not built."""
    blocks: ModelBlocks | None = None
    """The same mask over packed sequences' blocks, in one evaluation (`hook_blocks`); made
    from ``function`` on first use (`model_blocks`) when not given."""
    function: Callable[..., Any] | None = None
    """The ``mask_function`` transformers handed the hook; None when the hook was called
    without one (not by transformers): the padding alone is then the mask."""
    use_vmap: bool = False
    """transformers asked for vmap (a function of the model's own in the tree); taken only
    where the tree is not recognised to broadcast (`_hf_mask_kinds.broadcastable`)."""
    chunk_size: int | None = None
    """The chunk of a chunked mask (``attention_chunk_size``): the spec's ``chunk_size`` for
    every layer handed this mask."""
    mask_given: bool = False
    """The model handed the hook a 2-D mask (all ones counts): transformers then never reads
    restarting ``position_ids`` as packed sequences."""
    attention_layers: int | None = None
    """Attention calls one forward makes at least (`_hf_models.attention_layers`): a packed
    row read by fewer was mixed across its boundaries by the other layers."""
    mixers: tuple[str, ...] = ()
    """The model's token mixers outside attention (`_hf_models.token_mixers_outside_attention`):
    packed rows are refused for them."""
    serial: int = 0
    """Order of the hook calls (`record`): the requests of one forward are all made before its
    first attention call, so a higher serial than any seen at that call starts a new forward."""
    layouts: dict[Hashable, tuple[object, BatchLayout]] = field(default_factory=dict)
    """Per layout source: the source object (kept alive, so its id stays its own) and the
    layout."""
    proof: tuple[object, ...] | None = None
    """The mask function as a value (`_hf_mask_kinds.proof_signature`) when it is built from
    shift-free primitives, else None: a check passed for it holds for every batch of the same
    class (`transformers._mask_proof`)."""
    packed_ids: tuple[tuple[str, Any], ...] = ()
    """The tensors the function reads (`_hf_mask_kinds.Data`: packed-sequence ids, remapped
    positions), checked against each batch's layout."""
    checked: set[Hashable] = field(default_factory=set)
    lanes: dict[Hashable, Any] = field(default_factory=dict)
    """The attention calls of this forward resolved so far, by call key
    (`transformers._Lane`): the layers after the first of a class reuse its resolution."""
    epoch: tuple[object, ...] | None = None
    """`decision_epoch` when the hook ran: the attention calls of this forward reuse the
    selections their modules keep while it holds (None: each call reads it)."""
    _causal: list[bool] = field(default_factory=list)
    """The probe's answer, once per forward (`mask_is_causal`)."""

    @property
    def has_mask(self) -> bool:
        """Whether the model handed a mask to check against (else the padding is the mask)."""
        return self.evaluate is not None or self.function is not None

    def model_mask(self) -> ModelMask | None:
        """The model's mask as an evaluator (`hook_mask`), made on first use."""
        if self.evaluate is None and self.function is not None:
            self.evaluate = hook_mask(self.function, self.padding, self._vmap(), self.device)
        return self.evaluate

    def model_blocks(self) -> ModelBlocks | None:
        """The model's mask over packed sequences' blocks (`hook_blocks`), made on first use."""
        if self.blocks is None and self.function is not None:
            self.blocks = hook_blocks(self.function, self.padding, self._vmap(), self.device)
        return self.blocks

    def _vmap(self) -> bool:
        return self.use_vmap and not _hf_mask_kinds.broadcastable(self.function)

    def mask_is_causal(self) -> bool | None:
        """Whether the model's own mask hides a later token from an earlier one: the first
        two valid tokens of a row are probed (one cell; causal and bidirectional masks
        differ there, windows do not). None when the mask is unknown or no row has two
        valid tokens. For layers that declare no causal flag: the mask is their rule."""
        evaluate = self.model_mask()
        if evaluate is None:
            return None
        if not self._causal:
            probe = self._probe_cell()
            if probe is None:
                return None
            row, first, second = probe
            # a function of shift-free primitives reading no data answers a cell by the
            # distance of its tokens alone: the answer is a value of (signature, distance)
            memo = (self.proof, second - first) if self.proof and not self.packed_ids else None
            known = _causal_by_proof.get(memo) if memo is not None else None
            if known is None:
                known = not bool(evaluate(row + 1, first, 1, second, 1)[row, 0, 0])
                if memo is not None:
                    with _causal_lock:
                        if len(_causal_by_proof) >= _PROOFS_KEPT:
                            _causal_by_proof.clear()
                        _causal_by_proof[memo] = known
            self._causal.append(known)
        return self._causal[0]

    def _probe_cell(self) -> tuple[int, int, int] | None:
        """``(row, first, second)``: the first row with two valid tokens and their columns."""
        if self.padding is None:
            return (0, 0, 1) if self.length >= 2 else None
        rows = (self.padding.sum(dim=1) >= 2).nonzero().reshape(-1)
        if rows.numel() == 0:
            return None
        row = int(rows[0])
        first, second = (int(c) for c in self.padding[row].nonzero().reshape(-1)[:2].tolist())
        return row, first, second


_PROOFS_KEPT = 256
_causal_by_proof: dict[tuple[object, ...], bool] = {}
"""`MaskRequest.mask_is_causal` by mask signature and probed distance, for signatures that
read no data: a pure function of the two (code objects, constants, and ``k - q``), so the
probe runs once per kind of mask, not once per forward."""


_causal_lock = threading.Lock()
"""Guards `_causal_by_proof`'s trim and store."""


class MaskGuard(torch.Tensor):
    """What the mask hook hands the model: a placeholder meant for the registered attention
    function only, which finds its `MaskRequest` by identity and never reads its values.

    Some models read the mask themselves before attention (a dynamic mask, a sparse-attention
    indexer that selects keys from it, a slice to the key length) and expect transformers'
    4-D mask there. Any torch operation on the placeholder (reading its dtype or shape, an
    index, arithmetic) raises `IntegrationError` naming the model, so such a model is refused
    at its first use of the mask instead of crashing or misreading it. Passing it along
    (arguments, dicts, ``is None``), ``repr``, ``.device`` and a ``.to()`` that changes
    nothing are allowed: that is transformers' plumbing between the hook and the layers.

    The guard carries its `MaskRequest` (`record`), so the attention function finds the
    forward's request on the tensor it is handed, per call: nothing of it lives in a module
    global that another thread's forward could change.
    """

    _model: str
    _request: MaskRequest | None = None

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            if any(func == allowed for allowed in _GUARD_HARMLESS):
                return func(*args, **(kwargs or {}))
            if func is torch.Tensor.to and args and isinstance(args[0], MaskGuard):
                moved = func(*args, **(kwargs or {}))
                if moved is args[0]:  # a no-op: same device, dtype and layout
                    return moved
        guard = next((a for a in args if isinstance(a, MaskGuard)), None)
        model = guard._model if guard is not None else "the model"
        what = _operation(func)
        raise IntegrationError(
            f"{model} reads its attention mask outside the attention function ({what}: "
            "a dynamic mask, or a sparse-attention indexer that selects keys from it); "
            "attn_backends hands the layers a placeholder that only its "
            "attention function reads, so it cannot serve this model. Load it with "
            "attn_implementation='sdpa' or 'eager'"
        )


def _operation(func: Callable[..., Any]) -> str:
    """``mask.dtype``, ``mask.__getitem__()``: the operation, for the message."""
    # untyped: any callable torch dispatches; a property read is its descriptor's __get__
    name = str(getattr(func, "__name__", func))
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None:
        return f"mask.{getattr(owner, '__name__', owner)}"
    return f"mask.{name}()"


_GUARD_HARMLESS: tuple[object, ...] = (
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.device.__get__,
)


def guard(token: torch.Tensor, model: str) -> MaskGuard:
    """``token`` as a `MaskGuard` for ``model`` (same storage, no copy)."""
    guarded = token.as_subclass(MaskGuard)
    guarded._model = model
    return guarded


_serials = itertools.count(1)
_newest = [0]


def newest_serial() -> int:
    """The serial of the latest request recorded."""
    return _newest[0]


_serial_lock = threading.Lock()


def record(token: MaskGuard, request: MaskRequest) -> MaskGuard:
    """Tie ``request`` to the guard the hook returns: it lives as long as that tensor."""
    with _serial_lock:  # serial and newest together: `newest_serial` never goes back
        request.serial = _newest[0] = next(_serials)
    token._request = request
    return token


def request_of(mask: object) -> MaskRequest | None:
    """The request behind a mask the hook returned, or None for any other object."""
    return mask._request if type(mask) is MaskGuard else None


def _sdpa_grid(
    mask_function: Callable[..., Any],
    padding: torch.Tensor | None,
    use_vmap: bool,
    device: torch.device,
    rows: int,
    q_len: int,
    kv_len: int,
    q_start: int = 0,
    kv_start: int = 0,
) -> torch.Tensor:
    """bool ``[rows, q_len, kv_len]``: transformers' ``sdpa_mask`` (the path its sdpa and
    eager attention take) with every shortcut that skips the mask switched off."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(
        batch_size=rows,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=q_start,
        kv_offset=kv_start,
        mask_function=mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    return torch.as_tensor(mask).to(torch.bool)[:, 0].expand(rows, q_len, kv_len)


def hook_mask(
    mask_function: Callable[..., Any],
    padding: torch.Tensor | None,
    use_vmap: bool,
    device: torch.device,
) -> ModelMask:
    """The model's mask over an index grid, evaluated by transformers' ``sdpa_mask``."""

    def evaluate(rows: int, q_start: int, q_len: int, kv_start: int, kv_len: int) -> torch.Tensor:
        return _sdpa_grid(
            mask_function, padding, use_vmap, device, rows, q_len, kv_len, q_start, kv_start
        )

    return evaluate


def hook_blocks(
    mask_function: Callable[..., Any],
    padding: torch.Tensor | None,
    use_vmap: bool,
    device: torch.device,
) -> ModelBlocks:
    """The model's mask as `ModelBlocks`, evaluated by transformers' ``sdpa_mask`` like
    `hook_mask`: the batch index of that call picks a block, whose row and first query column
    shift the indices handed to the model's function (composed with the padding mask as
    ``sdpa_mask`` composes it). Indices past a block's end are held at its last column, so the
    function never reads beyond the batch."""
    from transformers.masking_utils import and_masks, padding_mask_function

    inner = (
        mask_function
        if padding is None
        else and_masks(mask_function, padding_mask_function(padding))
    )

    def evaluate(
        rows: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor, q_len: int, lead: int
    ) -> torch.Tensor:
        last = stops - 1

        def shifted(b: Any, h: Any, q: Any, kv: Any) -> Any:
            start, end = starts[b], last[b]
            keys = torch.clamp(torch.minimum(start - lead + kv, end), min=0)
            return inner(rows[b], h, torch.minimum(start + q, end), keys)

        return _sdpa_grid(shifted, None, use_vmap, device, rows.numel(), q_len, lead + q_len)

    return evaluate


def splits_rows(model: ModelMask, batch: int, length: int, chunk: int | None) -> bool:
    """Whether ``model``'s mask hides a token's left neighbour from it somewhere in rows
    without padding: then it splits the rows into sequences (packed input, sequence ids).
    Causal, bidirectional and sliding-window masks never do; a chunked mask does at each
    chunk start (positions that are multiples of ``chunk``), which is not counted. Evaluated
    in tiles along the diagonal: about ``batch x length x tile`` cells."""
    step = max(2, min(length, TILE_ELEMENTS // max(1, batch * length)))
    for q0 in range(1, length, step):
        q1 = min(length, q0 + step)
        allowed = model(batch, q0, q1 - q0, q0 - 1, q1 - q0 + 1)
        neighbour = allowed.diagonal(offset=0, dim1=-2, dim2=-1)  # key q - 1 for query q
        hidden = ~neighbour
        if chunk is not None and chunk > 0:
            positions = torch.arange(q0, q1, device=hidden.device)
            hidden = hidden & (positions % chunk != 0)
        if bool(hidden.any()):
            return True
    return False


@dataclass(frozen=True)
class Mismatch:
    """The first cell where the model's mask and attn_backends' disagree (columns of the
    batch's rows)."""

    row: int
    query: int
    key: int
    model_allows: bool


def _rule(qi: torch.Tensor, kj: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Which keys a query sees, by their indices within one sequence."""
    ok = torch.ones_like(qi - kj, dtype=torch.bool)
    if spec.causal:
        ok &= kj <= qi
    window = spec.window
    if window is not None:
        ok &= (qi - kj <= window.left) & (kj - qi <= window.right)
    chunk = spec.chunk_size
    if chunk is not None:
        ok &= torch.div(qi, chunk, rounding_mode="floor") == torch.div(
            kj, chunk, rounding_mode="floor"
        )
    return ok


def _first(diff: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in diff.nonzero()[0].tolist())


def _check_rows(model: ModelMask, layout: BatchLayout, spec: AttentionSpec) -> Mismatch | None:
    """Rows of one sequence each: every valid query row against every key column."""
    batch, seq = layout.batch, layout.seq
    device = layout.params.cu_seqlens_q.device
    valid = (
        layout.valid
        if layout.valid is not None
        else torch.ones(batch, seq, dtype=torch.bool, device=device)
    )
    index = valid.long().cumsum(1) - 1  # each valid token's index within its sequence
    step = max(1, tile_elements(device) // max(1, batch * seq))
    for q0 in range(0, seq, step):
        q1 = min(seq, q0 + step)
        allowed = model(batch, q0, q1 - q0, 0, seq).to(device)
        want = valid[:, None, :] & _rule(index[:, q0:q1, None], index[:, None, :], spec)
        diff = (allowed != want) & valid[:, q0:q1, None]
        if bool(diff.any()):
            row, q, k = _first(diff)
            return Mismatch(row, q0 + q, k, bool(allowed[row, q, k]))
    return None


@dataclass(frozen=True)
class _Tile:
    """Blocks of the model's mask, one per packed sequence (or part of one): block ``g``'s cell
    ``(i, j)`` is query column ``q_cols[g] + i`` and key column ``k_cols[g] + j`` of batch row
    ``rows[g]``. ``differs`` is where the model's mask and the spec's rule disagree, on the
    cells the check compares."""

    rows: tuple[int, ...]
    q_cols: tuple[int, ...]
    k_cols: tuple[int, ...]
    allowed: torch.Tensor
    differs: torch.Tensor

    def mismatch(self) -> Mismatch | None:
        if not bool(self.differs.any()):
            return None
        g, q, k = _first(self.differs)
        return Mismatch(
            self.rows[g], self.q_cols[g] + q, self.k_cols[g] + k, bool(self.allowed[g, q, k])
        )


def _segment_tiles(
    model: ModelMask, blocks: ModelBlocks, layout: BatchLayout, spec: AttentionSpec
) -> Iterator[_Tile]:
    """The packed sequences' diagonal blocks (with, on causal layers, the key just before
    each sequence, which the model must not let it see either), in as few evaluations of the
    model's mask as `tile_elements` allows.

    One evaluation costs a few milliseconds of host time whatever its size, so sequences of
    similar length are evaluated together, as the batch of one call (``blocks``); a sequence
    whose own block exceeds the tile is evaluated alone, in row tiles."""
    device = layout.params.cu_seqlens_q.device
    tile = tile_elements(device)
    lead = 1 if spec.causal else 0
    fits = [s for s in layout.segments if (s[2] - s[1]) * (s[2] - s[1] + lead) <= tile]
    for segment in layout.segments:
        if (segment[2] - segment[1]) * (segment[2] - segment[1] + lead) > tile:
            yield from _alone(model, layout, spec, tile, *segment)
    fits.sort(key=lambda s: s[2] - s[1], reverse=True)
    while fits:
        longest = fits[0][2] - fits[0][1]
        count = max(1, tile // (longest * (longest + lead)))
        group, fits = fits[:count], fits[count:]
        yield _stacked(blocks, spec, group, longest, lead, device)


def _stacked(
    blocks: ModelBlocks,
    spec: AttentionSpec,
    group: list[tuple[int, int, int]],
    longest: int,
    lead: int,
    device: torch.device,
) -> _Tile:
    """One evaluation for ``group``: each sequence's block, padded to ``longest`` queries and
    ``lead + longest`` keys; the padding cells (and a probe column before a row's first
    sequence) are not compared."""
    rows, starts, stops = torch.tensor(group, device=device).unbind(1)
    lengths = (stops - starts)[:, None, None]
    allowed = blocks(rows, starts, stops, longest, lead)
    queries = torch.arange(longest, device=device)[None, :, None]
    keys = torch.arange(-lead, longest, device=device)[None, None, :]
    first_key = torch.where(starts > 0, -lead, 0)[:, None, None]
    compared = (queries < lengths) & (keys < lengths) & (keys >= first_key)
    want = (keys >= 0) & _rule(queries, keys, spec)
    return _Tile(
        tuple(s[0] for s in group),
        tuple(s[1] for s in group),
        tuple(s[1] - lead for s in group),
        allowed,
        (allowed != want) & compared,
    )


def _alone(
    model: ModelMask,
    layout: BatchLayout,
    spec: AttentionSpec,
    tile: int,
    row: int,
    start: int,
    stop: int,
) -> Iterator[_Tile]:
    device = layout.params.cu_seqlens_q.device
    n = stop - start
    probe = 1 if spec.causal and start > 0 else 0
    keys = torch.arange(-probe, n, device=device)[None, :]
    step = max(1, tile // (n + probe))
    for q0 in range(0, n, step):
        q1 = min(n, q0 + step)
        allowed = model(row + 1, start + q0, q1 - q0, start - probe, n + probe)[row].to(device)
        queries = torch.arange(q0, q1, device=device)[:, None]
        want = (keys >= 0) & _rule(queries, keys, spec)
        yield _Tile((row,), (start + q0,), (start - probe,), allowed[None], (allowed != want)[None])


def _check_segments(
    model: ModelMask, blocks: ModelBlocks, layout: BatchLayout, spec: AttentionSpec
) -> Mismatch | None:
    """Packed rows: one host sync for the whole batch, a second pass only to locate a
    difference."""
    flags = [tile.differs.any() for tile in _segment_tiles(model, blocks, layout, spec)]
    if not bool(torch.stack(flags).any()):
        return None
    for tile in _segment_tiles(model, blocks, layout, spec):
        found = tile.mismatch()
        if found is not None:
            return found
    return None


def blocks_of(model: ModelMask) -> ModelBlocks:
    """`ModelBlocks` from a grid evaluator, one evaluation per block: for a mask without a
    batched form (a materialised one costs nothing to cut)."""

    def evaluate(
        rows: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor, q_len: int, lead: int
    ) -> torch.Tensor:
        out = torch.zeros(rows.numel(), q_len, lead + q_len, dtype=torch.bool, device=rows.device)
        spans = zip(rows.tolist(), starts.tolist(), stops.tolist(), strict=True)
        for g, (row, start, stop) in enumerate(spans):
            k0 = max(0, start - lead)
            col = k0 - (start - lead)
            got = model(row + 1, start, stop - start, k0, stop - k0)[row]
            out[g, : stop - start, col : col + stop - k0] = got.to(out.device)
        return out

    return evaluate


def check_mask(
    model: ModelMask,
    layout: BatchLayout,
    spec: AttentionSpec,
    *,
    model_name: str,
    layer: str,
    blocks: ModelBlocks | None = None,
) -> None:
    """Raise `MaskMismatchError` unless ``model``'s mask is what ``spec`` computes over
    ``layout`` wherever a valid query looks. ``blocks``: the same mask in batched form, for
    packed rows (default: one evaluation of ``model`` per sequence)."""
    if layout.segments:
        found = _check_segments(model, blocks or blocks_of(model), layout, spec)
    else:
        found = _check_rows(model, layout, spec)
    if found is not None:
        raise MaskMismatchError(_explain(found, layout, spec, model_name, layer))


def _has_hole(layout: BatchLayout, row: int) -> bool:
    if layout.valid is None:
        return False
    cols = layout.valid[row].nonzero().reshape(-1)
    return bool(cols.numel() > 0 and int(cols[-1]) - int(cols[0]) + 1 != cols.numel())


def _explain(
    found: Mismatch, layout: BatchLayout, spec: AttentionSpec, model_name: str, layer: str
) -> str:
    sees = "lets" if found.model_allows else "does not let"
    ours = "would" if not found.model_allows else "would not"
    window = f", window {spec.window.describe()}" if spec.window is not None else ""
    chunk = f", chunks of {spec.chunk_size}" if spec.chunk_size is not None else ""
    what = f"{'causal' if spec.causal else 'bidirectional'} attention{window}{chunk}"
    who = model_name if model_name == layer else f"{model_name} ({layer})"
    head = (
        f"{who}: its attention mask {sees} query column {found.query} of row "
        f"{found.row} see key column {found.key}; attn_backends {ours}, computing {what} "
        f"within each sequence of the batch"
    )
    segment_start = any(
        row == found.row and start == found.key + 1 for row, start, _ in layout.segments
    )
    if segment_start and found.model_allows:
        why = (
            "the model's mask reads the packed row as one sequence: a KV cache "
            "(use_cache=True), cu_seq_lens with position_ids that do not restart, or a model "
            "that does not hand its position_ids to its mask. Call the model with "
            "use_cache=False and position_ids that restart per sequence (pack_sequences "
            "returns them), or pass a padded batch"
        )
    elif (spec.window is not None or spec.chunk_size is not None) and _has_hole(layout, found.row):
        measured = "sliding window" if spec.window is not None else "chunks"
        why = (
            "the padding mask has a masked token between valid ones, and transformers measures "
            f"the {measured} over the row's columns while attn_backends measures them over the "
            "valid tokens. Pass each row's valid tokens contiguously (right or left padding)"
        )
    else:
        why = (
            "the model's mask carries a rule the spec does not express (a custom "
            "and_mask_function/or_mask_function, block or sequence ids, a per-head mask or "
            "another mask kind)"
        )
    return f"{head}. Here {why}, or load the model with attn_implementation='sdpa' or 'eager'."


# --- 4-D masks: passed by the caller, returned as they are by transformers -----------------


@dataclass(eq=False)
class _Mask4D:
    allowed: torch.Tensor
    layout: BatchLayout
    proof: tuple[object, ...] | None = None
    """The mask function as a value (`_hf_mask_kinds.proof_signature`) when it is built from
    shift-free primitives, else None: a check passed for it holds for every batch of the same
    class (`transformers._mask_proof`)."""
    packed_ids: tuple[tuple[str, Any], ...] = ()
    """The tensors the function reads (`_hf_mask_kinds.Data`: packed-sequence ids, remapped
    positions), checked against each batch's layout."""
    checked: set[Hashable] = field(default_factory=set)


class _State4D(threading.local):
    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[object, ...], _Mask4D] = OrderedDict()


_state_4d = _State4D()
_ENTRIES_4D = 4


def _allowed_of_4d(mask: torch.Tensor, model_name: str) -> torch.Tensor:
    """``[B, S, S]`` bool: what a ``[B, 1 or H, S, S]`` bool or additive mask allows; a
    ``[B, 1 or H, 1, S]`` mask (the extended padding mask BERT-style models build themselves)
    is the same for every query. An additive mask must be a mask: 0 where a key is seen, -inf
    or the dtype's most negative values where it is not; any other value is a bias."""
    if mask.dim() != 4 or mask.shape[-2] not in (1, mask.shape[-1]):
        raise IntegrationError(
            f"{model_name}: a 4-D attention mask must be [batch, 1 or heads, seq or 1, seq] "
            f"over the same queries and keys, got {tuple(mask.shape)}; pass the 2-D padding mask"
        )
    mask = mask.expand(*mask.shape[:2], mask.shape[-1], mask.shape[-1])
    if mask.dtype == torch.bool:
        allowed = mask
    elif not mask.dtype.is_floating_point:
        raise IntegrationError(
            f"{model_name}: a 4-D attention mask of dtype {mask.dtype}; attn_backends reads "
            "bool masks (True: seen) and additive float masks (0 or -inf); pass one of them"
        )
    else:
        allowed = mask == 0
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | hidden).all()):
            raise MaskMismatchError(
                f"{model_name}: the additive 4-D attention mask holds values other than 0 and "
                "-inf (or the dtype's minimum): a bias on the scores, which attn_backends does "
                "not add. Use attn_implementation='sdpa' or 'eager' for it"
            )
    if not bool((allowed == allowed[:, :1]).all()):
        raise MaskMismatchError(
            f"{model_name}: the 4-D attention mask differs between heads; attn_backends applies "
            "one mask to every head. Use attn_implementation='sdpa' for per-head masks"
        )
    return allowed[:, 0]


def mask_4d_is_causal(mask: torch.Tensor, model_name: str) -> bool | None:
    """Whether a 4-D mask hides the second valid token of a row from the first (see
    `MaskRequest.mask_is_causal`); None when no row has two valid tokens."""
    allowed = _allowed_of_4d(mask, model_name)
    valid = allowed.any(dim=-2)  # tokens as `layout_of_4d` reads them
    rows = (valid.sum(dim=1) >= 2).nonzero().reshape(-1)
    if rows.numel() == 0:
        return None
    row = int(rows[0])
    first, second = (int(c) for c in valid[row].nonzero().reshape(-1)[:2].tolist())
    return not bool(allowed[row, first, second])


def layout_of_4d(
    mask: torch.Tensor, spec: AttentionSpec, *, model_name: str, layer: str
) -> BatchLayout:
    """The layout of a 4-D mask, derived from its content and checked against ``spec``: a
    token is padding when no query may see it as a key (its whole column hidden), never from
    the diagonal alone, so a real token that a mask hides from itself stays a token, and the
    check refuses the mask. Cached by content, never by identity or version: a mask rewritten
    in place (inference tensors keep no version counter) is a new mask."""
    allowed = _allowed_of_4d(mask, model_name)
    key = (tuple(allowed.shape), allowed.device)
    entry = _state_4d.entries.get(key)
    if entry is None or not torch.equal(entry.allowed, allowed):
        valid = allowed.any(dim=-2)
        if not bool(valid.any()):
            raise IntegrationError(
                f"{model_name}: the 4-D attention mask lets no query see any key; pass a real batch"
            )
        entry = _Mask4D(allowed.clone(), _layout.from_padding_mask(valid))
        _state_4d.entries[key] = entry
        while len(_state_4d.entries) > _ENTRIES_4D:
            _state_4d.entries.popitem(last=False)
    _state_4d.entries.move_to_end(key)
    verdict = (spec.causal, spec.window, spec.chunk_size)
    if verdict not in entry.checked:
        frozen = entry.allowed

        def model(rows: int, q0: int, q_len: int, k0: int, k_len: int) -> torch.Tensor:
            return frozen[:rows, q0 : q0 + q_len, k0 : k0 + k_len]

        check_mask(model, entry.layout, spec, model_name=model_name, layer=layer)
        entry.checked.add(verdict)
    return entry.layout
