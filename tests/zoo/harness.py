"""One zoo class through ``attn_implementation="attn_backends"`` against its own eager attention.

The class is built from its tiny config (`shrink`) with seeded random weights, no download.
Each input form runs through the model's eager attention and through the integration on the
same weights, and is compared per token on the valid positions of ``last_hidden_state`` (or
the logits, for a class without one):

- ``right-padded`` and ``left-padded``: four sequences of lengths `LENGTHS` in one batch;
- ``packed``: the same sequences back to back in one row (`abt.pack_sequences`), against each
  sequence run alone with the same position ids (only for a forward that takes
  ``position_ids``: other models cannot restart positions per sequence);
- ``single``: one unpadded sequence, no mask.

The tolerance is measured per class: `SPREAD_FACTOR` times the spread between the model's own
sdpa and eager paths on the padded batch, at least `FLOOR`, at most `CAP`; a class without an
sdpa path gets `FIXED`. Below float32 both sides are judged against the model's eager path in
float32 on the same (rounded) weights: the integration may be off by at most `SPREAD_FACTOR`
times the model's own low-precision error on that form (its eager or sdpa path, the larger), or
by the class tolerance, whichever is larger (a deep random model in bf16, a mixture of experts
above all, amplifies rounding far beyond any fixed bound, for its own paths as much as for
ours). A form ends ``match``, ``refused`` (a named attn_backends error), ``wrong`` (beyond the
tolerance) or ``crash`` (any other exception); a form the model's eager path itself cannot run
is ``n/a``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers

from attn_backends import AttentionBackendError
from attn_backends.integrations import transformers as abt
from tests import hf_support
from tests.zoo import catalogue, shrink

NAME = abt.register()
LENGTHS = (5, 11, 1, 8)
DEVICE = torch.device(os.environ.get("ZOO_DEVICE", "cpu"))
"""Where the models run (``ZOO_DEVICE=cuda`` on a GPU machine); outputs come back to the CPU
for the comparison."""
SEED = 0
SPREAD_FACTOR = 4.0
FLOOR = {torch.float32: 4e-6, torch.bfloat16: 1.6e-2}
FIXED = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
CAP = {torch.float32: 1e-3, torch.bfloat16: 1e-1}
EXACT = "eager-float32"
"""`Built.under` name of the float32 eager reference of a low-precision class."""
FORMS = ("right-padded", "left-padded", "packed", "single")


class NotBuilt(Exception):
    """The class could not be made into a tiny model the zoo can compare; says why."""


@dataclasses.dataclass
class FormResult:
    status: str  # match | refused | wrong | crash | n/a
    error: float | None = None
    detail: str = ""


@dataclasses.dataclass
class ClassResult:
    class_name: str
    model_type: str
    dtype: str
    outcome: str  # match | refused | wrong | crash | not built
    reason: str
    tolerance: float | None = None
    forms: dict[str, FormResult] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Batch:
    sequences: list[list[int]]
    ids: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass
class Built:
    """The class's eager model and, loaded on demand with the same weights, the same model
    under another attention implementation (loaded, not switched: a model that computes
    attention in its own modules ignores ``set_attn_implementation``)."""

    entry: catalogue.Entry
    model: Any
    tiny: shrink.Tiny
    accepts: frozenset[str]  # keyword arguments its forward takes ("**" for any)
    right: Batch
    left: Batch
    dtype: torch.dtype
    others: dict[str, Any] = dataclasses.field(default_factory=dict)

    def under(self, impl: str) -> Any:
        """The model under ``impl``; ``EXACT`` is eager in float32 on the same weights."""
        if impl == "eager":
            return self.model
        if impl not in self.others:
            dtype = torch.float32 if impl == EXACT else self.dtype
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = _load(self.entry, self.tiny.config, "eager" if impl == EXACT else impl)
            model.load_state_dict(self.model.state_dict())
            self.others[impl] = model.to(DEVICE, dtype).eval()
        return self.others[impl]


def _load(entry: catalogue.Entry, config: Any, impl: str) -> Any:
    cls = getattr(transformers, entry.class_name)
    torch.manual_seed(SEED)
    return cls._from_config(copy.deepcopy(config), attn_implementation=impl)


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform (a wrong mask shows)."""
    g = torch.Generator().manual_seed(SEED + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])))
            elif "norm" in name.lower() or "ln" in name.lower().split("."):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def _accepted(cls: Any) -> frozenset[str]:
    params = inspect.signature(cls.forward).parameters.values()
    names = {p.name for p in params}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names.add("**")
    return frozenset(names)


