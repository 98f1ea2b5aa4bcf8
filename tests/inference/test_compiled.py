"""The compiled decoding step (compiled.py) against eager decoding, and its graphs counted: a step that
torch.compile traced again, or gave up on, must fail a test rather than run slowly unnoticed."""

import pytest
import torch
from conftest import EOS_HEAVY_V as V
from conftest import eos_heavy_model, fused_attention_calls, sources

from aiayn.config import SearchConfig
from aiayn.inference.compiled import CompiledDecoder, _mark_dynamic, _shapes
from aiayn.inference.search import BeamLive, beam_candidates, greedy_candidates, search
from aiayn.inference.shortlist import Shortlist, Shortlisted
from aiayn.inference.static_cache import GROWTH, MANY, SENTENCES, SHRINK, dynamic, sized
from aiayn.model import Transformer
from aiayn.precision import for_inference
from aiayn.tokenizer import EOS_ID


@pytest.fixture(scope="module")
def decoders():
    """The eos_heavy_model and an in-memory CompiledDecoder of it, compiled without max_autotune (which
    only chooses among GEMM kernels, and would double the suite's compile time)."""
    model = eos_heavy_model()
    return model, CompiledDecoder(model, max_autotune=False)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compiled_search_returns_eager_hypotheses(decoders, beam_size):
    """Same tokens and scores, with hypotheses finishing at different steps (rows leave the batch) and
    a batch of 5 padded to 8 rows per hypothesis. Beam 4's hypotheses follow their parents through the
    cache's table of where each position's keys are (nothing is copied, sentences leaving included);
    greedy's rows are copied when sentences leave."""
    model, compiled = decoders
    src = sources(5, 9, seed=6)
    config = SearchConfig(beam_size=beam_size, n_best=beam_size, max_len_b=20)
    eager = search(model, src, config)
    fast = search(compiled, src, config)
    lengths = {len(h.tokens) for hyps in eager for h in hyps}
    assert len(lengths) > 3, "the hypotheses should end at different steps"
    assert [[h.tokens for h in hyps] for hyps in fast] == [[h.tokens for h in hyps] for hyps in eager]
    for got, want in zip(fast, eager):
        torch.testing.assert_close([h.score for h in got], [h.score for h in want], atol=1e-4, rtol=0)


def test_a_beams_reorder_moves_its_table_not_its_keys(decoders):
    """A beam step's reorder leaves the key/value buffers where they are (eager decoding copies 2L x (R, T_max,
    D) values a step) and gathers the table of where each row's positions are: row j now reads what row
    index[j] read. (The search tests above show the tokens that come out of it are eager's.)"""
    _, compiled = decoders
    with torch.inference_mode():
        cache = compiled.new_cache(compiled.encode(sources(2, 5, seed=3)), 6)
        cache.expand(4)  # 2 sentences x 4 hypotheses
        buffers = [(c.self_k.data_ptr(), c.self_v.data_ptr()) for c in cache.layers]
        before = cache.source.clone()  # (T_max, 8): row r's position t at r * T_max + t
        assert torch.equal(before, torch.arange(8) * 6 + torch.arange(6)[:, None])
        index = torch.tensor([1, 1, 0, 3, 6, 4, 4, 5])  # each sentence's rows from its own parents
        cache.reorder(index)
    assert [(c.self_k.data_ptr(), c.self_v.data_ptr()) for c in cache.layers] == buffers
    assert torch.equal(cache.source, before[:, index])
    assert all(c.source is cache.source for c in cache.layers)


def test_positions_never_written_hold_no_uninitialised_memory(decoders, monkeypatch):
    """A compiled step reads all T_max positions and masks the unwritten ones, but a masked weight of 0
    times a value that is NaN or inf is NaN. Uninitialised memory made NaN (torch.empty_like poisoned, after
    the graphs exist) must not change a token: every buffer a cache makes starts as zeros. (In CI, memory
    freed by other tests once turned a beam-4 search into one token repeated, when a reorder copied only
    the written positions into a buffer made empty.)"""
    model, compiled = decoders
    src = sources(5, 9, seed=1)
    config = SearchConfig(beam_size=4, n_best=4, max_len_b=20)
    eager = search(model, src, config)
    search(compiled, src, config)  # the graphs, traced with torch as it is
    nan_like = lambda t, **kw: torch.full_like(t, float("nan"), **kw)  # noqa: E731
    monkeypatch.setattr(torch, "empty_like", nan_like)
    fast = search(compiled, src, config)
    assert [[h.tokens for h in hyps] for hyps in fast] == [[h.tokens for h in hyps] for hyps in eager]


