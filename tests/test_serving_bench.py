"""The serving benchmark's dry mode runs on CPU, checks every path's output first, and reports
the padding sentence-transformers' own batches hold."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sentence_transformers")

from tests.script_support import load_script


def _load():
    return load_script("benchmarks/serving_bench.py")


def test_dry_mode_runs_and_checks_outputs(tmp_path):
    bench = _load()
    assert bench.main(["--dry", "--models", "bge-m3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serving_bench.json").read_text())
    by_path = {(r["workload"].split()[0], r["path"]): r for r in report}
    for kind in ("documents", "queries"):
        padded, packed = by_path[(kind, "st-padded-sdpa")], by_path[(kind, "st-packed")]
        assert padded["status"] == packed["status"] == "ok"
        assert packed["min_cosine"] > 0.9999 and packed["tokens_per_s"] > 0
        assert padded["padded_tokens"] > padded["tokens"], "sorted batches still hold padding"
    graphs = by_path[("queries", "st-packed-graphs")]
    assert graphs["status"] == "ok"
    assert graphs["extra"]["bucketed"] > 0 and graphs["extra"]["eager"] == 0, "CPU: no capture"
    assert by_path[("documents", "st-packed-graphs")]["status"].startswith("skipped")
    assert "| st-packed |" in (tmp_path / "serving_bench.md").read_text()


def test_compiled_path_runs_the_batches_sentence_transformers_builds(tmp_path, monkeypatch):
    """The compile baseline pads sentence-transformers' own batches (longest first, 32 texts
    each) to buckets and returns the embeddings in the texts' order, under no autograd (on CPU
    with the compiler replaced by the model itself)."""
    bench = _load()
    monkeypatch.setattr(bench.torch, "compile", lambda model, mode: model)
    case = bench._cases()["bge-m3"]
    st_dir = bench.build_model("bge-m3", case, tmp_path, True, 64)
    paths = bench.Paths(st_dir, case, bench.torch.device("cpu"), True)
    texts = bench.texts(40, 4, 30, 7)  # two batches: 32 + 8
    got = paths.encode_compiled(texts)
    want = paths.padded.encode(texts, convert_to_tensor=True)
    assert got.shape == want.shape and not got.requires_grad
    cos = bench.torch.nn.functional.cosine_similarity(got.float(), want.float())
    assert float(cos.min()) > 0.9999


def test_workloads_run_in_the_order_asked():
    bench = _load()
    found = bench.workloads(False)
    chosen = [name for name, _ in bench._chosen(found, "queries 8, documents,queries 8")]
    assert chosen == ["queries 8 x 8..40", "documents 64 x 16..512"]
    assert [n for n, _ in bench._chosen(found, None)] == list(found)
    with pytest.raises(SystemExit):
        bench.main(["--dry", "--workloads", "nothing"])


def test_the_padding_count_leaves_no_hook_for_the_compiler(tmp_path, monkeypatch):
    """The padded path's batches are counted by a hook that is gone before the compiled
    baseline compiles the same module (a hook left there made dynamo recompile per call)."""
    bench = _load()
    compiled = []

    def compile_(model, mode):
        compiled.append(dict(model.get_input_embeddings()._forward_hooks))
        return model

    monkeypatch.setattr(bench.torch, "compile", compile_)
    case = bench._cases()["bge-m3"]
    st_dir = bench.build_model("bge-m3", case, tmp_path, True, 64)
    paths = bench.Paths(st_dir, case, bench.torch.device("cpu"), True)
    batch = bench.texts(5, 4, 30, 3)
    with paths.counting_cells() as cells:
        paths.padded.encode(batch, convert_to_tensor=True)
    assert cells and all(rows <= 5 for rows, _ in cells)
    paths.encode_compiled(batch)
    assert compiled == [{}]


def test_cpu_tiny_mode_reports_the_ratio_and_the_host_time_beyond_the_kernel(tmp_path):
    bench = _load()
    args = ["--cpu-tiny", "--models", "bge-m3", "--repeats", "2", "--workloads", "queries 8"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serving_bench.json").read_text())
    packed = next(r for r in report if r["path"] == "st-packed")
    host = packed["extra"]["host_us_per_layer"]
    assert host["calls"] > 0, "the profiled encode reached the attention hook"
    parts = ("mask_hook", "hook", "backend_path")
    assert all(host[k] >= 0 for k in parts), host
    assert host["total"] == pytest.approx(sum(host[k] for k in parts))
    assert host["kernel_call"] > 0, "the kernel's own time is reported apart"
    # the tiny BGE-M3's two layers make one class of call: the first resolves its lane, the
    # second reuses it, in every forward
    assert host["resolving_calls"] + host["reusing_calls"] == host["calls"], host
    assert host["resolving_calls"] == host["reusing_calls"] > 0, host
    assert host["resolving_call"] > 0 and host["reusing_call"] > 0, host
    # BGE-M3's packed mask is proved by its first forward: the profiled encodes (new boundaries
    # each) compare their proof and never run the full check again
    assert host["mask_checks_per_forward"] == 0, host
    assert host["mask_check_share"] == 0 and 0 < host["proof_check_share"] < 1, host
    table = (tmp_path / "serving_bench.md").read_text()
    assert "| time / st-padded-sdpa |" in table and "total beyond the kernel" in table
    assert "| mask checks per forward | mask check share | proof check share |" in table
    assert "| a call that resolves its lane | a call that reuses it |" in table


def test_the_host_profile_counts_the_mask_checks_a_batch_cannot_skip(tmp_path, monkeypatch):
    """A check that runs every forward is counted once per forward (the proof dropped before
    each call, so no batch is proved by an earlier one)."""
    bench = _load()
    from attn_backends.integrations import _hf_proof

    monkeypatch.setattr(_hf_proof, "proved", lambda module, proof: False)
    case = bench._cases()["bge-m3"]
    st_dir = bench.build_model("bge-m3", case, tmp_path, True, 64)
    paths = bench.Paths(st_dir, case, bench.torch.device("cpu"), True)
    host = bench.host_per_layer(paths, bench.texts(8, 8, 40, 1), encodes=3)
    assert host["mask_checks_per_forward"] == 1, host
    assert 0 < host["mask_check_share"] < 1, host


def test_a_timed_inherited_method_is_inherited_again_afterwards():
    bench = _load()

    class Base:
        def work(self) -> int:
            return 7

    class Child(Base):
        pass

    spent: list[float] = []
    with bench._timed(Child, "work", spent):
        assert Child().work() == 7
    assert len(spent) == 1 and "work" not in vars(Child)


def test_paths_option_times_only_the_paths_asked_and_always_the_reference(tmp_path):
    bench = _load()
    args = ["--dry", "--models", "bge-m3", "--workloads", "queries", "--out", str(tmp_path)]
    assert bench.main([*args, "--paths", "st-packed"]) == 0
    report = json.loads((tmp_path / "serving_bench.json").read_text())
    status = {r["path"]: r["status"] for r in report}
    assert list(status) == list(bench.PATHS)
    assert status["st-padded-sdpa"] == status["st-packed"] == "ok"
    assert all(status[p] == "skipped: not in --paths" for p in bench.PATHS[2:])
    with pytest.raises(SystemExit):
        bench.main([*args, "--paths", "st-packed,nope"])


def test_the_flash_baseline_runs_on_flash_attention_4_where_it_imports(monkeypatch):
    bench = _load()
    metadata = bench.importlib.metadata

    def imports(name):
        if name != "flash_attn.cute":
            raise AssertionError(name)
        return object()

    def fails(name):
        raise ModuleNotFoundError("No module named 'cutlass.cute'")

    def fa2(name):
        if name != "flash-attn":
            raise AssertionError(name)
        return "2.8.3"

    def none(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bench.importlib, "import_module", imports)
    assert bench.flash_implementation() == "flash_attention_4"
    monkeypatch.setattr(bench.importlib, "import_module", fails)
    monkeypatch.setattr(metadata, "version", fa2)
    assert bench.flash_implementation() == "flash_attention_2"
    monkeypatch.setattr(metadata, "version", none)
    assert bench.flash_implementation() is None
