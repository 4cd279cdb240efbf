"""The whole-model graph runner on CPU: bucketing, static buffers, eager fallback, numbers.

Capture and replay need a GPU (``tests/gpu/test_graph_runner_gpu.py``). Here the runner does
everything else on the same code path: it picks the smallest bucket, copies the batch into the
bucket's static buffers (padding rows filled), plans the bucket's padded sequence list, runs
the model with the runner's attention, and returns the batch's rows. With a fake flashinfer it
also runs on real graph plans (``prepare_graph`` once per bucket and spec, ``update`` per
batch). Every output is compared with the same weights run on each sequence alone with HF's
own sdpa attention.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin

import attn_backends as ab
import attn_backends.errors
import attn_backends.reference
from attn_backends.integrations import transformers as abt
from attn_backends.integrations.graph_runner import GraphRunner
from tests.fakes.fake_flashinfer import install
from tests.threads import in_threads

transformers = pytest.importorskip("transformers")

VOCAB = 97
SMALL = ab.GraphBucket(max_tokens=32, max_batch=4)
LARGE = ab.GraphBucket(max_tokens=96, max_batch=8, max_seqlen=40)
SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))


def _config(kind: str, **extra):
    t = transformers
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    common |= extra
    if kind == "bert":
        return t.BertConfig(**common, max_position_embeddings=128)
    if kind == "xlmr":
        return t.XLMRobertaConfig(**common, max_position_embeddings=128, pad_token_id=1)
    return t.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, use_cache=False)


def _models(kind: str, dtype=torch.float32, **extra):
    """The same seeded weights twice: through the integration, and on HF's sdpa."""
    config = _config(kind, **extra)
    torch.manual_seed(0)
    ours = transformers.AutoModel.from_config(
        copy.deepcopy(config), attn_implementation=abt.register(), dtype=dtype
    ).eval()
    ref = transformers.AutoModel.from_config(
        copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype
    )
    ref.load_state_dict(ours.state_dict())
    return ours, ref.eval()


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    cu = [0, *itertools.accumulate(lengths)]
    return seqs, torch.cat(seqs)[None], cu


def _reference(ref, seqs, offset=0):
    """Each sequence alone through HF's sdpa path, positions from ``offset``."""
    with torch.inference_mode():
        return [
            ref(
                input_ids=s[None], position_ids=torch.arange(len(s))[None] + offset
            ).last_hidden_state[0]
            for s in seqs
        ]


def _check(out, seqs, cu, expected, tol):
    assert out.shape[:2] == (1, cu[-1])
    for (a, b), want in zip(itertools.pairwise(cu), expected, strict=True):
        err = ab.reference.relative_error(out[0, a:b].float(), want.float())
        assert err < tol, f"sequence of {b - a} tokens: {err:.3g}"


def test_buckets_are_chosen_smallest_first_and_misfits_run_eagerly():
    model, _ = _models("bert")
    runner = GraphRunner(model, [LARGE, SMALL])
    assert runner.buckets == (SMALL, LARGE)
    assert runner.bucket_for([5, 9]) is SMALL
    assert runner.bucket_for([32]) is SMALL
    assert runner.bucket_for([1] * 5) is LARGE, "five sequences > SMALL's max_batch"
    assert runner.bucket_for([33]) is LARGE
    assert runner.bucket_for([41]) is None, "longer than LARGE's max_seqlen"
    assert runner.bucket_for([40, 40, 17]) is None, "97 tokens > 96"
    assert runner.bucket_for([1] * 9) is None


@pytest.mark.parametrize(("kind", "offset"), [("bert", 0), ("xlmr", 2), ("qwen3", 0)])
def test_bucketed_batches_equal_each_sequence_alone(kind, offset):
    model, ref = _models(kind)
    runner = GraphRunner(model, [SMALL, LARGE], position_offset=offset)
    batches = [(5, 9, 1), (32,), (3, 7, 11, 2, 20), (40, 40, 17), (13, 2)]
    for seed, lengths in enumerate(batches):
        seqs, ids, cu = _batch(lengths, seed)
        out = runner(ids, cu)
        _check(out, seqs, cu, _reference(ref, seqs, offset), 1e-5)
    assert runner.stats.buckets == [SMALL, SMALL, LARGE, None, SMALL]
    assert (runner.stats.eager, runner.stats.bucketed, runner.stats.captures) == (1, 4, 0)