def test_one_graph_serves_every_source_length_and_batch_of_its_class(decoders):
    """After the first batch of a few sentences (2 to 7), other source lengths, output lengths and numbers
    of sentences of the class run without tracing again; a batch of many sentences (8 and more) must, its
    class being a graph of its own (the check can fail)."""
    model, compiled = decoders
    # a few sentences, ending at different steps (the last one live alone): compiled here if not yet
    search(compiled, sources(5, 9, seed=6), SearchConfig(beam_size=1, max_len_b=20))
    config = SearchConfig(beam_size=1, max_len_b=7)
    seconds = compiled.compile_seconds
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch, width in ((6, 4), (7, 23), (2, 12)):
            src = sources(batch, width, seed=batch)
            expected = [h[0].tokens for h in search(model, src, config)]
            assert [h[0].tokens for h in search(compiled, src, config)] == expected
        assert compiled.compile_seconds == seconds
        with pytest.raises(RuntimeError, match="(?i)recompil"):
            search(compiled, sources(8, 9, seed=2), config)  # many sentences: a graph of their own


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_searchs_own_work_is_one_graph_for_one_sentence_and_one_for_more(decoders, beam_size):
    """search.beam_candidates and search.greedy_candidates, compiled: the same hypotheses as eager, and
    sentences leaving the batch (5, 4, ... 1 live) or another vocabulary size of the logits run without
    tracing them again. (Batches of a few sentences of beam 1 and 4: the first test's rows, whose graphs it
    made; their sentences end at different steps, down to one live.)"""
    model, compiled = decoders
    config = SearchConfig(beam_size=beam_size, n_best=beam_size, max_len_b=20)
    for src in (sources(5, 9, seed=8), sources(3, 7, seed=9)):
        want = [[h.tokens for h in hyps] for hyps in search(model, src, config)]
        assert [[h.tokens for h in hyps] for hyps in search(compiled, src, config)] == want
    name = "beam" if beam_size > 1 else "greedy"
    assert {key[:2] for key in compiled._seen if key[0] == name} == {(name, 1), (name, 2)}, (
        "a graph for one live sentence and one for more"
    )
    with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():  # as search calls it
        if beam_size > 1:
            live = BeamLive(torch.zeros(3, 4), torch.full((3,), 9), torch.ones(3), torch.full((3, 4), -torch.inf),
                            torch.zeros(3, dtype=torch.long))  # fmt: skip
            args = (torch.randn(3, 4, V - 7), live, torch.ones(1, dtype=torch.long), 4, config.alpha,
                    config.length_penalty, config.stopping)  # fmt: skip
        else:
            args = (torch.randn(3, V - 7), torch.zeros(3), torch.full((3,), 9), torch.full((1,), 9))
        got = getattr(compiled, f"{name}_candidates")(*args)
        expected = (beam_candidates if beam_size > 1 else greedy_candidates)(*args)
        assert type(got) is type(expected) and len(got) == len(expected)  # BeamStep or GreedyStep
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # exact where not a float
    if beam_size == 1:
        assert expected[2].tolist() == [True] * 3 and expected[3]  # at its limit, every sentence is done
        torch.testing.assert_close(expected[1], torch.log_softmax(args[0], -1).max(-1).values)


def test_on_a_cpu_compiled_graphs_write_attention_out(decoders):
    """The compiled encoder and step compute attention as its arithmetic, which inductor fuses, instead of
    calling the fused SDPA kernel (its set-up alone cost 20-27 us a call: CompiledDecoder._tracing), and
    give eager's tokens; eager search calls the kernel (the count can fail)."""
    model, compiled = decoders
    src = sources(5, 9, seed=6)  # a few sentences, as the first test's: its graphs, if it ran
    config = SearchConfig(beam_size=1, max_len_b=8)
    assert fused_attention_calls(model, src, config) > 0
    want = [h[0].tokens for h in search(model, src, config)]
    assert [h[0].tokens for h in search(compiled, src, config)] == want  # compiled here if not yet
    assert fused_attention_calls(compiled, src, config) == 0


