"""Whole HF models through ``attn_implementation="attn_backends"`` on packed input, against the
same model with HF ``sdpa`` on the right-padded batch, on one GPU.

    python3 scripts/gpu/e2e_models.py --out e2e-out                  # H200, bf16, full sizes
    python3 scripts/gpu/e2e_models.py --out /tmp/e2e --tiny --device cpu   # smoke test

Models (random weights, no download, bf16, eval, ``use_cache=False``):

- ``xlmr``: BGE-M3-sized XLM-R encoder (24 layers, hidden 1024, 16 heads x 64, bidirectional;
  vocabulary 1000 instead of 250k, which changes no layer), 64 texts of 16..512 tokens;
- ``qwen3``: Qwen3-Embedding-0.6B-sized decoder (28 layers, hidden 1024, 16 q / 8 kv heads x
  128, causal, q/k norm, RoPE), 64 texts of 64..2048 tokens. The padded sdpa batch is then
  64 x 2048 tokens (about twice the valid ones) and fits an H200; on a smaller GPU pass
  ``--texts 32``;
- ``modernbert``: ModernBERT-base-sized encoder (22 layers, hidden 768, 12 heads x 64; every
  third layer global, the others local with ``local_attention`` 128), 64 texts of 16..1024
  tokens: two specs, two plans per batch;
- ``embeddinggemma``: EmbeddingGemma-sized Gemma 3 (24 layers, hidden 768, 3 q / 1 kv heads x
  256, ``use_bidirectional_attention``, sliding window 512 as in config.json, five local
  layers per global one), 64 texts of 16..2048 tokens. Not in the default ``--models``.

Lengths are seeded. For each model the script first checks that the packed outputs match HF
sdpa's on every valid token (relative error of the per-token hidden states under ``--tol``,
bf16), then times both paths: ``--warmup`` runs, then the median of ``--runs`` timed runs with
a device synchronize around each. Tokens/s counts valid tokens only, for both paths.

Attention share: each path is timed again with its attention function replaced by one that
returns zeros of the query's shape (the model's projections, norms and MLPs still run); the
share is ``1 - t_zero / t_full``. It includes whatever the attention function does besides
the kernel (for the packed path: the per-batch plan, for sdpa: HF's mask preparation is
outside the function and counts as non-attention).

Writes ``results.json``, ``results.md`` and, when matplotlib imports, ``tokens_per_s.png`` to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from attn_backends.integrations import _hf_mask
from attn_backends.integrations import transformers as abt

ZERO = "attn_backends_zero"


@dataclass(frozen=True)
class Workload:
    name: str
    config: Callable[[bool], Any]
    lengths: Callable[[int, bool], list[int]]
    position_offset: Callable[[Any], int]


def _xlmr(tiny: bool) -> Any:
    from transformers import XLMRobertaConfig

    size = (2, 64, 4, 128) if tiny else (24, 1024, 16, 4096)
    return XLMRobertaConfig(
        vocab_size=1000,
        num_hidden_layers=size[0],
        hidden_size=size[1],
        num_attention_heads=size[2],
        intermediate_size=size[3],
        max_position_embeddings=8194,
    )


def _qwen3(tiny: bool) -> Any:
    from transformers import Qwen3Config

    size = (2, 64, 4, 2, 16, 128) if tiny else (28, 1024, 16, 8, 128, 3072)
    return Qwen3Config(
        vocab_size=1000,
        num_hidden_layers=size[0],
        hidden_size=size[1],
        num_attention_heads=size[2],
        num_key_value_heads=size[3],
        head_dim=size[4],
        intermediate_size=size[5],
        max_position_embeddings=32768,
        use_cache=False,
    )


def _modernbert(tiny: bool) -> Any:
    from transformers import ModernBertConfig

    size = (2, 64, 4, 128, 8) if tiny else (22, 768, 12, 1152, 128)
    every = 2 if tiny else 3  # every n-th layer global, from the first
    pattern: dict[str, Any] = {"global_attn_every_n_layers": every}
    return ModernBertConfig(
        vocab_size=1000,
        num_hidden_layers=size[0],
        hidden_size=size[1],
        num_attention_heads=size[2],
        intermediate_size=size[3],
        local_attention=size[4],
        layer_types=[
            "full_attention" if i % every == 0 else "sliding_attention" for i in range(size[0])
        ],
        **pattern,  # transformers before layer_types reads this
        max_position_embeddings=8192,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )


def _embeddinggemma(tiny: bool) -> Any:
    from transformers import Gemma3TextConfig

    size = (2, 64, 4, 2, 16, 128, 8) if tiny else (24, 768, 3, 1, 256, 1152, 512)
    return Gemma3TextConfig(
        vocab_size=1000,
        num_hidden_layers=size[0],
        hidden_size=size[1],
        num_attention_heads=size[2],
        num_key_value_heads=size[3],
        head_dim=size[4],
        intermediate_size=size[5],
        sliding_window=size[6],
        use_bidirectional_attention=True,
        max_position_embeddings=2048,
        use_cache=False,
    )


def _lengths(low: int, high: int) -> Callable[[int, bool], list[int]]:
    def draw(texts: int, tiny: bool) -> list[int]:
        rng = random.Random(0)
        lo, hi = (4, 32) if tiny else (low, high)
        return [rng.randint(lo, hi) for _ in range(texts)]

    return draw


WORKLOADS = {
    "xlmr": Workload("xlmr", _xlmr, _lengths(16, 512), lambda cfg: cfg.pad_token_id + 1),
    "qwen3": Workload("qwen3", _qwen3, _lengths(64, 2048), lambda cfg: 0),
    "modernbert": Workload("modernbert", _modernbert, _lengths(16, 1024), lambda cfg: 0),
    "embeddinggemma": Workload(
        "embeddinggemma", _embeddinggemma, _lengths(16, 2048), lambda cfg: 0
    ),
}


def _zero_attention(
    module: torch.nn.Module, query: torch.Tensor, *args: object, **kwargs: object
) -> tuple[torch.Tensor, None]:
    """Stand-in attention: zeros of the output's shape, to time everything but attention."""
    return query.new_zeros(query.transpose(1, 2).shape), None