@pytest.mark.parametrize(("kind", "offset"), [("bert", 0), ("xlmr", 2), ("qwen3", 0)])
def test_positions_follow_the_models_own_rule_by_default(kind, offset):
    """No position_offset given: XLM-R numbers positions from padding_idx + 1 as its own
    embeddings do (from 0 it missed by 0.24); the reference is each sequence alone with the
    model's own default positions."""
    model, ref = _models(kind)
    runner = GraphRunner(model, [SMALL])
    assert runner.position_offset == offset
    assert runner.pad_token_id == (model.config.pad_token_id or 0)
    seqs, ids, cu = _batch((5, 9, 1), 0)
    with torch.inference_mode():
        expected = [ref(input_ids=s[None]).last_hidden_state[0] for s in seqs]
    _check(runner(ids, cu), seqs, cu, expected, 1e-5)


def test_static_buffers_are_reused_and_are_what_the_model_reads():
    model, _ = _models("bert")
    runner = GraphRunner(model, [SMALL], pad_token_id=7)
    seen: list[int] = []
    model.embeddings.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["input_ids"].data_ptr()), with_kwargs=True
    )
    ids_buf, pos_buf = runner.buffers(SMALL)
    for seed, lengths in enumerate([(5, 9), (1, 2, 3), (30,)]):
        _, ids, cu = _batch(lengths, seed)
        runner(ids, cu)
        assert runner.buffers(SMALL) == (ids_buf, pos_buf)
        tokens = cu[-1]
        assert torch.equal(ids_buf[0, :tokens], ids[0])
        assert bool((ids_buf[0, tokens:] == 7).all()), "padding rows hold the pad token"
        assert pos_buf[0, :tokens].tolist() == [i for n in lengths for i in range(n)], (
            "positions restart per sequence"
        )
    # the first batch also runs once through the integration (its checks), then bucketed
    assert seen[1:] == [ids_buf.data_ptr()] * 3


def test_padding_rows_never_reach_the_output():
    """Two runners whose padding rows hold different tokens give the same valid rows."""
    model, _ = _models("qwen3")
    _seqs, ids, cu = _batch((4, 10, 3), 1)
    a = GraphRunner(model, [SMALL], pad_token_id=0)(ids, cu)
    b = GraphRunner(model, [SMALL], pad_token_id=50)(ids, cu)
    assert torch.equal(a, b)


def test_a_model_on_another_attention_is_refused():
    _, ref = _models("bert")
    with pytest.raises(ab.errors.IntegrationError, match="attn_implementation='sdpa'"):
        GraphRunner(ref, [SMALL])


def test_the_model_keeps_working_outside_the_runner():
    model, ref = _models("bert")
    runner = GraphRunner(model, [SMALL])
    assert runner.attn_implementation == "attn_backends_graphs"
    seqs, ids, cu = _batch((6, 4), 3)
    runner(ids, cu)
    packed = abt.pack_sequences([s.tolist() for s in seqs])
    with torch.inference_mode():
        out = model(**packed).last_hidden_state
    _check(out, seqs, cu, _reference(ref, seqs), 1e-5)


def test_malformed_batches_are_refused():
    model, _ = _models("bert")
    runner = GraphRunner(model, [SMALL])
    _, ids, _cu = _batch((5, 9), 0)
    for bad in ([0, 5], [0, 5, 5, 14], [1, 14]):
        with pytest.raises(ab.errors.IntegrationError, match="one packed row"):
            runner(ids, bad)
    with pytest.raises(ab.errors.ParamsError, match="capture needs graph plans"):
        GraphRunner(model, [SMALL], capture=True)


@pytest.mark.parametrize(
    ("cu", "positions", "match"),
    [
        (None, torch.zeros(1, 1, dtype=torch.long), r"position_ids .*\[1, 14\]"),
        (None, torch.arange(13)[None], r"position_ids .*\[1, 14\]"),
        (None, torch.arange(14.0)[None], "integer tensor"),
        (torch.tensor([0.0, 5.0, 14.0]), None, "integer tensor"),
    ],
    ids=["positions-1x1", "positions-short", "positions-float", "cu-float"],
)
def test_positions_and_bounds_of_another_shape_or_dtype_are_refused(cu, positions, match):
    """A ``[1, 1]`` position tensor would broadcast over the row, a short one raise inside
    torch, float bounds be truncated: each is a named error before anything runs."""
    model, _ = _models("bert")
    runner = GraphRunner(model, [SMALL])
    _, ids, good_cu = _batch((5, 9), 0)
    with pytest.raises(ab.errors.IntegrationError, match=match):
        runner(ids, good_cu if cu is None else cu, position_ids=positions)


