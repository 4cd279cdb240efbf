"""Serving embeddings: sentence-transformers padded vs packed, compiled buckets, graph runner.

Workloads: documents (64 texts of 16..512 tokens) and query batches (1, 8 and 32 queries of
8..40 tokens) through BGE-M3-, Qwen3-Embedding-0.6B-, ModernBERT- and EmbeddingGemma-sized
models with random weights (configs below, tokenizer built here: nothing is downloaded).

Paths, each checked against the first before it is timed (min cosine of the embeddings):

- ``st-padded-sdpa``: ``SentenceTransformer.encode`` on HF sdpa, the batches it really builds
  (sorted by length, padded to the longest): the padding they hold is reported;
- ``st-packed``: `attn_backends.integrations.sentence_transformers.load` (packed, this library),
  its shared layouts and plans dropped before every call, so each timed batch pays for its
  boundaries as a serving batch of new lengths does;
- ``st-packed-graphs``: sentence-transformers' tokenisation and pooling around `GraphRunner`
  (query batches only: one CUDA graph per bucket; on CPU eager bucketing);
- ``compile-padded-buckets``: ``torch.compile(model, mode="reduce-overhead")`` on HF sdpa with
  the batch padded to a bucket (rows and length rounded up to powers of two), CUDA only;
- ``st-flash-packed``: sentence-transformers' own packed path (it flattens the batch itself for
  a flash implementation) on ``flash_attention_4`` where flash-attn-4 imports, else on
  ``flash_attention_2`` where flash-attn 2 does (`flash_implementation`; the one used is in
  the path's ``extra``).

Per path: tokens/s (valid tokens over the median batch latency) and p50/p99 latency per batch
(one ``encode`` call of the whole workload, with sentence-transformers' default batch size of
`ST_BATCH` unless ``--batch-size`` says otherwise: it sorts the texts by length and pads each
batch to its longest), and each path's
time over ``st-padded-sdpa``'s (below 1: faster than what a user runs today). ``--dry`` runs tiny
models on short texts in seconds on CPU. ``--cpu-tiny`` runs the tiny models on CPU with the
serving workloads (1, 8 and 32 queries, 64 documents of 16..64 tokens) and profiles the
integration: host time per attention layer call beyond the kernel, split into the mask hook,
the attention hook around the backend, and the backend's path around its kernel.

    python3 benchmarks/serving_bench.py --out OUT [--models bge-m3,qwen3] [--repeats 30]
    python3 benchmarks/serving_bench.py --dry
    python3 benchmarks/serving_bench.py --cpu-tiny [--repeats 30]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

VOCAB_WORDS = 2000
ST_BATCH = 32
"""``SentenceTransformer.encode``'s default batch size: the batches a user's call builds."""
SPECIALS = ("<pad>", "<unk>", "<cls>", "<sep>")


@dataclass(frozen=True)
class ModelCase:
    config: Callable[[bool], Any]
    """``dry`` -> a transformers config."""
    pooling: str
    position_offset: int = 0
    padding_side: str = "right"


def _cases() -> dict[str, ModelCase]:
    import transformers as t

    vocab = VOCAB_WORDS + len(SPECIALS)

    def sized(dry: bool, full: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
        return {"vocab_size": vocab, **(tiny if dry else full)}

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    return {
        "bge-m3": ModelCase(
            lambda dry: t.XLMRobertaConfig(
                **sized(
                    dry,
                    {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24},
                    tiny,
                ),
                num_attention_heads=16 if not dry else 4,
                max_position_embeddings=8194,
                pad_token_id=0,
            ),
            "cls",
            position_offset=1,
        ),
        "qwen3": ModelCase(
            lambda dry: t.Qwen3Config(
                **sized(
                    dry,
                    {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28},
                    tiny,
                ),
                num_attention_heads=16 if not dry else 4,
                num_key_value_heads=8 if not dry else 2,
                head_dim=128 if not dry else 16,
                use_cache=False,
                pad_token_id=0,
            ),
            "lasttoken",
            padding_side="left",
        ),
        "modernbert": ModelCase(
            lambda dry: t.ModernBertConfig(
                **sized(
                    dry,
                    {"hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22},
                    tiny,
                ),
                num_attention_heads=12 if not dry else 4,
                local_attention=128 if not dry else 8,
                global_attn_every_n_layers=3 if not dry else 2,
                pad_token_id=0,
                cls_token_id=2,
                sep_token_id=3,
                bos_token_id=2,
                eos_token_id=3,
            ),
            "mean",
        ),
        "embeddinggemma": ModelCase(
            lambda dry: t.Gemma3TextConfig(
                **sized(
                    dry,
                    {"hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 24},
                    tiny,
                ),
                num_attention_heads=3 if not dry else 4,
                num_key_value_heads=1,
                head_dim=256 if not dry else 16,
                sliding_window=512 if not dry else 8,
                layer_types=(
                    ["sliding_attention"] * 5 + ["full_attention"]
                    if not dry
                    else ["sliding_attention", "full_attention"]
                )
                * (4 if not dry else 1),
                use_bidirectional_attention=True,
                use_cache=False,
                pad_token_id=0,
            ),
            "mean",
        ),
    }


def _tokenizer(case: ModelCase, max_length: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate((*SPECIALS, *[f"w{i}" for i in range(VOCAB_WORDS)]))}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<cls> $A <sep>",
        pair="<cls> $A <sep> $B <sep>",
        special_tokens=[("<cls>", 2), ("<sep>", 3)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
        padding_side=case.padding_side,
    )


def build_model(name: str, case: ModelCase, root: Path, dry: bool, max_length: int) -> Path:
    """Save a random-weight HF model, its tokenizer and a sentence-transformers model; return
    the sentence-transformers directory."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    hf, st = root / f"{name}-hf", root / f"{name}-st"
    config = case.config(dry)
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(hf)
    _tokenizer(case, max_length).save_pretrained(hf)
    model = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(config.hidden_size, case.pooling), Normalize()]
    )
    model.save(str(st))
    return st


def texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """``count`` texts of ``low..high`` tokens each (two of them are the special tokens)."""
    rng = random.Random(seed)
    return [
        " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(low, high) - 2))
        for _ in range(count)
    ]


@dataclass
class PathResult:
    path: str
    status: str = "ok"
    min_cosine: float | None = None
    tokens: int = 0
    padded_tokens: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> list[float]:
    fn()
    fn()  # warm-up (and, for graph paths, capture)
    return synchronised_ms(fn, repeats, device)


def synchronised_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn``, the device synchronised around
    each (what one request waits)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cosine_bound(dtype: torch.dtype) -> float:
    """The least cosine similarity to padded sdpa's embeddings a path's embeddings must reach
    per text in ``dtype`` before it is timed (bf16 rounds far more than float32)."""
    return 0.9999 if dtype == torch.float32 else 0.99


def min_cosine(got: object, want: object) -> float:
    """The smallest cosine similarity of two encodes' embeddings, text by text."""
    a, b = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    return float(torch.nn.functional.cosine_similarity(a, b).min())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class Paths:
    """The paths of one model, built once and reused by every workload."""

    def __init__(
        self,
        st_dir: Path,
        case: ModelCase,
        device: torch.device,
        dry: bool,
        batch_size: int = ST_BATCH,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        from attn_backends.integrations import sentence_transformers as abst

        self.device = device
        self.case = case
        self.batch_size = batch_size
        """Texts per sentence-transformers batch (``encode(batch_size=...)``) on every path."""
        kw: dict[str, Any] = {"device": str(device)}
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.dtype = dtype
        self.padded = SentenceTransformer(
            str(st_dir), model_kwargs={"attn_implementation": "sdpa", "dtype": dtype}, **kw
        )
        self.packed = abst.load(str(st_dir), model_kwargs={"dtype": dtype}, **kw)
        self.st_dir = st_dir
        self.dry = dry
        self._runner: Any = None
        self._compiled: Any = None
        self._flash: Any = None

    @contextlib.contextmanager
    def counting_cells(self) -> Iterator[list[tuple[int, int]]]:
        """The ``[rows, length]`` of each batch the padded model embeds meanwhile. The hook
        is removed on exit: left on the module, it would make ``torch.compile`` guard on the
        list and recompile on every call of the compiled baseline."""
        cells: list[tuple[int, int]] = []
        embed = self.padded[0].model.get_input_embeddings()
        handle = embed.register_forward_hook(
            lambda m, args, out: cells.append(tuple(args[0].shape))
        )
        try:
            yield cells
        finally:
            handle.remove()

    def runner(self) -> Any:
        from attn_backends import GraphBucket
        from attn_backends.integrations.graph_runner import GraphRunner

        if self._runner is None:
            hf = self.packed[0].model
            buckets = [
                GraphBucket(max_tokens=t, max_batch=b) for t, b in ((64, 4), (512, 16), (1536, 32))
            ]
            self._runner = GraphRunner(
                hf, buckets, position_offset=self.packed[0]._flatten_position_offset
            )
        return self._runner

    def encode_runner(self, batch: list[str]) -> torch.Tensor:
        """sentence-transformers' tokenisation (flattened) and pooling around the runner."""
        model = self.packed
        features = model[0].preprocess(batch)
        if "cu_seq_lens_q" not in features:  # one text is tokenised unflattened: one whole row
            tokens = int(features["input_ids"].shape[1])
            offset = model[0]._flatten_position_offset
            features["cu_seq_lens_q"] = torch.tensor([0, tokens], dtype=torch.int32)
            features["position_ids"] = torch.arange(offset, offset + tokens)[None]
        hidden = self.runner()(
            features["input_ids"].to(self.device),
            features["cu_seq_lens_q"].tolist(),
            features["position_ids"].to(self.device),
        )
        features = {
            "token_embeddings": hidden,
            "cu_seq_lens_q": features["cu_seq_lens_q"].to(self.device),
        }
        for module in list(model)[1:]:
            features = module(features)
        return features["sentence_embedding"]  # type: ignore[no-any-return]

    def encode_compiled(self, batch: list[str]) -> torch.Tensor:
        """HF sdpa under ``torch.compile(mode="reduce-overhead")``, on the batches
        sentence-transformers would build (longest first, ``batch_size`` texts each), each padded
        to a bucket; embeddings in the texts' order."""
        tokens: list[list[int]] = self.padded.tokenizer(batch, truncation=True)["input_ids"]
        order = sorted(range(len(batch)), key=lambda i: -len(tokens[i]))
        out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, row in zip(chunk, self._encode_bucket([tokens[i] for i in chunk]), strict=True):
                out[i] = row
        return torch.stack(out)

    def _encode_bucket(self, tokens: list[list[int]]) -> torch.Tensor:
        """One batch of token ids, padded to its bucket (rows and length rounded up to powers
        of two), through the compiled model and sentence-transformers' pooling."""
        model = self.padded
        if self._compiled is None:
            self._compiled = torch.compile(model[0].model, mode="reduce-overhead")
        tok = model.tokenizer
        n = len(tokens)
        rows = 1 << max(0, math.ceil(math.log2(n)))
        length = 1 << math.ceil(math.log2(max(len(x) for x in tokens)))
        # the tokenizer's own padding (its side, its mask), to the bucket's length
        enc = tok.pad(
            {"input_ids": tokens}, padding="max_length", max_length=length, return_tensors="pt"
        )
        ids = torch.full((rows, length), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, length, dtype=torch.long)
        ids[:n], mask[:n] = enc["input_ids"], enc["attention_mask"]
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():  # as encode runs: no autograd graph to compile or keep
            hidden = self._compiled(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
        features = {"token_embeddings": hidden[:n], "attention_mask": mask[:n]}
        for module in list(model)[1:]:
            features = module(features)
        return features["sentence_embedding"]  # type: ignore[no-any-return]

    def flash(self, implementation: str) -> Any:
        from sentence_transformers import SentenceTransformer

        if self._flash is None:
            self._flash = SentenceTransformer(
                str(self.st_dir),
                model_kwargs={"attn_implementation": implementation, "dtype": self.dtype},
                device=str(self.device),
            )
        return self._flash


def _timing(inner: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``inner``, adding the wall time (seconds) of each call to ``spent``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return timed


@contextlib.contextmanager
def _timed(owner: Any, attribute: str, spent: list[float]) -> Iterator[None]:
    """``owner.attribute`` timed into ``spent`` (`_timing`), restored on exit (a class
    attribute it inherited is inherited again)."""
    inner = getattr(owner, attribute)
    own = attribute in vars(owner)
    setattr(owner, attribute, _timing(inner, spent))
    try:
        yield
    finally:
        if own:
            setattr(owner, attribute, inner)
        else:
            delattr(owner, attribute)


def host_per_layer(paths: Paths, batch: list[str], encodes: int = 10) -> dict[str, float]:
    """The integration's host time per attention layer call beyond the kernel, for the packed
    path (CPU: the kernel's own time is its host time, so it is taken out): the mask hook, the
    attention hook minus the backend's contract path, and that path (``forward``, or the
    forward a lane bound to its input, `BoundForward`) minus the kernel call (``attend``),
    averaged over ``encodes`` encodes. The contract is timed where it starts
    (`ForwardPath.run`, `BoundForward.__call__`), not by wrapping the backend's ``forward``:
    a backend with a ``forward`` of its own is never bound, so that would time another path.

    Also how much of those encodes the check of the model's mask takes: the full check
    (`_hf_mask.check_mask`, transformers' mask function evaluated against the library's) and
    the per-forward comparison with the proof that lets later batches skip it
    (`_hf_proof.mask_proof` and `proved`), as calls per forward and shares of the encodes'
    wall time (synchronised at the end of each).

    The kernel call's own wall time per layer (``kernel_call``: the backend's ``attend``; on a
    GPU the host time that queues the kernel).

    And the host time beyond the kernel for two kinds of attention call apart: a call that
    resolves its lane (`transformers._resolve`: the layout, the proof, the plan; once per
    forward and class of call) and a call that reuses the lane an earlier layer of its forward
    resolved. A deep model makes the second kind at every layer but the first of each class,
    so its per-layer cost is what the depth multiplies; the first kind is a cost per forward,
    which the tiny models' two layers split only two ways."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from attn_backends._path._contract import BoundForward, ForwardPath
    from attn_backends.integrations import _hf_mask, _hf_proof
    from attn_backends.integrations import transformers as integration
    from attn_backends.integrations.transformers import clear_layout_cache, decisions

    model = paths.packed
    name = model[0].model.config._attn_implementation  # what runs now (a runner may switch it)
    model.encode(batch, batch_size=paths.batch_size, convert_to_tensor=True)
    backend_class = type(decisions()[-1].backend)
    hook: list[float] = []
    mask: list[float] = []
    forward: list[float] = []
    kernel: list[float] = []
    attention = AttentionInterface._global_mapping
    masks = AttentionMaskInterface._global_mapping
    original_attention, original_mask = attention[name], masks[name]
    resolves: list[float] = []
    # per attention call: its time beyond the kernel, and whether it resolved its lane
    calls_beyond: list[tuple[float, bool]] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        resolved, kernels = len(resolves), len(kernel)
        start = time.perf_counter()
        try:
            return original_attention(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            hook.append(spent)
            calls_beyond.append((spent - sum(kernel[kernels:]), len(resolves) > resolved))

    check: list[float] = []
    proof: list[float] = []
    encode_s = 0.0
    forwards: list[None] = []
    # one embedding call per forward (sentence-transformers calls the model's forward directly,
    # past the model's own hooks)
    embed = model[0].model.get_input_embeddings()
    counting = embed.register_forward_pre_hook(lambda *_: forwards.append(None))
    attention[name], masks[name] = hooked, _timing(original_mask, mask)
    try:
        with contextlib.ExitStack() as timed:
            timed.enter_context(_timed(ForwardPath, "run", forward))
            timed.enter_context(_timed(BoundForward, "__call__", forward))
            timed.enter_context(_timed(backend_class, "attend", kernel))
            timed.enter_context(_timed(integration, "_resolve", resolves))
            timed.enter_context(_timed(_hf_mask, "check_mask", check))
            timed.enter_context(_timed(_hf_proof, "mask_proof", proof))
            timed.enter_context(_timed(_hf_proof, "proved", proof))
            for _ in range(encodes):
                clear_layout_cache()  # as the timed st-packed runs: new boundaries each batch
                start = time.perf_counter()
                model.encode(batch, batch_size=paths.batch_size, convert_to_tensor=True)
                _sync(paths.device)
                encode_s += time.perf_counter() - start
    finally:
        attention[name], masks[name] = original_attention, original_mask
        counting.remove()
    calls = max(1, len(hook))
    us = 1e6 / calls
    parts = {
        "mask_hook": sum(mask) * us,
        "hook": (sum(hook) - sum(forward)) * us,
        "backend_path": (sum(forward) - sum(kernel)) * us,
    }
    parts["total"] = sum(parts.values())
    # the kernel call's own wall time: all of the kernel on the CPU; on a GPU the host time
    # that queues it (the backend's launch code, flashinfer's run or its direct call)
    parts["kernel_call"] = sum(kernel) * us
    parts["calls"] = float(calls)
    parts["mask_checks_per_forward"] = len(check) / max(1, len(forwards))
    parts["mask_check_share"] = sum(check) / encode_s if encode_s else 0.0
    parts["proof_check_share"] = sum(proof) / encode_s if encode_s else 0.0
    for kind, resolving in (("resolving", True), ("reusing", False)):
        beyond = [s for s, r in calls_beyond if r is resolving]
        parts[f"{kind}_calls"] = float(len(beyond))
        parts[f"{kind}_call"] = sum(beyond) / len(beyond) * 1e6 if beyond else 0.0
    return parts


def flash_implementation() -> str | None:
    """transformers' name for the flash kernel sentence-transformers' own packed path can run
    on here: ``flash_attention_4`` where flash-attn-4 imports (its CuTe DSL included), else
    ``flash_attention_2`` where the flash-attn 2 distribution is installed; None without
    either."""
    try:
        importlib.import_module("flash_attn.cute")  # flash-attn-4's interface
    except Exception:  # absent, or present without the DSL it needs
        pass
    else:
        return "flash_attention_4"
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return "flash_attention_2" if version.startswith("2.") else None


PATHS = (
    "st-padded-sdpa",
    "st-packed",
    "st-packed-graphs",
    "compile-padded-buckets",
    "st-flash-packed",
)
"""Every path, in the order they run; the first is the reference the others are checked and
timed against, so it always runs."""


def run_workload(
    paths: Paths,
    batch: list[str],
    queries: bool,
    repeats: int,
    only: frozenset[str] = frozenset(PATHS),
) -> Iterator[PathResult]:
    """Each path's result as soon as it is measured (a run cut short keeps the earlier ones);
    a path outside ``only`` is reported as not asked for."""
    device = paths.device

    def st(model: Any) -> Callable[[], torch.Tensor]:
        return lambda: model.encode(batch, batch_size=paths.batch_size, convert_to_tensor=True)

    def fresh(model: Any) -> Callable[[], torch.Tensor]:
        """The packed path as a serving batch of new lengths meets it: the shared layouts
        (and their plans) of the boundaries timed before are dropped first."""
        from attn_backends.integrations.transformers import clear_layout_cache

        def encode() -> torch.Tensor:
            clear_layout_cache()
            return model.encode(batch, batch_size=paths.batch_size, convert_to_tensor=True)

        return encode

    flash = flash_implementation()
    candidates: list[tuple[str, Callable[[], torch.Tensor] | None, str]] = [
        ("st-padded-sdpa", st(paths.padded), ""),
        ("st-packed", fresh(paths.packed), ""),
        (
            "st-packed-graphs",
            (lambda: paths.encode_runner(batch)) if queries else None,
            "queries only",
        ),
        (
            "compile-padded-buckets",
            (lambda: paths.encode_compiled(batch)) if device.type == "cuda" else None,
            "needs CUDA (reduce-overhead captures CUDA graphs)",
        ),
        (
            "st-flash-packed",
            (lambda: st(paths.flash(flash))()) if device.type == "cuda" and flash else None,
            "needs CUDA and flash-attn-4 or flash-attn 2 importable",
        ),
    ]
    tokens = sum(len(x) for x in paths.padded.tokenizer(batch, truncation=True)["input_ids"])
    reference: torch.Tensor | None = None
    tolerance = cosine_bound(paths.dtype)
    assert [c[0] for c in candidates] == list(PATHS)  # the two lists name the same paths
    for name, fn, why in candidates:
        result = PathResult(name, tokens=tokens)
        if name not in only and name != PATHS[0]:
            result.status = "skipped: not in --paths"
            yield result
            continue
        if fn is None:
            result.status = f"skipped: {why}"
            yield result
            continue
        try:
            if name == "st-padded-sdpa":
                with paths.counting_cells() as cells:
                    got = fn().float()
                reference = got
                result.padded_tokens = sum(r * s for r, s in cells)
            else:
                got = fn().float()
            assert reference is not None
            result.min_cosine = min_cosine(got, reference)
            if result.min_cosine < tolerance:
                result.status = f"wrong output: min cosine {result.min_cosine:.6f}"
                yield result
                continue
            times = _time(fn, repeats, device)
        except Exception as exc:  # a path that fails is reported, the others still run
            result.status = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            yield result
            continue
        result.p50_ms = statistics.median(times)
        result.p99_ms = _percentile(times, 0.99)
        result.tokens_per_s = tokens / (result.p50_ms / 1e3)
        if name == "st-flash-packed":
            result.extra = {"attn_implementation": flash}
        if name == "st-packed-graphs":
            stats = paths.runner().stats
            result.extra = {
                "captures": stats.captures,
                "replays": stats.replays,
                "bucketed": stats.bucketed,
                "eager": stats.eager,
            }
        yield result


def workloads(dry: bool, cpu_tiny: bool = False) -> dict[str, list[str]]:
    if dry:
        return {"documents 8 x 6..32": texts(8, 6, 32, 0), "queries 3 x 4..10": texts(3, 4, 10, 1)}
    longest = 64 if cpu_tiny else 512  # the tiny models hold 64 positions
    found = {f"documents 64 x 16..{longest}": texts(64, 16, longest, 0)}
    for n in (1, 8, 32):
        found[f"queries {n} x 8..40"] = texts(n, 8, 40, n)
    if not cpu_tiny:
        found["bulk 512 x lognormal 8..512"] = bulk_texts(512, 8, 512, 7)
    return found


def bulk_texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """A bulk embedding job: ``count`` texts whose lengths are lognormal (median 96 tokens,
    a long tail), clipped to ``low..high``, as a corpus of passages is."""
    rng = random.Random(seed)
    lengths = [
        min(high, max(low, round(rng.lognormvariate(math.log(96), 0.8)))) for _ in range(count)
    ]
    return [" ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n - 2)) for n in lengths]


def add_one_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a tool that runs one model's workloads (`serving_ab.py`,
    `serving_profile.py`): ``--model``, ``--workloads``, ``--device``, ``--cpu-tiny``."""
    parser.add_argument("--model", default="bge-m3", choices=sorted(_cases()))
    parser.add_argument("--workloads", default="documents,queries 8,queries 1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-tiny", action="store_true", help="the tiny models on CPU")


class OneWorkload(NamedTuple):
    """One workload of one model and the encodes of it that the one-model tools time."""

    name: str
    texts: int
    """How many texts each encode embeds."""
    dtype: torch.dtype
    """The models' dtype (`cosine_bound`)."""
    padded: Callable[[], object]
    """sentence-transformers on padded sdpa (``st-padded-sdpa``)."""
    packed: Callable[[], object]
    """The library's packed path, its shared layouts dropped first (new boundaries each
    batch, as ``st-packed`` is timed)."""
    runner: Callable[[], object]
    """sentence-transformers' tokenisation and pooling around `GraphRunner`
    (``st-packed-graphs``; CUDA graphs on a GPU)."""


def one_model_workloads(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> Iterator[OneWorkload]:
    """Each chosen workload of ``args.model`` with the encodes of it (`OneWorkload`). The
    model is built once, in a directory removed at the end."""
    tiny = bool(args.cpu_tiny)
    chosen = _chosen(workloads(False, tiny), args.workloads)
    if not chosen:
        parser.error(f"--workloads {args.workloads!r} names no workload")
    from attn_backends.integrations.transformers import clear_layout_cache

    case = _cases()[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        st_dir = build_model(args.model, case, Path(tmp), tiny, 64 if tiny else 8192)
        paths = Paths(st_dir, case, torch.device(args.device), tiny)
        for workload, batch in chosen:

            def padded(batch: list[str] = batch) -> object:
                return paths.padded.encode(batch, batch_size=paths.batch_size)

            def packed(batch: list[str] = batch) -> object:
                clear_layout_cache()
                return paths.packed.encode(batch, batch_size=paths.batch_size)

            def runner(batch: list[str] = batch) -> object:
                return paths.encode_runner(batch)

            yield OneWorkload(workload, len(batch), paths.dtype, padded, packed, runner)


def _chosen(found: dict[str, list[str]], prefixes: str | None) -> list[tuple[str, list[str]]]:
    """The workloads whose names start with one of ``prefixes``, in the prefixes' order."""
    if prefixes is None:
        return list(found.items())
    chosen: list[tuple[str, list[str]]] = []
    for prefix in prefixes.split(","):
        chosen += [(n, b) for n, b in found.items() if n.startswith(prefix.strip())]
    return list(dict(chosen).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory for serving_bench.json/.md")
    parser.add_argument("--models", default="bge-m3,qwen3,modernbert,embeddinggemma")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dry", action="store_true", help="tiny models on CPU, in seconds")
    parser.add_argument(
        "--cpu-tiny",
        action="store_true",
        help="tiny models on CPU with the serving workloads, and the integration's host time "
        "per layer beyond the kernel",
    )
    parser.add_argument(
        "--host-time",
        action="store_true",
        help="also profile the integration's host time per layer beyond the kernel on the "
        "device (always on with --cpu-tiny)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=ST_BATCH,
        help=f"texts per sentence-transformers batch on every path (default {ST_BATCH}, "
        "sentence-transformers' own default)",
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help="comma-separated name prefixes, run in this order (e.g. 'queries 8,documents'); "
        "default: every workload",
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated paths to time (default: all of {', '.join(PATHS)}); "
        f"{PATHS[0]} always runs: the others are checked and timed against it",
    )
    args = parser.parse_args(argv)
    only = frozenset(args.paths.split(","))
    if only - set(PATHS):
        parser.error(f"--paths: unknown {sorted(only - set(PATHS))}; choose from {list(PATHS)}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    tiny = args.dry or args.cpu_tiny
    device = torch.device(
        "cpu"
        if args.cpu_tiny
        else args.device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    )
    repeats = 2 if args.dry else args.repeats
    cases = _cases()
    names = args.models.split(",")
    unknown = [n for n in names if n not in cases]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(cases)}")
    found = workloads(args.dry, args.cpu_tiny)
    chosen = _chosen(found, args.workloads)
    if not chosen:
        parser.error(f"--workloads {args.workloads!r} names none of {list(found)}")
    report: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            st_dir = build_model(name, cases[name], Path(tmp), tiny, 64 if tiny else 8192)
            paths = Paths(st_dir, cases[name], device, tiny, args.batch_size)
            for workload, batch in chosen:
                queries = workload.startswith("queries")
                for result in run_workload(paths, batch, queries, repeats, only):
                    if (
                        result.path == "st-packed"
                        and (args.cpu_tiny or args.host_time)
                        and result.status == "ok"
                    ):
                        result.extra["host_us_per_layer"] = host_per_layer(paths, batch)
                    report.append(
                        {
                            "model": name,
                            "workload": workload,
                            "batch_size": args.batch_size,
                            **asdict(result),
                        }
                    )
                    print(_markdown(report[-1:], device).splitlines()[-1], flush=True)
                    _write(args.out, report, device)  # a run cut short keeps what it measured
    print(_write(args.out, report, device))
    wrong = [r for r in report if r["status"].startswith(("wrong", "failed"))]
    return 1 if wrong else 0


def _write(out: Path | None, report: list[dict[str, Any]], device: torch.device) -> str:
    table = _markdown(report, device)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "serving_bench.json").write_text(json.dumps(report, indent=1))
        (out / "serving_bench.md").write_text(table)
    return table


def _markdown(report: list[dict[str, Any]], device: torch.device) -> str:
    sizes = sorted({int(r.get("batch_size", ST_BATCH)) for r in report}) or [ST_BATCH]
    lines = [
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
        f"sentence-transformers batch size {', '.join(map(str, sizes))}",
        "",
        "| model | workload | path | tokens (valid/padded) | tokens/s | p50 ms | p99 ms "
        "| time / st-padded-sdpa | min cos | status |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    padded = {
        (r["model"], r["workload"]): r["p50_ms"] for r in report if r["path"] == "st-padded-sdpa"
    }

    def num(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in report:
        cells = f"{r['tokens']}" + (f" / {r['padded_tokens']}" if r["padded_tokens"] else "")
        base = padded.get((r["model"], r["workload"]))
        ratio = r["p50_ms"] / base if r["p50_ms"] is not None and base else None
        lines.append(
            f"| {r['model']} | {r['workload']} | {r['path']} | {cells} | "
            f"{num(r['tokens_per_s'], ',.0f')} | {num(r['p50_ms'], '.2f')} | "
            f"{num(r['p99_ms'], '.2f')} | {num(ratio, '.2f')} | {num(r['min_cosine'], '.6f')} | "
            f"{r['status']} |"
        )
    hosts = [r for r in report if "host_us_per_layer" in r.get("extra", {})]
    if hosts:
        lines += [
            "",
            "Host time per attention layer call of `st-packed`, beyond the kernel (µs; ten "
            "profiled encodes after the timed ones). The last two columns split the attention "
            "calls: one that resolves its lane (layout, proof, plan: once per forward and class "
            "of call) and one that reuses the lane of an earlier layer (what each further layer "
            "of a deep model costs), with the number of calls of each:",
            "",
            "| model | workload | mask hook per layer | attention hook around the backend "
            "| backend path around the kernel | total beyond the kernel "
            "| mask checks per forward | mask check share | proof check share "
            "| a call that resolves its lane | a call that reuses it "
            "| the kernel call itself (host) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in hosts:
            h = r["extra"]["host_us_per_layer"]
            shares = (
                f"{h['mask_checks_per_forward']:.2f} | {100 * h['mask_check_share']:.2f}% | "
                f"{100 * h['proof_check_share']:.2f}%"
                if "mask_check_share" in h
                else " | | "  # a report written before these columns
            )
            split = (
                f"{h['resolving_call']:.1f} ({h['resolving_calls']:.0f}) | "
                f"{h['reusing_call']:.1f} ({h['reusing_calls']:.0f})"
                if "reusing_call" in h
                else " | "  # a report written before these columns
            )
            kernel = f"{h['kernel_call']:.1f}" if "kernel_call" in h else ""
            lines.append(
                f"| {r['model']} | {r['workload']} | {h['mask_hook']:.1f} | {h['hook']:.1f} | "
                f"{h['backend_path']:.1f} | {h['total']:.1f} | {shares} | {split} | {kernel} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