def _register_zero() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ZERO, _zero_attention)
    AttentionMaskInterface.register(ZERO, abt.padding_mask)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(run: Callable[[], object], device: torch.device, warmup: int, runs: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward(model: Any, impl: str, inputs: dict[str, Any]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            out: torch.Tensor = model(**inputs).last_hidden_state
        return out

    return run


@dataclass
class Result:
    model: str
    texts: int
    valid_tokens: int
    padded_tokens: int
    backends: list[str]
    max_relative_error: float
    packed_s: float
    padded_sdpa_s: float
    packed_tokens_per_s: float
    padded_sdpa_tokens_per_s: float
    speedup: float
    packed_attention_share: float
    padded_sdpa_attention_share: float
    packed_mask_check_s: float
    """Of ``packed_s``: the check of the model's own masks (`_hf_mask.check_mask`), measured
    in one more forward with the device synchronized around each check."""
    packed_mask_checks: int


def _mask_check_s(run: Callable[[], object], device: torch.device) -> tuple[float, int]:
    """Seconds one forward of ``run`` spends in the mask check, and how many checks it made."""
    spent: list[float] = []
    original = _hf_mask.check_mask

    def timed(*args: Any, **kwargs: Any) -> None:
        _sync(device)
        start = time.perf_counter()
        try:
            original(*args, **kwargs)
        finally:
            _sync(device)
            spent.append(time.perf_counter() - start)

    _hf_mask.check_mask = timed
    try:
        run()
    finally:
        _hf_mask.check_mask = original
    return sum(spent), len(spent)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def run_workload(work: Workload, args: argparse.Namespace, device: torch.device) -> Result:
    from transformers import AutoModel

    cfg = work.config(args.tiny)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    from_config: Callable[..., Any] = AutoModel.from_config
    model = from_config(cfg, attn_implementation="sdpa").to(device, dtype).eval()
    lengths = work.lengths(args.texts, args.tiny)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    padded = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    packed: dict[str, Any] = dict(
        abt.pack_sequences(seqs, device=device, position_offset=work.position_offset(cfg))
    )

    want = _forward(model, "sdpa", padded)()
    got = abt.unpack_hidden(_forward(model, abt.DEFAULT_NAME, packed)(), packed["cu_seq_lens_q"])
    error = max(_relative(got[i], want[i, :n]) for i, n in enumerate(lengths))
    backends = sorted({d.name for d in abt.decisions()})
    print(f"[{work.name}] backends {backends}; max relative error vs sdpa {error:.3g}", flush=True)
    if not error <= args.tol:
        raise SystemExit(f"[{work.name}] packed output differs from HF sdpa: {error} > {args.tol}")
    del want, got

    def timed(impl: str, inputs: dict[str, Any]) -> float:
        return _median_s(_forward(model, impl, inputs), device, args.warmup, args.runs)

    t_packed = timed(abt.DEFAULT_NAME, packed)
    t_padded = timed("sdpa", padded)
    t_packed_zero = timed(ZERO, packed)
    t_padded_zero = timed(ZERO, padded)
    check_s, checks = _mask_check_s(_forward(model, abt.DEFAULT_NAME, packed), device)
    tokens = sum(lengths)
    return Result(
        model=work.name,
        texts=len(lengths),
        valid_tokens=tokens,
        padded_tokens=len(lengths) * width,
        backends=backends,
        max_relative_error=error,
        packed_s=t_packed,
        padded_sdpa_s=t_padded,
        packed_tokens_per_s=tokens / t_packed,
        padded_sdpa_tokens_per_s=tokens / t_padded,
        speedup=t_padded / t_packed,
        packed_attention_share=max(0.0, 1 - t_packed_zero / t_packed),
        padded_sdpa_attention_share=max(0.0, 1 - t_padded_zero / t_padded),
        packed_mask_check_s=check_s,
        packed_mask_checks=checks,
    )


def _markdown(results: list[Result], device: str) -> str:
    lines = [
        f"Device: {device}. Tokens/s counts valid tokens; attention share = 1 - time with a "
        "zero attention function / full time.",
        "",
        "| model | texts | valid / padded tokens | backend | packed tok/s | padded sdpa tok/s "
        "| speedup | attention share packed / sdpa | mask check ms (checks) | max rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.texts} | {r.valid_tokens} / {r.padded_tokens} | "
            f"{', '.join(r.backends)} | {r.packed_tokens_per_s:,.0f} | "
            f"{r.padded_sdpa_tokens_per_s:,.0f} | {r.speedup:.2f}x | "
            f"{r.packed_attention_share:.0%} / {r.padded_sdpa_attention_share:.0%} | "
            f"{r.packed_mask_check_s * 1e3:.1f} ({r.packed_mask_checks}) | "
            f"{r.max_relative_error:.2g} |"
        )
    return "\n".join(lines) + "\n"


def _chart(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.packed_tokens_per_s for r in results], 0.4, label="packed")
    ax.bar([i + 0.2 for i in x], [r.padded_sdpa_tokens_per_s for r in results], 0.4, label="sdpa")
    ax.set_xticks(list(x), [r.model for r in results])
    ax.set_ylabel("valid tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--models",
        default="xlmr,qwen3",
        help="comma-separated: xlmr, qwen3, modernbert, embeddinggemma",
    )
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tol", type=float, default=3e-2, help="max relative error vs sdpa")
    parser.add_argument("--tiny", action="store_true", help="2-layer models, short texts")
    args = parser.parse_args(argv)
    if args.tiny and args.texts == 64:
        args.texts = 4
    device = torch.device(args.device)
    abt.register()
    _register_zero()
    results = [run_workload(WORKLOADS[name], args, device) for name in args.models.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    (args.out / "results.json").write_text(
        json.dumps({"device": name, "results": [asdict(r) for r in results]}, indent=2)
    )
    table = _markdown(results, name)
    (args.out / "results.md").write_text(table)
    charted = _chart(results, args.out / "tokens_per_s.png")
    print(table + (f"chart: {args.out / 'tokens_per_s.png'}" if charted else "no matplotlib"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
