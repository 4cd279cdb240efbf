"""torch.compile(fullgraph=True) over a whole model served by the integration, on CPU.

`compile_ready` learns the model's attention specs from one example batch; each batch's plans
are prepared on the host by ``ready.batch``; inside the compiled graph every attention call is
the custom op ``attn_backends::prefill``. The compiled model's output is compared with the
integration's own packed path on the same weights, for batches of other lengths than the
example (a new layout changes the prepared plans, not the handles in the graph), through
dynamo alone and through AOT autograd's functionalization (``aot_eager``, which runs the op's
fake), and dynamo reports no graph break.
"""

from __future__ import annotations

import pytest
import torch

from attn_backends._values._errors import IntegrationError
from attn_backends.integrations import transformers as abt
from attn_backends.integrations.compiled import compile_ready, prefill

transformers = pytest.importorskip("transformers")
dynamo = pytest.importorskip("torch._dynamo")

VOCAB = 97


def _model(kind: str):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    if kind == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=128)
    else:
        config = transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=16, use_cache=False
        )
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, attn_implementation=abt.register()).eval()


def _batch(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    seqs = [[int(x) for x in torch.randint(3, VOCAB, (n,), generator=generator)] for n in lengths]
    return abt.pack_sequences(seqs)


def _extra(kind):
    return {"use_cache": False} if kind == "qwen3" else {}


@torch.inference_mode()
def _integration(model, packed, kind):
    return model(**packed)[0]  # pack_sequences asks for no cache


@pytest.mark.parametrize(("kind", "compiler"), [("bert", "aot_eager"), ("qwen3", "eager")])
def test_compiled_whole_model_matches_the_integration(kind, compiler):
    model = _model(kind)
    example = _batch((5, 9, 3), seed=1)
    batches = [example, _batch((7, 2), seed=2), _batch((4, 11, 6, 1), seed=3)]
    expected = [_integration(model, b, kind) for b in batches]
    ready = compile_ready(model, example["input_ids"], example["cu_seq_lens_q"])
    assert len(ready.specs) == 1  # every layer shares one spec, one handle
    dynamo.reset()
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    for packed, want in zip(batches, expected, strict=True):
        with ready.batch(packed["cu_seq_lens_q"]), torch.inference_mode():
            got = compiled(
                input_ids=packed["input_ids"], position_ids=packed["position_ids"], **_extra(kind)
            )[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # outside compile and outside a batch the model is the integration's again
    torch.testing.assert_close(_integration(model, batches[1], kind), expected[1])


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_no_graph_break_at_attention(kind):
    """fullgraph=True compiles the whole forward without a break: one prefill op per layer,
    and the batch check at its input."""
    model = _model(kind)
    packed = _batch((6, 3), seed=4)
    ready = compile_ready(model, packed["input_ids"], packed["cu_seq_lens_q"])
    graphs: list[torch.fx.GraphModule] = []

    def record(graph: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(graph)
        return graph.forward

    dynamo.reset()
    compiled = torch.compile(model, backend=record, fullgraph=True)
    with ready.batch(packed["cu_seq_lens_q"]), torch.inference_mode():
        compiled(input_ids=packed["input_ids"], position_ids=packed["position_ids"], **_extra(kind))
    # the model's forward pre-hook (the batch check) may be traced as a frame of its own
    ops = [node.target for g in graphs for node in g.graph.nodes if node.op == "call_function"]
    layers = model.config.num_hidden_layers
    assert ops.count(torch.ops.attn_backends.prefill.default) == layers
    assert ops.count(torch.ops.attn_backends.check_batch.default) == 1


def test_the_plain_integration_does_not_trace_whole():
    """Negative control: without compile_ready the attention function's host work stops
    dynamo (fullgraph refuses it)."""
    model = _model("bert")
    packed = _batch((6, 3), seed=5)
    dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(dynamo.exc.TorchDynamoException), torch.inference_mode():
        compiled(**packed)


def test_the_op_refuses_a_handle_with_no_prepared_plan():
    x = torch.zeros(3, 2, 4)
    with pytest.raises(IntegrationError, match="no prepared plan"):
        prefill(x, x, x, 10**9)


def test_batch_refuses_bad_prefix_sums():
    model = _model("bert")
    packed = _batch((4, 2), seed=6)
    ready = compile_ready(model, packed["input_ids"], packed["cu_seq_lens_q"])
    with pytest.raises(IntegrationError, match="prefix sums"), ready.batch([0, 3, 3]):
        pass


def test_a_batch_prepared_for_other_tokens_is_refused():
    model = _model("bert")
    packed = _batch((4, 2), seed=7)
    ready = compile_ready(model, packed["input_ids"], packed["cu_seq_lens_q"])
    with (
        pytest.raises(IntegrationError, match="prepared plans for one packed row of 7"),
        ready.batch([0, 4, 7]),
        torch.inference_mode(),
    ):
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"])


def test_a_layer_the_example_never_reached_is_refused_by_name():
    model = _model("bert")
    packed = _batch((4, 2), seed=8)
    ready = compile_ready(model, packed["input_ids"], packed["cu_seq_lens_q"])
    layer = model.encoder.layer[1].attention.self
    delattr(layer, "_attn_backends_handle")  # as if the example batch had skipped this layer
    with (
        pytest.raises(IntegrationError, match="never reached this layer"),
        ready.batch(packed["cu_seq_lens_q"]),
        torch.inference_mode(),
    ):
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"])


def test_a_batch_prepared_in_one_thread_is_not_another_threads_forward():
    """Thread A holds ``ready.batch`` open; thread B's plain forward of the same model, on a
    batch of as many tokens but other boundaries, is the integration's own (a module-global
    table made it run A's plans, 0.94 off)."""
    import threading

    model = _model("qwen3")
    example = _batch((5, 9, 3), seed=1)
    other = _batch((10, 7), seed=4)  # 17 tokens, as the example
    want = _integration(model, other, "qwen3")
    ready = compile_ready(model, example["input_ids"], example["cu_seq_lens_q"])
    opened, done = threading.Event(), threading.Event()

    def hold() -> None:
        with ready.batch(example["cu_seq_lens_q"]):
            opened.set()
            done.wait(timeout=60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(timeout=60)
        got = _integration(model, other, "qwen3")
    finally:
        done.set()
        holder.join()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_switched_away_after_compile_ready_is_refused_by_batch():
    model = _model("bert")
    example = _batch((5, 9, 3), seed=1)
    ready = compile_ready(model, example["input_ids"], example["cu_seq_lens_q"])
    model.set_attn_implementation("eager")
    with (
        pytest.raises(IntegrationError, match="switched to attn_implementation='eager'"),
        ready.batch(example["cu_seq_lens_q"]),
    ):
        pass


def test_an_example_of_one_sequence_proves_no_batch_of_several():
    """One sequence has no boundary to prove: a batch of several is refused by name, a batch
    of one still runs."""
    model = _model("bert")
    single = _batch((7,), seed=8)
    ready = compile_ready(model, single["input_ids"], single["cu_seq_lens_q"])
    several = _batch((3, 4), seed=9)
    with (
        pytest.raises(IntegrationError, match="proved no batch of several"),
        ready.batch(several["cu_seq_lens_q"]),
    ):
        pass
    other = _batch((5,), seed=10)
    want = _integration(model, other, "bert")
    with ready.batch(other["cu_seq_lens_q"]), torch.inference_mode():
        got = model(input_ids=other["input_ids"], position_ids=other["position_ids"])[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_positions_of_other_boundaries_than_the_prepared_batch_are_refused(compiled):
    """The batch is prepared for [0, 4, 7]; the model is handed positions restarting at 3 (the
    same 7 tokens, other sequences): refused, as are missing positions."""
    model = _model("qwen3")
    example = _batch((5, 9, 3), seed=1)
    ready = compile_ready(model, example["input_ids"], example["cu_seq_lens_q"])
    dynamo.reset()
    run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    ids = _batch((4, 3), seed=11)["input_ids"]
    shifted = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with ready.batch([0, 4, 7]), torch.inference_mode():
        with pytest.raises(IntegrationError, match="do not restart exactly at the boundaries"):
            run(input_ids=ids, position_ids=shifted, use_cache=False)
        with pytest.raises(IntegrationError, match="without position_ids"):
            run(input_ids=ids, use_cache=False)
        right = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
        run(input_ids=ids, position_ids=right, use_cache=False)  # the prepared boundaries