def test_a_batch_over_max_sentences_decodes_eagerly(decoders, monkeypatch):
    """The fixture's decoder told to compile batches of at most 2 sentences: a batch of 3 decodes eagerly to
    its end, its search's own work too when its live sentences come to fit (a graph loaded for a batch's
    last steps costs more than it saves); a batch of 2 then uses the graphs."""
    model, compiled = decoders
    monkeypatch.setattr(compiled, "max_sentences", 2)
    src = sources(3, 9, seed=3)
    config = SearchConfig(beam_size=4, n_best=4, max_len_b=20)
    want = [[h.tokens for h in hyps] for hyps in search(model, src, config)]
    calls = []
    monkeypatch.setattr(compiled, "calls", calls)
    assert [[h.tokens for h in hyps] for hyps in search(compiled, src, config)] == want
    lengths = [len(h[0].tokens) for h in search(model, src, config)]
    assert len(set(lengths)) > 1, "the sentences should end at different steps"
    assert calls == []
    assert [[h.tokens for h in hyps] for hyps in search(compiled, src[:2], config)] == want[:2]
    assert calls


def test_a_steps_work_follows_the_live_sentences_and_the_positions_written(decoders, monkeypatch):
    """A batch of the few class, beam 4 (the graphs of the test above): each step computes at most the live
    rows / SHRINK (or the class's fewest sentences' rows), and its buffers hold at most GROWTH positions
    past those written; the rows shrink and the buffers grow during the batch, and the tokens and scores
    are eager's."""
    model, compiled = decoders
    src = sources(MANY - 1, 9, seed=6)
    config = SearchConfig(beam_size=4, n_best=2, max_len_a=0.0, max_len_b=40)
    seen = []
    step = compiled.decode

    def decode(tgt_in, memory, cache=None):
        logits = step(tgt_in, memory, cache)
        seen.append((tgt_in.size(0), cache.rows, cache.layers[0].self_k.size(1), cache.written))
        return logits

    monkeypatch.setattr(compiled, "decode", decode)
    fast, eager = search(compiled, src, config), search(model, src, config)
    assert [[h.tokens for h in hyps] for hyps in fast] == [[h.tokens for h in hyps] for hyps in eager]
    for got, want in zip(fast, eager):
        torch.testing.assert_close([h.score for h in got], [h.score for h in want], atol=1e-4, rtol=0)
    for live, rows, positions, written in seen:
        assert (
            live <= rows <= max(live / SHRINK, SENTENCES["few"][0] * 4)
            and written <= positions < written + GROWTH
        )
    assert len({rows for _, rows, _, _ in seen}) > 1 and len({T for _, _, T, _ in seen}) > 1


def test_dynamic_sizes_are_marked_for_dynamo_as_dynamo_marks_them():
    """`dynamic` and `sized` record the sizes on the tensor without importing dynamo; torch.compile in
    memory gets dynamo's own marks of them (_mark_dynamic), the same as marking them directly."""
    ours, theirs = torch.zeros(8, 5, 3), torch.zeros(8, 5, 3)
    sized(dynamic(ours, 1), 0, "many")
    _mark_dynamic((ours,))
    torch._dynamo.maybe_mark_dynamic(theirs, 1)
    torch._dynamo.maybe_mark_dynamic(theirs, 0)
    torch._dynamo.mark_dynamic(theirs, 0, min=SENTENCES["many"][0], max=SENTENCES["many"][1])
    for name in ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_dynamo_dynamic_range"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_compiled_int8_returns_eager_int8_tokens(decoders):
    """The int8 layers (precision.Int8Linear) compile into the same graph shape and give eager's tokens."""
    model, _ = decoders
    int8 = for_inference(model, "int8")
    compiled = CompiledDecoder(int8, max_autotune=False)
    src = sources(1, 9, seed=4)  # one sentence of beam 4: the fewest graphs with a beam (each costs seconds)
    config = SearchConfig(beam_size=4, n_best=4, max_len_b=20)
    want = [[h.tokens for h in hyps] for hyps in search(int8, src, config)]
    assert [[h.tokens for h in hyps] for hyps in search(compiled, src, config)] == want


