"""Hugging Face models through ``attn_implementation="attn_backends"`` against their own code.

Each model class is built from a tiny config with seeded random weights (no download). HF eager
on a right-padded batch is the reference; the integration runs the same weights on the padded
batch and on the packed input. The tolerance comes from HF itself: the spread between its sdpa
and eager paths on the same batch and dtype, times a small factor, plus a floor of a few units
in the last place of the outputs. A negative control (wrong softmax scale, wrong causal flag)
must land far above that tolerance, so the comparison can fail.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402

NAME = abt.register()
LENGTHS = (5, 11, 1, 8)
VOCAB = 120
SPREAD_FACTOR = 3.0
FLOOR_ULPS = 1.0
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _configs() -> dict[str, Callable[[], Any]]:
    t = transformers
    return {
        "BertModel": lambda: t.BertConfig(**COMMON, max_position_embeddings=64),
        "XLMRobertaModel": lambda: t.XLMRobertaConfig(**COMMON, max_position_embeddings=64),
        "Qwen3Model": lambda: t.Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=16, use_cache=False
        ),
        "Qwen2Model": lambda: t.Qwen2Config(**COMMON, num_key_value_heads=2, use_cache=False),
        "GPTNeoXModel": lambda: t.GPTNeoXConfig(**COMMON, rotary_pct=0.25, use_cache=False),
        "MistralModel": lambda: t.MistralConfig(
            **COMMON, num_key_value_heads=2, sliding_window=None, use_cache=False
        ),
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (a wrong scale or mask shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])))
            elif "norm" in name.lower():
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


@dataclasses.dataclass
class Batch:
    sequences: list[list[int]]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _batch(pad_id: int, seed: int = 0, *, left: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return Batch(seqs, ids, mask)


def _build(class_name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    cfg = _configs()[class_name]()
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="eager")
    assert type(model).__name__ == class_name
    _randomize(model, seed=3)
    return model.to(dtype).eval(), cfg


def _run(model: Any, impl: str, **inputs: object) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        hidden: torch.Tensor = model(**inputs).last_hidden_state
        return hidden.float()


def _valid(hidden: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
    return [hidden[i][batch.attention_mask[i].bool()] for i in range(len(batch.sequences))]


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Relative error ``||got - want|| / ||want||`` over all valid tokens (norms, not maxima:
    a bf16 maximum is one rounding step of the largest value and hides a real error)."""
    g, w = torch.cat(got), torch.cat(want)
    return float((g - w).norm() / w.norm())


def _packed(model: Any, cfg: Any, batch: Batch) -> list[torch.Tensor]:
    offset = cfg.pad_token_id + 1 if type(model).__name__ == "XLMRobertaModel" else 0
    packed = abt.pack_sequences(batch.sequences, position_offset=offset)
    hidden = _run(model, NAME, **packed)
    return abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])


@dataclasses.dataclass
class Case:
    model: Any
    cfg: Any
    batch: Batch
    eager: list[torch.Tensor]
    tolerance: float


_CASES: dict[tuple[str, torch.dtype], Case] = {}


def _case(class_name: str, dtype: torch.dtype) -> Case:
    """Model, batch, eager reference and the tolerance HF's own sdpa-vs-eager spread allows."""
    key = (class_name, dtype)
    if key not in _CASES:
        model, cfg = _build(class_name, dtype)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        batch = _batch(pad)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        eager = _valid(_run(model, "eager", **inputs), batch)
        spread = _max_error(_valid(_run(model, "sdpa", **inputs), batch), eager)
        floor = FLOOR_ULPS * torch.finfo(dtype).eps
        _CASES[key] = Case(model, cfg, batch, eager, SPREAD_FACTOR * spread + floor)
    return _CASES[key]