def test_graph_plans_are_made_once_per_bucket_and_updated_per_batch(monkeypatch):
    """On a fake flashinfer (CPU): ``prepare_graph`` once per bucket and spec, ``plan`` per
    batch on the same wrapper, and the numbers still those of each sequence alone."""
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    fake = install(monkeypatch)
    model, ref = _models("bert", dtype=torch.bfloat16, num_attention_heads=1)  # head_dim 64
    runner = GraphRunner(model, [SMALL, LARGE], plans="graph", platform=SM90, backend="flashinfer")
    assert not runner.capture
    batches = [(5, 9, 1), (30,), (3, 7, 11, 2, 20), (2, 2)]
    for seed, lengths in enumerate(batches):
        seqs, ids, cu = _batch(lengths, seed)
        out = runner(ids, cu)
        _check(out, seqs, cu, _reference(ref, seqs), 2e-2)
    init = fake.named("BatchPrefillWithRaggedKVCacheWrapper.__init__")
    graph_inits = [c for c in init if c.args["use_cuda_graph"]]
    assert len(graph_inits) == 2, "one graph wrapper per bucket (one spec)"
    state = runner._states[SMALL]
    ((_, plan, qkv),) = state.plans.values()
    assert qkv is not None and qkv.shape == (SMALL.max_tokens, 3 * 64), "one packed buffer"
    assert isinstance(plan, ab.GraphPlan)
    assert plan.params is not None and plan.params.input_lengths == (2, 2)


def test_two_threads_sharing_one_runner_get_exactly_their_own_batches():
    """A runner's bucket buffers are shared: its calls are serialized, so each thread's
    output is what the same batch gives alone."""

    model, _ = _models("qwen3")
    runner = GraphRunner(model, [SMALL])
    batches = [_batch(lengths, seed) for seed, lengths in enumerate([(5, 9, 1), (7, 3, 12, 2)])]
    with torch.inference_mode():
        runner(*batches[0][1:])  # the first batch runs eagerly through the integration
        alone = [runner(ids, cu).clone() for _, ids, cu in batches]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def work(index: int) -> None:
        _, ids, cu = batches[index]
        with torch.inference_mode():
            for _ in range(20):
                got[index].append(runner(ids, cu).clone())

    in_threads(2, work)
    for index, outs in got.items():
        assert len(outs) == 20
        for out in outs:
            assert torch.equal(out, alone[index]), index


def test_a_model_switched_to_another_attention_after_wrapping_is_refused():
    """The runner must not keep running its own path (or the bucket rows through eager
    attention without a mask) once the model was switched away from it."""
    model, _ = _models("bert")
    runner = GraphRunner(model, [SMALL])
    _, ids, cu = _batch((5, 9), 0)
    runner(ids, cu)
    model.set_attn_implementation("eager")
    with pytest.raises(ab.errors.IntegrationError, match="switched to attn_implementation='eager'"):
        runner(ids, cu)
    model.set_attn_implementation(runner.attn_implementation)
    runner(ids, cu)  # set back: served again


def _lfm2_config():
    """A conv hybrid: LFM2 mixes tokens in short convolutions outside attention."""
    return transformers.Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
        use_cache=False,
    )


def test_a_first_batch_of_one_sequence_proves_nothing_about_boundaries():
    """LFM2 mixes tokens in convolutions outside attention: a packed batch of several
    sequences is refused by the integration. A first batch of one sequence has no boundary, so
    it must not let the next batch, of two, skip that proof (it was served, mixed)."""
    config = _lfm2_config()
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation=abt.register()).eval()
    runner = GraphRunner(model, [SMALL])
    _, one, cu_one = _batch((6,), 0)
    runner(one, cu_one)
    _, two, cu_two = _batch((5, 7), 1)
    with pytest.raises(ab.errors.IntegrationError, match="conv"):
        runner(two, cu_two)


def test_one_sequence_batches_are_proved_once_and_several_again():
    """The class of one-sequence batches is proved by the first through the integration; the
    next ones of other lengths are bucketed without running the model twice (every one did
    before), and still equal each sequence alone. A first batch of several is proved anew."""
    model, ref = _models("xlmr")
    runner = GraphRunner(model, [SMALL])
    for seed, lengths in enumerate([(6,), (17,), (1,), (32,)]):
        seqs, ids, cu = _batch(lengths, seed)
        _check(runner(ids, cu), seqs, cu, _reference(ref, seqs, 2), 1e-5)
    assert (runner.stats.proved, runner.stats.bucketed, runner.stats.eager) == (1, 4, 0)
    seqs, ids, cu = _batch((5, 9), 9)
    _check(runner(ids, cu), seqs, cu, _reference(ref, seqs, 2), 1e-5)
    assert (runner.stats.proved, runner.stats.bucketed) == (2, 5)
    seqs, ids, cu = _batch((20,), 10)
    _check(runner(ids, cu), seqs, cu, _reference(ref, seqs, 2), 1e-5)
    assert (runner.stats.proved, runner.stats.bucketed) == (2, 6)