def _batch(tiny: shrink.Tiny, *, left: bool) -> Batch:
    # untyped boundary: a few configs (CANINE reads code points) have no vocab or pad id
    vocab = int(getattr(tiny.config, "vocab_size", shrink.VOCAB))
    allowed = torch.tensor([i for i in range(vocab) if i not in tiny.special_ids])
    g = torch.Generator().manual_seed(SEED)
    seqs = [allowed[torch.randint(len(allowed), (n,), generator=g)].tolist() for n in LENGTHS]
    pad = getattr(tiny.config, "pad_token_id", None)
    return Batch(seqs, *hf_support.padded(seqs, pad if isinstance(pad, int) else 0, left=left))


def build(entry: catalogue.Entry, dtype: torch.dtype) -> Built:
    cls = getattr(transformers, entry.class_name)
    try:
        tiny = shrink.tiny_config(entry.model_type, catalogue.config_class(entry))
    except shrink.Unshrinkable as e:
        raise NotBuilt(str(e)) from e
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _load(entry, tiny.config, "eager")
    except Exception as e:
        raise NotBuilt(
            f"the tiny model does not build: {_describe(e)}{_default_builds(entry)}"
        ) from e

    _randomize(model)
    model = model.to(DEVICE, dtype).eval()
    return Built(
        entry,
        model,
        tiny,
        _accepted(cls),
        _batch(tiny, left=False),
        _batch(tiny, left=True),
        dtype,
    )


def _default_builds(entry: catalogue.Entry) -> str:
    """Whether the class builds from its untouched default config (on the meta device: no
    memory): a failure there is transformers' own, not the shrinker's."""
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            getattr(transformers, entry.class_name)(catalogue.config_class(entry)())
    except Exception as e:
        return f" (its default config fails the same way: {type(e).__name__})"
    return ""


def _output(out: Any) -> torch.Tensor:
    for name in ("last_hidden_state", "logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value.float().cpu()
    hidden_states = getattr(out, "hidden_states", None)
    if isinstance(hidden_states, (tuple, list)) and hidden_states:
        last: torch.Tensor = hidden_states[-1]  # a pooled-only output (DPR): the last layer's
        return last.float().cpu()
    first = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__} without a hidden state")
    return first.float().cpu()


def _forward(built: Built, impl: str, **inputs: Any) -> torch.Tensor:
    kwargs = {
        k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
        if "**" in built.accepts or k in built.accepts
    }
    if "use_cache" in built.accepts or "**" in built.accepts:
        kwargs["use_cache"] = False
    if "output_hidden_states" in built.accepts:
        kwargs["output_hidden_states"] = True
    with torch.no_grad():
        return _output(built.under(impl)(**kwargs))