MODELS = list(_configs())
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("class_name", MODELS)
def test_padded_and_packed_match_eager(class_name, dtype):
    case = _case(class_name, dtype)
    inputs = {"input_ids": case.batch.input_ids, "attention_mask": case.batch.attention_mask}
    padded = _max_error(_valid(_run(case.model, NAME, **inputs), case.batch), case.eager)
    packed = _max_error(_packed(case.model, case.cfg, case.batch), case.eager)
    assert padded <= case.tolerance, (padded, case.tolerance)
    assert packed <= case.tolerance, (packed, case.tolerance)


@pytest.mark.parametrize(
    ("class_name", "what", "dtype"),
    [
        ("BertModel", "scale", torch.float32),
        ("Qwen3Model", "scale", torch.float32),
        ("Qwen3Model", "scale", torch.bfloat16),
        ("Qwen3Model", "causal", torch.float32),
        ("Qwen3Model", "causal", torch.bfloat16),
    ],
)
def test_negative_control_fails_far_above_tolerance(class_name, what, dtype, monkeypatch):
    case = _case(class_name, dtype)
    real = abt._spec_for

    def change(spec: ab.AttentionSpec) -> ab.AttentionSpec:
        if what == "scale":
            return dataclasses.replace(spec, softmax_scale=spec.scale * 2)
        return dataclasses.replace(spec, causal=not spec.causal)

    monkeypatch.setattr(abt, "_spec_for", lambda *a, **k: change(real(*a, **k)))
    packed = _max_error(_packed(case.model, case.cfg, case.batch), case.eager)
    assert packed > 10 * case.tolerance, (packed, case.tolerance)


def test_left_padding_and_a_new_batch_of_the_same_shape():
    """Left padding; then another mask of the same shape: no layout of the first is reused."""
    model, _ = _build("Qwen3Model", torch.float32)
    left = _batch(0, seed=1, left=True)
    got = _run(model, NAME, input_ids=left.input_ids, attention_mask=left.attention_mask)
    want = [_run(model, "eager", input_ids=torch.tensor([s])) for s in left.sequences]
    assert _max_error(_valid(got, left), [w[0] for w in want]) < 1e-4
    right = _batch(0, seed=1)
    again = _run(model, NAME, input_ids=right.input_ids, attention_mask=right.attention_mask)
    assert _max_error(_valid(again, right), [w[0] for w in want]) < 1e-4


