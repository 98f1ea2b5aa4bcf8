"""Tests for aiayn.inference.translate: one output per input in order, empty lines, batching invariance, greedy
output against a naive full-prefix decoder written here (all in fp32, which is exact), n-best lists, and
vocabulary checks."""

import ast
import subprocess
import sys

import pytest
import torch
from conftest import MIXED, TASK_SRC, TASK_TGT, naive_greedy

from aiayn.config import SearchConfig, preset
from aiayn.inference import translate as translate_module
from aiayn.inference import warmup
from aiayn.inference.compiled import shared_class
from aiayn.inference.translate import Translator
from aiayn.inference.warmup import classes_up_to, plan
from aiayn.model import Transformer
from aiayn.precision import Int8Linear, for_inference
from aiayn.tokenizer import BOS_ID, Tokenizer

INPUTS = MIXED


@pytest.fixture(scope="module")
def tokenizer(task_tokenizer) -> Tokenizer:
    return task_tokenizer


@pytest.fixture(scope="module")
def model(task_model) -> Transformer:
    return task_model


@pytest.fixture(scope="module")
def translator(model, tokenizer) -> Translator:
    return Translator(model, tokenizer, SearchConfig(beam_size=4), dtype="fp32")


@pytest.fixture(scope="module")
def beam_outputs(translator) -> list[str]:
    return translator.translate(INPUTS)


def test_one_output_per_input_in_order_with_empty_lines_empty(translator, beam_outputs):
    assert len(beam_outputs) == len(INPUTS)
    for source, output in zip(INPUTS, beam_outputs):
        assert (output == "") == (source == "")
    assert len(set(beam_outputs)) > 3  # the model's outputs depend on the input, so order is tested
    one_at_a_time = [translator.translate([text])[0] for text in INPUTS]
    assert beam_outputs == one_at_a_time


def test_greedy_equals_naive_full_prefix_decoding(model, tokenizer, translator):
    """Beam 1 through the Translator (cached, batched, sorted) == argmax decoding written out here."""
    texts = INPUTS[:6]
    ids = tokenizer.encode_src(texts)
    got = translator.translate_ids(ids, SearchConfig(beam_size=1))
    for source_ids, hyps in zip(ids, got):
        if len(source_ids) == 1:  # only EOS: an empty line
            assert hyps[0].tokens == []
        else:  # §6.1 maximum output length: input length + 50, EOS included
            assert hyps[0].tokens == naive_greedy(model, source_ids, len(source_ids) + 50)
    assert translator.translate(texts, beam_size=1) == tokenizer.decode_tgt([h[0].tokens for h in got])


@pytest.mark.parametrize("batch_tokens", [1, 150, 10**6])
def test_batch_size_does_not_change_outputs(model, tokenizer, beam_outputs, batch_tokens):
    translator = Translator(
        model, tokenizer, SearchConfig(beam_size=4), dtype="fp32", batch_tokens=batch_tokens
    )
    assert translator.translate(INPUTS) == beam_outputs


def test_batches_cover_every_nonempty_input_once_longest_first_within_budget(translator):
    lengths = [len(x) for x in translator.tokenizer.encode_src(INPUTS)]
    translator = Translator(translator.model, translator.tokenizer, batch_tokens=300)
    batches = list(translator.batches(lengths, beam_size=2))
    flat = [i for b in batches for i in b]
    assert sorted(flat) == [i for i, text in enumerate(INPUTS) if text]
    assert [lengths[i] for i in flat] == sorted((lengths[i] for i in flat), reverse=True)
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) * 2 <= 300
    assert len(batches) > 1


def test_n_best_lists_are_sorted_and_start_with_the_best(translator, beam_outputs):
    n_best = translator.translate_n_best(INPUTS, 3)
    assert len(n_best) == len(INPUTS)
    for source, group, best in zip(INPUTS, n_best, beam_outputs):
        if not source:
            assert group == [("", 0.0)]
            continue
        assert len(group) == 3
        scores = [score for _, score in group]
        assert scores == sorted(scores, reverse=True)
        assert all(score <= 0 for score in scores)  # log-probabilities over a positive length penalty
        assert group[0][0] == best  # beam 4 either way: the same search, the same winner


def test_n_best_wider_than_the_beam_widens_the_beam(translator):
    groups = translator.translate_n_best(INPUTS[:1], 6)
    assert len(groups[0]) == 6


def test_bf16_gives_one_line_per_input(model, tokenizer):
    outputs = Translator(model, tokenizer, SearchConfig(beam_size=2), dtype="bf16").translate(INPUTS)
    assert len(outputs) == len(INPUTS) and outputs[1] == "" and outputs[7] == ""


