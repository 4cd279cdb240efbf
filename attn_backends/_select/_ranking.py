"""The ranking table: which built-in backend is tried first, per platform, read top to bottom.

Selection walks the rows of the request's platform in order; a row whose condition holds puts
its backend next in line (a backend's first such row is its place), and the first backend in
line whose ``supports`` is empty wins. The conditions are what the measurements split on: the
CUDA architecture, whether the spec's RoPE is one a fused-RoPE kernel computes, and whether a
window or ALiBi has to be evaluated per block. A backend no row names (``fa4``, ``headwise``)
runs only when chosen by name.

A third-party backend stands where its plugin's `Placement` puts it: right before or right after a
backend placed here, and only for the requests that backend is placed for, so it never takes
over specs nobody asked it to serve. ``attn-backends explain`` prints the row that decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._values._platform import Platform, PlatformKind
from .._values._spec import AttentionSpec, kernel_rope_fusable, spec_masked
from ._hooks import Placement
from ._registry import BackendEntry


@dataclass(frozen=True)
class Row:
    """One place in the table: ``backend`` on ``platform`` when the condition holds.

    ``None`` conditions hold for every spec; ``why`` is the measurement or policy behind it.
    """

    backend: str
    platform: PlatformKind
    why: str
    min_sm: int | None = None
    max_sm: int | None = None
    rope_fusable: bool | None = None
    """Only specs whose RoPE a fused-RoPE kernel computes (True), or only the others (False)."""
    masked: bool | None = None
    """Only specs with a sliding window or ALiBi (True), or only the others (False)."""

    def holds(self, spec: AttentionSpec, platform: Platform) -> bool:
        if platform.kind != self.platform:
            return False
        sm = platform.sm
        if self.min_sm is not None and (sm is None or sm < self.min_sm):
            return False
        if self.max_sm is not None and (sm is None or sm > self.max_sm):
            return False
        if self.rope_fusable is not None and kernel_rope_fusable(spec) != self.rope_fusable:
            return False
        return self.masked is None or spec_masked(spec) == self.masked

    def condition(self) -> str:
        parts: list[str] = [self.platform]
        if self.min_sm is not None or self.max_sm is not None:
            low = f"sm{self.min_sm}" if self.min_sm is not None else ""
            high = f"sm{self.max_sm}" if self.max_sm is not None else ""
            parts.append(low if low == high else f"{low}..{high}")
        if self.rope_fusable is not None:
            parts.append("fusable RoPE" if self.rope_fusable else "no fusable RoPE")
        if self.masked is not None:
            parts.append("window or ALiBi" if self.masked else "no window, no ALiBi")
        return " ".join(parts)


RANKING: tuple[Row, ...] = (
    # --- NVIDIA -------------------------------------------------------------------------------
    Row(
        "flashinfer-rope",
        "cuda",
        "fa3 with RoPE fused on short batches, the separate pass on long ones: short 256x64 "
        "0.096 vs 0.181 ms, Qwen3-Embedding 0.596 vs 0.613 ms (H200, docs/bench, 2026-11-30)",
        min_sm=90,
        max_sm=90,
        rope_fusable=True,
    ),
    Row(
        "flashinfer",
        "cuda",
        "fastest measured wherever RoPE is not fused: BERT-base 0.081 ms, BGE-M3 0.110 ms, "
        "Qwen3-Embedding's attention 0.465 ms (H200, docs/bench, 2026-11-30)",
        min_sm=80,
    ),
    Row(
        "trt",
        "cuda",
        "below flashinfer: fa3 on views was faster on BERT-base (0.081 vs 0.088 ms) and BGE-M3 "
        "(0.111 vs 0.128 ms), the MHA shapes trt serves (H200, 2026-11-30)",
        min_sm=90,
        max_sm=90,
    ),
    Row(
        "flashinfer-rope",
        "cuda",
        "below flashinfer: fusing not measured off Hopper, and nothing to fuse here",
        min_sm=80,
    ),
    Row(
        "torch-varlen",
        "cuda",
        "36x torch-sdpa on BGE-M3's 64 texts of 16..512, 2.5x on Qwen3-Embedding's 32 of "
        "64..2048; flashinfer 1.5-2.7x faster on the same workloads (H200, "
        "benchmarks/attention_tflops.py, 2026-12-03)",
        min_sm=80,
    ),
    Row(
        "flex",
        "cuda",
        "5-11x torch-sdpa on windowed and ALiBi specs (H200, benchmarks/gpu/feature_backends.py)",
        min_sm=80,
        masked=True,
    ),
    Row("torch-sdpa", "cuda", "last resort: runs every spec it declares"),
    Row(
        "flex",
        "cuda",
        "policy, not measured: serves the soft-capped specs the others refuse (float32, or "
        "flashinfer not installed)",
        min_sm=80,
    ),
    # --- AMD ----------------------------------------------------------------------------------
    Row("aiter-asm", "rocm", "policy: aiter's ASM kernels first where they apply"),
    Row("aiter-nonasm", "rocm", "policy: aiter's CK kernels before the torch fallback"),
    Row("torch-sdpa", "rocm", "last resort"),
    # --- CPU ----------------------------------------------------------------------------------
    Row("torch-sdpa", "cpu", "the default on CPU"),
    Row(
        "flex",
        "cpu",
        "policy, not measured: serves what SDPA cannot express (soft-capping)",
    ),
)


@dataclass(frozen=True)
class Place:
    """A backend's place in line for one request, and what put it there."""

    entry: BackendEntry
    by: str
    """The table row (``row 2: flashinfer on cuda sm80.. (why)``) or the plugin's `Placement`."""
    placement: Placement | None = None