def _valid(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    return torch.cat([hidden[i][batch.mask[i].bool()] for i in range(len(batch.sequences))])


def token_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest per-token error, relative to the mean per-token norm of the reference."""
    if got.shape != want.shape:
        return math.inf
    scale = want.norm(dim=-1).mean().clamp_min(1e-30)
    return float(((got - want).norm(dim=-1) / scale).max())


# form -> (reference, attn_backends run), each giving the valid tokens [tokens, C]
Runner = Callable[[Built, str], torch.Tensor]


def _padded(side: str) -> Runner:
    def run(built: Built, impl: str) -> torch.Tensor:
        batch = built.right if side == "right" else built.left
        return _valid(_forward(built, impl, input_ids=batch.ids, attention_mask=batch.mask), batch)

    return run


def _packed(built: Built, impl: str) -> torch.Tensor:
    # on the model's device: unpack_hidden finds the serving record by the very tensors the
    # model was called with (a copy moved by `_forward` would be another tensor)
    packed = abt.pack_sequences(built.right.sequences, device=DEVICE)
    hidden = _forward(built, impl, **packed)
    return torch.cat(abt.unpack_hidden(hidden, packed["cu_seq_lens_q"]))


def _one_by_one(built: Built, impl: str) -> torch.Tensor:
    rows = [
        _forward(built, impl, input_ids=torch.tensor([s]), position_ids=torch.arange(len(s))[None])
        for s in built.right.sequences
    ]
    return torch.cat([r[0] for r in rows])


def _single(built: Built, impl: str) -> torch.Tensor:
    longest = max(built.right.sequences, key=len)
    return _forward(built, impl, input_ids=torch.tensor([longest]))[0]


def forms(built: Built) -> dict[str, tuple[Runner, Runner] | str]:
    """Form -> (reference, run), or the reason the form does not apply to this class."""
    packed: tuple[Runner, Runner] | str = (_one_by_one, _packed)
    if "position_ids" not in built.accepts:
        packed = "its forward takes no position_ids (positions cannot restart per sequence)"
    return {
        "right-padded": (_padded("right"), _padded("right")),
        "left-padded": (_padded("left"), _padded("left")),
        "packed": packed,
        "single": (_single, _single),
    }


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _has_sdpa(built: Built) -> bool:
    # untyped boundary: transformers declares sdpa support as a class attribute of the model
    return bool(getattr(type(built.model), "_supports_sdpa", False))


def tolerance(built: Built, dtype: torch.dtype) -> float:
    """From the model's own sdpa-vs-eager spread on the right-padded batch, if it has sdpa."""
    if not _has_sdpa(built):
        return FIXED[dtype]
    run = _padded("right")
    try:
        spread = token_error(run(built, "sdpa"), run(built, "eager"))
    except Exception:
        return FIXED[dtype]
    return min(CAP[dtype], max(FLOOR[dtype], SPREAD_FACTOR * spread))


def run_form(built: Built, form: tuple[Runner, Runner] | str, tol: float) -> FormResult:
    if isinstance(form, str):
        return FormResult("n/a", detail=form)
    reference, served = form
    try:
        want = reference(built, "eager")
    except Exception as e:
        return FormResult("n/a", detail=f"eager itself fails: {_describe(e)}")
    if not bool(torch.isfinite(want).all()):
        return FormResult("n/a", detail="eager output is not finite")
    try:
        got = served(built, NAME)
    except AttentionBackendError as e:
        return FormResult("refused", detail=_describe(e))
    except Exception as e:
        return FormResult("crash", detail=_describe(e))
    if built.dtype == torch.float32:
        error = token_error(got, want)
        status = "match" if error <= tol else "wrong"
        return FormResult(
            status, error, "" if status == "match" else f"error {error:.3g} > {tol:.3g}"
        )
    exact = reference(built, EXACT)
    own = max(token_error(want, exact), _own_sdpa_error(built, reference, exact))
    error = token_error(got, exact)
    limit = max(tol, SPREAD_FACTOR * own)
    detail = f"error {error:.3g} against float32 eager, the model's own {own:.3g}"
    if error <= limit:
        return FormResult("match", error, detail)
    return FormResult("wrong", error, f"{detail}: > {limit:.3g}")


def _own_sdpa_error(built: Built, reference: Runner, exact: torch.Tensor) -> float:
    """The model's own sdpa path against float32 eager on this form (0 without sdpa): a
    mixture of experts can route a token to other experts on a rounding difference, and the
    model's own sdpa shows the same jump as any other correct kernel."""
    if not _has_sdpa(built):
        return 0.0
    try:
        return token_error(reference(built, "sdpa"), exact)
    except Exception:
        return 0.0


def run_class(entry: catalogue.Entry, dtype: torch.dtype) -> ClassResult:
    """Every form of one class; the class's outcome is its worst form."""
    dtype_name = str(dtype).removeprefix("torch.")
    result = ClassResult(entry.class_name, entry.model_type, dtype_name, "", "")
    try:
        built = build(entry, dtype)
        base = forms(built)["right-padded"]
        assert not isinstance(base, str)
        want = base[0](built, "eager")
        if not bool(torch.isfinite(want).all()):
            raise NotBuilt("eager output of the tiny model is not finite")
    except NotBuilt as e:
        result.outcome, result.reason = "not built", str(e)
        return result
    except Exception as e:
        result.outcome = "not built"
        result.reason = f"eager forward of the tiny model fails: {_describe(e)}"
        return result
    result.tolerance = tolerance(built, dtype)
    for name, form in forms(built).items():
        result.forms[name] = run_form(built, form, result.tolerance)
    result.outcome, result.reason = summarize(result.forms)
    return result


def summarize(results: dict[str, FormResult]) -> tuple[str, str]:
    for bad in ("crash", "wrong"):
        hit = {k: r for k, r in results.items() if r.status == bad}
        if hit:
            return bad, "; ".join(f"{k}: {r.detail}" for k, r in hit.items())
    refused = {k: r for k, r in results.items() if r.status == "refused"}
    served = [k for k, r in results.items() if r.status == "match"]
    if refused:
        first = next(iter(refused.values())).detail
        where = ", ".join(refused)
        rest = f"; {', '.join(served)} match" if served else ""
        return "refused", f"{where}: {first}{rest}"
    skipped = {k: r.detail for k, r in results.items() if r.status == "n/a"}
    note = "; ".join(f"{k} n/a: {d}" for k, d in skipped.items())
    return "match", note