def test_int8_quantises_every_linear_and_stays_close_to_fp32(model, tokenizer):
    """int8: every projection (attention, feed-forward, output) holds int8 weights, the float model is
    left as it was, and the log-probabilities stay close to fp32's."""
    int8 = Translator(for_inference(model, "int8"), tokenizer, SearchConfig(beam_size=2), dtype="int8")
    linears = [m for m in int8.model.modules() if type(m) is torch.nn.Linear]
    quantised = [m for m in int8.model.modules() if type(m) is Int8Linear]
    assert not linears and len(quantised) == sum(type(m) is torch.nn.Linear for m in model.modules())
    outputs = int8.translate(INPUTS)
    assert len(outputs) == len(INPUTS) and outputs[1] == "" and outputs[7] == ""
    src = torch.tensor([tokenizer.encode_src([INPUTS[0]])[0]])
    tgt_in = torch.tensor([[BOS_ID, 5, 6, 7]])
    with torch.no_grad():
        exact, approx = model(src, tgt_in).log_softmax(-1), int8.model(src, tgt_in).log_softmax(-1)
    assert (exact - approx).abs().max() < 0.1
    assert not torch.equal(exact, approx)  # it really is another computation


def test_int8_needs_a_model_prepared_for_it(model, tokenizer):
    with pytest.raises(ValueError, match="for_inference"):
        Translator(model, tokenizer, dtype="int8")


def test_translator_refuses_a_tokenizer_of_another_vocabulary(model, tokenizer):
    other = Tokenizer.train(TASK_SRC, TASK_TGT, vocab_size=280)
    with pytest.raises(ValueError, match=r"tokenizer vocabulary sizes \(280, 280\) differ"):
        Translator(model, other)
    target_differs = preset(
        "tiny", src_vocab_size=300, tgt_vocab_size=301, share_embeddings=False, d_model=32, d_ff=64
    )
    with pytest.raises(ValueError, match=r"differ from the model's \(300, 301\)"):
        Translator(Transformer(target_differs), tokenizer)


def test_translate_of_nothing_is_nothing(translator):
    assert translator.translate([]) == []
    assert translator.translate_n_best([], 2) == []