class _Layer(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.is_causal = causal


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_attention_function_against_the_float64_reference(causal, left):
    """GQA, a single-token sequence, padding rows (zeros out), strided q/k/v views."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 2, 16
    batch = _batch(0, seed=2, left=left)
    bsz, seq = batch.attention_mask.shape
    qkv = torch.randn(bsz, seq, (hq + 2 * hkv) * d, generator=g)  # one projection: views
    q = qkv[..., : hq * d].view(bsz, seq, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hkv) * d].view(bsz, seq, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d :].view(bsz, seq, hkv, d).transpose(1, 2)
    mask = abt.padding_mask(bsz, seq, seq, attention_mask=batch.attention_mask.bool())
    out, weights = abt.attention_forward(_Layer(causal), q, k, v, mask, scaling=0.3)
    assert weights is None
    valid = batch.attention_mask.bool()
    spec = ab.AttentionSpec(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=torch.float32,
        causal=causal,
        softmax_scale=0.3,
    )
    params = ab.FMHAParams.from_lengths(list(LENGTHS), device="cpu")
    want = ab.reference_attention(qkv[valid], spec, params)
    assert ab.relative_error(out[valid].reshape(params.token_q_num, -1), want) < 1e-5
    assert float(out[~valid].abs().max()) == 0.0  # padding rows: zeros


def test_one_prepare_per_batch(monkeypatch):
    model, _ = _build("Qwen3Model", torch.float32)
    batch = _batch(0)
    selection = ab.select(
        abt._spec_for(
            model.layers[0].self_attn,
            torch.empty(1, 4, 1, 16),
            torch.empty(1, 2, 1, 16),
            16**-0.5,
            None,
            {},
        ),
        device="cpu",
    )
    prepared = []
    real = type(selection.backend).prepare

    def counting(self, params):
        prepared.append(params)
        return real(self, params)

    monkeypatch.setattr(type(selection.backend), "prepare", counting)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    _run(model, NAME, **inputs)
    _run(model, NAME, **inputs)
    assert len(prepared) == 2  # one per forward, shared by both layers
    assert prepared[0].input_lengths == LENGTHS


def test_4d_masks_padding_accepted_custom_refused():
    model, _ = _build("BertModel", torch.float32)
    batch = _batch(0)
    pad = batch.attention_mask.bool()
    four_d = pad[:, None, None, :].expand(-1, 1, pad.shape[1], -1)
    want = _valid(
        _run(model, "eager", input_ids=batch.input_ids, attention_mask=batch.attention_mask), batch
    )
    got = _valid(_run(model, NAME, input_ids=batch.input_ids, attention_mask=four_d), batch)
    assert _max_error(got, want) < 1e-4
    custom = four_d.clone()
    custom[0, 0, 0, 1] = False
    with pytest.raises(ab.IntegrationError, match="not a bidirectional padding mask"):
        _run(model, NAME, input_ids=batch.input_ids, attention_mask=custom)


def test_refusals_are_named():
    model, _ = _build("BertModel", torch.float32)
    ids = _batch(0).input_ids
    model.set_attn_implementation(NAME)
    with pytest.raises(ab.IntegrationError, match="output_attentions"), torch.no_grad():
        model(input_ids=ids, output_attentions=True)
    model.train()
    with pytest.raises(ab.IntegrationError, match="dropout"):
        model(input_ids=ids)


def _window_models() -> dict[str, Any]:
    t = transformers
    return {
        "MistralModel": t.MistralConfig(
            **COMMON, num_key_value_heads=2, sliding_window=4, use_cache=False
        ),
        "ModernBertModel": t.ModernBertConfig(
            **COMMON,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        "Gemma2Model": t.Gemma2Config(
            **COMMON, num_key_value_heads=2, head_dim=16, use_cache=False
        ),
    }


@pytest.mark.parametrize("class_name", list(_window_models()))
def test_window_and_softcap_models_are_refused_by_name(class_name):
    torch.manual_seed(0)
    cfg = _window_models()[class_name]
    model = transformers.AutoModel.from_config(cfg, attn_implementation=NAME).eval()
    assert type(model).__name__ == class_name
    with pytest.raises(ab.FeatureNotSupportedError, match="not support yet"), torch.no_grad():
        model(input_ids=_batch(0).input_ids)


def test_pack_and_unpack_round_trip():
    packed = abt.pack_sequences([[5, 6, 7], [8], [9, 10]], position_offset=2)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed["position_ids"].tolist() == [[2, 3, 4, 2, 2, 3]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 4, 6]
    assert packed["max_length_q"] == 3
    hidden = torch.randn(1, 6, 2)
    parts = abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])
    assert [tuple(p.shape) for p in parts] == [(3, 2), (1, 2), (2, 2)]
    assert torch.equal(torch.cat(parts), hidden[0])


def test_importing_the_library_does_not_import_transformers():
    code = (
        "import sys, attn_backends, attn_backends.integrations.transformers; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_packed_by_position_ids_alone_and_mismatched_key_lengths_refused():
    case = _case("Qwen3Model", torch.float32)
    packed = abt.pack_sequences(case.batch.sequences)
    hidden = _run(
        case.model, NAME, input_ids=packed["input_ids"], position_ids=packed["position_ids"]
    )
    parts = abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])
    assert _max_error(parts, case.eager) <= case.tolerance
    wrong_k = packed["cu_seq_lens_k"].clone()
    wrong_k[1] += 1
    with pytest.raises(ab.IntegrationError, match="cu_seq_lens_k differs"):
        _run(case.model, NAME, **{**packed, "cu_seq_lens_k": wrong_k})