def test_two_decoders_keep_their_own_weights(decoders):
    """Two models of one architecture compiled in one process, called in turn: each decoder's graphs hold
    its own model's weights (frozen in as constants), so each gives its own eager tokens."""
    model, compiled = decoders
    torch.manual_seed(1)
    other = Transformer(model.config).eval()
    with torch.no_grad():
        other.tgt_embed.tokens.weight[EOS_ID] *= 2
    second = CompiledDecoder(other, max_autotune=False)
    src = sources(5, 9, seed=5)
    config = SearchConfig(beam_size=1, max_len_b=20)
    want = [[h[0].tokens for h in search(m, src, config)] for m in (model, other)]
    assert want[0] != want[1]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [h[0].tokens for h in search(second, src, config)] == want[1]
    # the memory (encoder and cross keys/values) and the step, each traced once (sentences leaving the
    # batch change no stride or aliasing the step's graph was traced for)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    for decoder, tokens in ((compiled, want[0]), (second, want[1]), (compiled, want[0]), (second, want[1])):
        assert [h[0].tokens for h in search(decoder, src, config)] == tokens


def test_a_shortlist_keeps_the_compiled_decoders_own_step_work(decoders, monkeypatch):
    """`--compile --shortlist`: the shortlist wraps the compiled decoder and passes on every step of it,
    the search's own work after each decoding step included (a wrapper that forwarded only encode,
    new_cache and decode left that work eager, silently). Greedy on the compiled graphs; beam 4 through a
    decoder that decodes every batch eagerly (max_sentences=0), which shows the forwarding alone."""
    model, compiled = decoders
    shortlist = Shortlist(torch.tensor([1, 2, 3]), torch.arange(V)[:, None])  # a source token allows itself
    src = sources(3, 7, seed=9)  # a few sentences: the class whose graphs the tests above made
    for decoder, config, work in (
        (compiled, SearchConfig(beam_size=1, max_len_b=20), "greedy_candidates"),
        (CompiledDecoder(model, max_sentences=0), SearchConfig(beam_size=4, max_len_b=20), "beam_candidates"),
    ):
        calls, real = [], getattr(decoder, work)
        monkeypatch.setattr(
            decoder, work, lambda *args, real=real, calls=calls: calls.append(1) or real(*args)
        )
        got = search(Shortlisted(decoder, shortlist), src, config)
        want = search(Shortlisted(model, shortlist), src, config)
        assert calls, f"the compiled decoder's {work} did not run"
        assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in want]


def test_making_a_compiled_decoder_leaves_dynamos_settings_to_the_process(decoders):
    """The recompile limit and the refusal to fall back to eager hold while a graph is traced (compiled.
    dynamo_limits), not from the moment a decoder exists: a library call must not change the process."""
    model, _ = decoders
    with torch._dynamo.config.patch(recompile_limit=7, fail_on_recompile_limit_hit=False):
        CompiledDecoder(model, max_autotune=False)
        assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == (
            7,
            False,
        )


@pytest.mark.parametrize("row_class", ["few", "many"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_every_size_export_is_told_of_has_a_bound(row_class, rows):
    """torch.export needs a finite bound on every dynamic size, the rows (N times the sentences) included:
    a class of sentences without a most one was refused, at the compile of the many class's beam step,
    with export's "Expected derived max value of 4*sentences to be <= ..." (no compile needed to see it)."""
    sentences = sized(torch.zeros(MANY if row_class == "many" else 2, 5), 0, row_class)
    cache = sized(torch.zeros(rows * sentences.size(0), 5), 0, row_class, "rows")
    dims = [d for shape in _shapes(("step", row_class, rows), (sentences, cache)) for d in shape.values()]
    least, most = SENTENCES[row_class]
    assert [(d.min, d.max) for d in dims] == [(least, most), (rows * least, rows * most)]
    assert most * rows * 64 < torch.iinfo(torch.int64).max  # a row count, times a width, stays an index