def test_transposed_weights_are_the_same_model_in_another_layout(model, tokenizer, tmp_path):
    """Translator.load stores Linear weights column-major: same numbers, same translations, still tied."""
    from aiayn.checkpoint import save_model

    save_model(tmp_path, model, tokenizer)
    loaded = Translator.load(tmp_path, search_config=SearchConfig(beam_size=4), device=torch.device("cpu"))
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert loaded.model.generator.weight is loaded.model.tgt_embed.tokens.weight  # §3.4 tying survives
    for p, q in zip(model.parameters(), loaded.model.parameters()):
        assert torch.equal(p, q)
    src = torch.tensor([tokenizer.encode_src(INPUTS[:1])[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(src, src[:, :5]), model(src, src[:, :5]), atol=1e-5, rtol=0)
    assert loaded.translate(INPUTS) == Translator(model, tokenizer, SearchConfig(beam_size=4)).translate(
        INPUTS
    )


@pytest.mark.parametrize(
    ("max_sentences", "classes"), [(64, ["one", "many", "few"]), (5, ["one", "few"]), (1, ["one"])]
)
def test_the_warm_up_plan_finds_each_classs_graphs_in_order_and_compiles_nothing(
    model, tokenizer, tmp_path, monkeypatch, max_sentences, classes
):
    """What a server's compile workers do first (warmup.py): the warm-up batch of each row class its
    batches fall in (one sentence; many, from 8; a few; up to batch_sentences and the compiled decoder's
    32; larger batches decode eagerly), decoded eagerly once to find the graphs they meet, in the order met,
    each with the classes whose batches need it: a graph the few and the many share (shared_class) needed
    by both. Nothing is compiled or written."""
    monkeypatch.setenv("AIAYN_COMPILE_STORE", str(tmp_path))
    beam = SearchConfig(beam_size=4)
    translator = Translator(model, tokenizer, beam, "fp32", compile=True)
    sizes = classes_up_to(min(max_sentences, translator.compiled.max_sentences))
    assert list(sizes) == classes
    needs = plan(translator, [beam], sizes)
    # planned with searches that stop 2 tokens past each source: the graphs, classes and order of the
    # whole searches (the default search decodes 50 past)
    monkeypatch.setattr(warmup, "PLAN_STEPS", beam.max_len_b)
    assert list(plan(translator, [beam], sizes).items()) == list(needs.items())
    memories = [shared_class("memory", cls) for cls in classes]
    assert [key[1] for key in needs if key[0] == "memory"] == list(dict.fromkeys(memories))
    for cls in classes:  # each class: its memory and step, and beam search's own work of its sentences
        assert {key[0] for key, of in needs.items() if cls in of} == {"beam", "memory", "step"}, needs
        assert all(
            key[1] == shared_class(key[0], cls, *key[2:3])
            for key, of in needs.items()
            if cls in of and key[0] in ("memory", "step")
        )
    assert translator.compiled.compile_seconds == 0.0 and list(tmp_path.iterdir()) == []


def test_compile_ahead_keeps_its_plan_and_a_later_run_skips_the_planning_pass(
    model, tokenizer, tmp_path, monkeypatch
):
    """`aiayn translate --compile` with every graph already stored: the first run plans (decodes each
    class's warm-up batch eagerly) and keeps the plan beside the graphs; a later run finds it and every
    graph of it, and decodes nothing before its own work. A graph gone from the store voids the plan."""
    from aiayn.checkpoint import save_model

    store = tmp_path / "store"
    monkeypatch.setenv("AIAYN_COMPILE_STORE", str(store))
    save_model(tmp_path / "model", model, tokenizer)
    beam = SearchConfig(beam_size=4)
    translator = Translator.load(tmp_path / "model", beam, dtype="fp32", device="cpu", compile=True)
    compiled = translator.compiled
    store.mkdir()
    ids = tokenizer.encode_src(INPUTS[:3])
    sizes = {"few": classes_up_to(compiled.max_sentences)["few"]}
    needs = plan(translator, [beam], sizes)
    for key in needs:  # every graph stored (their contents are not read here)
        compiled.package_path(key).write_bytes(b"")
    planned = []
    monkeypatch.setattr(translate_module, "plan", lambda *a: planned.append(1) or plan(*a))
    no_worker = lambda *a, **k: pytest.fail("a warm-up started with every graph stored")  # noqa: E731
    monkeypatch.setattr(translate_module, "Warmup", no_worker)
    translator.compile_ahead(ids, beam, print)
    assert planned == [1] and warmup.stored_plan(compiled, [beam], sizes) == needs
    translator.compile_ahead(ids, beam, print)
    assert planned == [1]  # the stored plan: no pass
    compiled.package_path(next(iter(needs))).unlink()
    assert warmup.stored_plan(compiled, [beam], sizes) is None


def test_stored_mode_loads_what_a_compile_stored_decodes_the_rest_eagerly_and_compiles_nothing(
    model, tokenizer, tmp_path, monkeypatch
):
    """compile="stored" (`aiayn translate` given neither --compile nor --no-compile): a store without the
    model's graphs leaves it eager; once a compile has stored the graphs of one sentence, greedy, a later
    translator loads and runs them, and a batch whose graphs are not there (three sentences; beam 2, found
    missing after the encoder's graphs ran) decodes eagerly; every output is eager's, and nothing more is
    compiled or written. The one test here that compiles (four small packages)."""
    from aiayn.inference import compiled, graph_store

    monkeypatch.setenv("AIAYN_COMPILE_STORE", str(tmp_path))
    # without inductor's GEMM autotuning, which only picks kernels and doubles the time; the packages'
    # names hold the options, so the compile and the later translators must agree on them
    options = graph_store.compile_options
    for module in (compiled, graph_store):
        monkeypatch.setattr(
            module, "compile_options", lambda model, **given: options(model, max_autotune=False)
        )
    greedy = SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=6)
    eager = Translator(model, tokenizer, greedy, "fp32")
    one, three = INPUTS[:1], [INPUTS[0], INPUTS[3], INPUTS[6]]
    assert Translator(model, tokenizer, greedy, "fp32", compile="stored").compiled is None
    first = Translator(model, tokenizer, greedy, "fp32", compile=True)
    assert first.translate(one) == eager.translate(one) and first.compiled.compile_seconds > 0
    packages = sorted(tmp_path.glob("*.pt2"))
    assert graph_store.stored(model, tmp_path) and not graph_store.stored(Transformer(model.config), tmp_path)
    assert not graph_store.stored(model, tmp_path / "empty") and not graph_store.stored(model, None)
    later = Translator(model, tokenizer, greedy, "fp32", compile="stored")
    assert isinstance(later.compiled, compiled.StoredDecoder)
    assert later.translate(one) == eager.translate(one) and later.compiled.load_seconds > 0
    assert later.translate(three) == eager.translate(three)
    assert later.translate(one, beam_size=2) == eager.translate(one, beam_size=2)
    assert later.compiled.compile_seconds == 0.0 and sorted(tmp_path.glob("*.pt2")) == packages
    # A process that decodes with stored packages imports neither dynamo nor inductor (seconds of its start)
    torch.save(model, tmp_path / "model.pt")
    ids = tokenizer.encode_src(one)
    child = f"""
import sys, torch
from aiayn.config import SearchConfig
from aiayn.inference.compiled import StoredDecoder
from aiayn.inference.search import search
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
decoder = StoredDecoder(model, {str(tmp_path)!r}, max_autotune=False)
found = search(decoder, torch.tensor({ids!r}), SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=6))
assert decoder.load_seconds > 0 and decoder.compile_seconds == 0
print(found[0][0].tokens)
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))))
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    tokens, compilers = out.strip().splitlines()
    assert tokenizer.decode_tgt([ast.literal_eval(tokens)]) == eager.translate(one) and compilers == "[]"