def test_unpack_hidden_accepts_a_runners_output():
    """The runner proved its boundaries (the integration's checks on a batch of several), so
    the caller's cu_seq_lens unpack its output (they were refused: "no attention layer
    served these cu_seq_lens")."""
    model, _ = _models("bert")
    runner = GraphRunner(model, [SMALL])
    for seed, lengths in enumerate([(5, 9, 1), (7, 3, 12)]):  # eager, then bucketed
        _, ids, cu = _batch(lengths, seed)
        bounds = torch.tensor(cu, dtype=torch.int32)
        out = runner(ids, bounds)
        parts = abt.unpack_hidden(out, bounds)
        assert [p.shape[0] for p in parts] == list(lengths)
        assert torch.equal(torch.cat(parts), out[0])


def test_a_bucketed_call_no_checked_batch_proved_is_refused(monkeypatch):
    """A mask the library cannot prove once per class (here: its signature withheld) is
    checked in full on every batch through the integration; the bucketed path, which checks
    no mask per batch, refuses it by name rather than run it unproved."""
    from attn_backends.integrations import _hf_mask_kinds

    model, _ = _models("bert")
    monkeypatch.setattr(_hf_mask_kinds, "proof_signature", lambda function: None)
    runner = GraphRunner(model, [SMALL])
    _, ids, cu = _batch((5, 9), 0)
    with pytest.raises(ab.errors.IntegrationError, match="no batch the integration checked"):
        runner(ids, cu)


def test_positions_of_other_boundaries_are_refused_where_the_mask_reads_them():
    """Qwen3's causal mask finds packed sequences in the positions: a bucketed batch whose
    positions do not restart at its cu_seq_lens is refused (the proved class does not hold),
    and the right positions still serve."""
    model, ref = _models("qwen3")
    runner = GraphRunner(model, [SMALL])
    seqs, ids, cu = _batch((5, 9), 0)
    runner(ids, cu)  # through the integration: proves the packed class
    seqs, ids, cu = _batch((4, 6), 1)
    flat = torch.arange(10)[None]  # one sequence by the positions, two by cu_seq_lens
    with pytest.raises(ab.errors.IntegrationError, match="do not restart exactly"):
        runner(ids, cu, flat)
    right = torch.cat([torch.arange(4), torch.arange(6)])[None]
    _check(runner(ids, cu, right), seqs, cu, _reference(ref, seqs), 1e-5)
    assert runner.stats.bucketed == 2  # the first batch (after its check) and this one


def test_a_bidirectional_layer_that_declares_no_flag_takes_the_proved_one():
    """A layer without ``is_causal`` follows the model's mask; with no mask in a bucket, the
    runner takes the flag a checked batch proved (bidirectional for BERT), never the default
    causal one."""
    model, ref = _models("bert")
    for module in model.modules():
        if "is_causal" in vars(module):
            del module.is_causal
    runner = GraphRunner(model, [SMALL])
    for seed, lengths in enumerate([(5, 9), (3, 7, 2)]):
        seqs, ids, cu = _batch(lengths, seed)
        _check(runner(ids, cu), seqs, cu, _reference(ref, seqs), 1e-5)
    assert runner.stats.bucketed == 2


def test_a_model_mixing_tokens_outside_attention_runs_every_batch_through_the_integration():
    """A bucket pads the row, and a convolution would read the padding as tokens: one
    sequence per batch is served by the integration, exactly."""
    config = _lfm2_config()
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation=abt.register()).eval()
    ref = transformers.AutoModel.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    runner = GraphRunner(model, [SMALL])
    for seed in range(3):
        seqs, ids, cu = _batch((6 + seed,), seed)
        _check(runner(ids, cu), seqs, cu, _reference(ref.eval(), seqs), 1e-5)
    assert (runner.stats.eager, runner.stats.bucketed) == (3, 0)


def test_a_model_changed_after_wrapping_is_noticed_and_proved_again():
    """A captured graph reads the weights it was captured with: a replaced submodule or a
    parameter moved to new memory drops the buckets, and the next batch is proved through the
    integration again; the outputs follow the changed model exactly."""
    model, ref = _models("bert")
    runner = GraphRunner(model, [SMALL])
    seqs, ids, cu = _batch((5, 9), 0)
    runner(ids, cu)
    runner(ids, cu)
    assert runner.stats.proved == 1
    torch.manual_seed(1)
    replaced = torch.nn.Linear(64, 64)
    model.encoder.layer[0].attention.self.query = replaced
    ref.encoder.layer[0].attention.self.query = copy.deepcopy(replaced)
    _check(runner(ids, cu), seqs, cu, _reference(ref, seqs), 1e-5)
    assert runner.stats.proved == 2
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), ref.parameters(), strict=True):
            mine.data = mine.data * 1.5  # new memory, as model.to() or half() would give
            theirs.data = theirs.data * 1.5
    _check(runner(ids, cu), seqs, cu, _reference(ref, seqs), 1e-5)
    assert runner.stats.proved == 3
    runner(ids, cu)
    assert runner.stats.proved == 3, "an unchanged model is not proved again"