def _row_text(n: int, row: Row) -> str:
    return f"row {n}: {row.backend} on {row.condition()} ({row.why})"


def _by_table(
    spec: AttentionSpec, platform: Platform, entries: dict[str, BackendEntry]
) -> list[Place]:
    line: list[Place] = []
    for n, row in enumerate(RANKING, start=1):
        entry = entries.get(row.backend)
        if entry is None or any(p.entry is entry for p in line):
            continue
        if row.holds(spec, platform):
            line.append(Place(entry, _row_text(n, row)))
    return line


def _placed(line: list[Place], entry: BackendEntry, placement: Placement) -> bool:
    """Put ``entry`` next to the backend ``placement`` names; False when that one is not in
    line. Several placed after one backend keep their registration order."""
    at = next((i for i, p in enumerate(line) if p.entry.name == placement.anchor), None)
    if at is None:
        return False
    if placement.after is not None:
        at += 1
        while at < len(line) and _after(line[at], placement.after):
            at += 1
    line.insert(at, Place(entry, f"plugin placement: {placement.describe()}", placement))
    return True


def _after(place: Place, anchor: str) -> bool:
    return place.placement is not None and place.placement.after == anchor


def ranked(spec: AttentionSpec, platform: Platform, entries: Sequence[BackendEntry]) -> list[Place]:
    """The backends in the order selection tries them for ``spec`` on ``platform``.

    Built-in backends by the table; then each plugin's `Placement` (in registration order) whose
    platform fits, next to the backend it names, if that one is in line. A backend with no
    place here runs only when chosen by name.
    """
    by_name = {e.name: e for e in entries}
    line = _by_table(spec, platform, by_name)
    for entry in entries:
        if entry.builtin or any(p.entry is entry for p in line):
            continue
        for placement in entry.placements:
            if placement.platform in (None, platform.kind) and _placed(line, entry, placement):
                break
    return line


def unplaced_reason(entry: BackendEntry, platform: Platform) -> str:
    """Why ``entry`` has no place for this request (the text of its ``not ranked`` verdict)."""
    fitting = [r for r in entry.placements if r.platform in (None, platform.kind)]
    if fitting:
        anchors = " or ".join(sorted({r.anchor for r in fitting}))
        return (
            f"placed next to {anchors}, which is not in line for this request on {platform}; "
            "chosen only when named"
        )
    return (
        f"no row of the ranking table nor a plugin placement for {platform}; chosen only when named"
    )
