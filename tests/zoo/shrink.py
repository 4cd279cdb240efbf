"""A tiny config from any transformers config class's defaults, for the model zoo.

Generic: the defaults are walked attribute by attribute and every size the zoo knows by name
(widths, depths, heads, vocabulary, positions, experts) is set small; every attention feature
that is on by default (a sliding window, an attention chunk, a logit soft-cap) is set small
enough that it bites on the zoo's batch (11 tokens at most). Depth keeps one layer of each
kind: per-layer lists (``layer_types`` and the like) are cut to the first layer of each
distinct combination, at least two. Nested config dicts and sub-configs (DBRX's
``attn_config``) are walked the same way. `OVERRIDES` holds the few families where the
generic walk does not produce a buildable model. A config that cannot be built raises
`Unshrinkable` with the reason; the zoo reports it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

HEADS = 4
HEAD_DIM = int(os.environ.get("ZOO_HEAD_DIM", "16"))
"""16 on CPU; ``ZOO_HEAD_DIM=64`` on a GPU gives the tiny models a head size the flashinfer
kernels serve, so the zoo reaches them and not only flex and torch-sdpa."""
HIDDEN = HEADS * HEAD_DIM
WINDOW = 4  # below the longest test sequence (11): keys further back are hidden
CHUNK = 4
SOFTCAP = 2.0  # scores of a few units are bent by it
VOCAB = 128
POSITIONS = 64

EXPERTS = (
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "moe_num_experts",
    "num_experts_total",
)

# attribute name -> small value (applied when the default is a larger int)
SIZES: dict[str, int] = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "model_dim"), HIDDEN
    ),
    **dict.fromkeys(("embedding_size", "word_embed_proj_dim", "hidden_size_per_head"), 32),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads"), HEADS
    ),
    **dict.fromkeys(
        ("head_dim", "attention_head_dim", "d_head", "kv_channels", "v_head_dim"), HEAD_DIM
    ),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "rotary_emb_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "index_head_dim"), 16),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "d_ff",
            "d_inner",
            "ffn_hidden_size",
            "mlp_dim",
            "intermediate_dim",
        ),
        128,
    ),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_intermediate_size",
            "moe_ffn_hidden_size",
            "ffn_dim_moe",
        ),
        32,
    ),
    **dict.fromkeys(EXPERTS, 4),
    **dict.fromkeys(
        ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_k"), 2
    ),
    **dict.fromkeys(
        (
            "n_group",
            "num_group",
            "num_expert_group",
            "topk_group",
            "n_shared_experts",
            "num_shared_experts",
        ),
        1,
    ),
    **dict.fromkeys(("vocab_size", "n_vocab"), VOCAB),
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "max_sequence_length",
            "max_2d_position_embeddings",
        ),
        POSITIONS,
    ),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    **dict.fromkeys(("sliding_window", "local_attention", "sliding_window_size"), WINDOW),
    **dict.fromkeys(("attention_chunk_size", "chunk_size_feed_forward_attention"), CHUNK),
}
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "n_kv_heads")
LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
# Any other int above `LARGE` whose name says it is a size is cut by the first pattern it
# matches (a family's own names: ``mamba_n_heads``, ``hidden_size_global``, ``index_topk``).
LARGE = 64
BY_PATTERN: tuple[tuple[re.Pattern[str], int], ...] = tuple(
    (re.compile(p), v)
    for p, v in (
        (r"heads", HEADS),
        (r"hidden_size", HIDDEN),
        (r"vocab", VOCAB),
        (r"topk|top_k", 2),
        (r"iters|cycles|steps", 2),
        (r"layers_per", 1),
        (r"window|chunk", WINDOW),
        (r"size|dim|d_ssm|d_state|rank|_len$|groups", 16),
    )
)
SOFTCAPS = ("attn_logit_softcapping", "attn_softcap", "attention_logit_softcapping")
MAX_LAYERS = 6


def _mrope(sections: list[int]) -> dict[str, Any]:
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": sections}
    return {"rope_parameters": rope}


# model_type -> extra constructor arguments, where the generic walk alone does not build.
OVERRIDES: dict[str, dict[str, Any]] = {
    # HRM loops one stack of layers H x (L + 1) times; its depth must equal that product
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1, "num_hidden_layers": 2},
    # input, recurrent and output stacks must add up to the depth
    "dory": {
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "num_hidden_layers": 3,
    },
    # the indexer's top-k must be a multiple of its pooling
    "glm5_next_text": {"index_kpool": 2, "index_topk": 4},
    # the modeling code's M-RoPE sections (not in the config) are sized for head_dim 128
    **{t: _mrope([4, 2, 2]) for t in ("glm4v_text", "glm_image_text", "glm_ocr_text")},
    "glm4v_moe_text": _mrope([2, 1, 1]),  # partial rotary: half of head_dim 16 rotates
}


class Unshrinkable(Exception):
    """The config class cannot be made tiny; the message says why."""


@dataclasses.dataclass(frozen=True)
class Tiny:
    config: Any
    special_ids: frozenset[int]  # token ids with a meaning (pad, bos, ...): kept out of inputs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_count(values: dict[str, Any]) -> tuple[str, int] | None:
    for name in LAYERS:
        if _is_int(values.get(name)) and values[name] > 0:
            return name, int(values[name])
    return None


def _kept_layers(values: dict[str, Any], depth: int) -> list[int]:
    """The first layer of each distinct combination of per-layer settings, at least two."""
    lists = [v for v in values.values() if isinstance(v, list) and len(v) == depth]
    tables = [
        {_layer_index(k): x for k, x in v.items()}
        for v in values.values()
        if isinstance(v, dict) and v and all(_layer_index(k) is not None for k in v)
    ]
    kinds: dict[str, int] = {}
    for i in range(depth):
        kinds.setdefault(repr([v[i] for v in lists] + [t.get(i) for t in tables]), i)
    kept = sorted(kinds.values())[:MAX_LAYERS]
    for i in range(depth):
        if len(kept) >= min(2, depth):
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _small(name: str, value: Any, defaults: dict[str, Any]) -> Any:
    if name in SIZES and _is_int(value) and value > SIZES[name]:
        return SIZES[name]
    if name in KV_HEADS and _is_int(value):
        heads = next((defaults[h] for h in SIZES if h in defaults and SIZES[h] == HEADS), None)
        if value == heads:
            return HEADS
        return 1 if value == 1 else 2
    if name in SOFTCAPS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return SOFTCAP
    if name == "attention_window" and isinstance(value, (int, list)):  # Longformer: even sizes
        return [WINDOW] * len(value) if isinstance(value, list) else WINDOW
    if _is_int(value) and value > LARGE and not name.endswith(("_token_id", "_token_index")):
        for pattern, small in BY_PATTERN:
            if pattern.search(name):
                return small
    return value


def shrink_values(defaults: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of a tiny config, from a default config's ``to_dict()``."""
    values = {k: v for k, v in defaults.items() if not k.startswith("_")}
    out: dict[str, Any] = {}
    depth = _layer_count(values)
    kept = _kept_layers(values, depth[1]) if depth else []
    for name, value in values.items():
        if depth and name == depth[0]:
            out[name] = len(kept)
        elif depth and isinstance(value, list) and len(value) == depth[1] and depth[1] > 1:
            out[name] = [value[i] for i in kept]
        elif isinstance(value, dict) and name.endswith("_config"):
            if value and all(_layer_index(k) is not None for k in value):
                out[name] = _per_layer(value, kept)
            else:
                out[name] = shrink_values(value)
        else:
            out[name] = _small(name, value, values)
    if _is_int(values.get("head_dim")) and values["head_dim"] == values.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: the rotary width is named twice
    if out.get("num_experts_per_tok", 0) is None and any(_is_int(out.get(n)) for n in EXPERTS):
        out["num_experts_per_tok"] = 2
    return out


def _derived(values: dict[str, Any]) -> None:
    """Sizes other sizes must add up to, recomputed after the cut (in place): Mamba heads
    times their width is the Mamba width; M-RoPE's three sections add up to half the
    rotated width."""
    if _is_int(values.get("mamba_n_heads")) and _is_int(values.get("mamba_expand")):
        width = values["mamba_expand"] * values.get("hidden_size", HIDDEN)
        values["mamba_n_heads"] = HEADS
        values["mamba_d_head"] = width // HEADS
        if values.get("mamba_d_ssm") is not None:
            values["mamba_d_ssm"] = width
    rotated = values.get("qk_rope_head_dim") or values.get("head_dim") or HIDDEN // HEADS
    for table in [values, *(v for v in values.values() if isinstance(v, dict))]:
        if isinstance(table.get("mrope_section"), list) and len(table["mrope_section"]) == 3:
            half = int(rotated) // 2
            table["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]


def _layer_index(key: object) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    return int(key) if isinstance(key, str) and key.isdigit() else None


def _per_layer(table: dict[Any, Any], kept: list[int]) -> dict[int, Any]:
    """A ``{layer index: settings}`` table renumbered to the kept layers."""
    by_index = {
        _layer_index(k): shrink_values(v) if isinstance(v, dict) else v for k, v in table.items()
    }
    return {new: by_index[old] for new, old in enumerate(kept) if old in by_index}


def _special_ids(values: dict[str, Any], vocab: int) -> tuple[dict[str, Any], set[int]]:
    """Token-id attributes moved into the small vocabulary (from its top down) and the set of
    all of them."""
    fixed: dict[str, Any] = {}
    used: set[int] = set()
    free = iter(range(vocab - 1, 0, -1))

    def inside(x: int) -> int:
        return x if 0 <= x < vocab else next(free)

    for name, value in values.items():
        if not (name.endswith("_token_id") or name.endswith("_token_index")):
            continue
        if _is_int(value):
            fixed[name] = inside(value)
            used.add(fixed[name])
        elif isinstance(value, list) and all(_is_int(x) for x in value):
            fixed[name] = [inside(x) for x in value]
            used.update(fixed[name])
    return fixed, used


def tiny_config(model_type: str, config_cls: Any) -> Tiny:
    """The tiny config of ``config_cls`` (model type ``model_type``) or `Unshrinkable`."""
    try:
        defaults = config_cls().to_dict()
    except Exception as e:
        raise Unshrinkable(f"its default config does not build: {type(e).__name__}: {e}") from e
    values = shrink_values(defaults)
    vocab = values.get("vocab_size", VOCAB)
    ids, special = _special_ids(values, vocab if _is_int(vocab) else VOCAB)
    values.update(ids)
    _derived(values)
    values.update(OVERRIDES.get(model_type, {}))
    values["use_cache"] = False
    for drop in ("transformers_version", "model_type", "architectures", "dtype"):
        values.pop(drop, None)
    try:
        config = config_cls(**values)
    except Exception as e:
        raise Unshrinkable(f"the tiny config is refused: {type(e).__name__}: {e}") from e
    return Tiny(config, frozenset(special))
