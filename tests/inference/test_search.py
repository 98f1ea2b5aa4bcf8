"""Tests for aiayn.inference.search: hand-worked beams on a scripted model, beam 1 == greedy, cached == naive
full-prefix search, batched == one at a time, maximum lengths, and dropping finished sentences."""

import math
from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor, nn

from aiayn.config import SearchConfig, preset
from aiayn.inference.search import (
    FIRST_OUTPUT,
    Hypothesis,
    beam_search,
    greedy_search,
    length_penalty,
    max_lengths,
    search,
    top_k,
)
from aiayn.model import Memory, Transformer

PAD, BOS, E = 0, 1, 2  # E: end of sentence; 3, 4, 5 are ordinary tokens of the scripted model

# --- A scripted model: next-token probabilities from a table keyed by (source id, prefix) ----------

# Sentence 3, "trap": greedy takes 3 (p .5) and ends with 3 5 E (.5 * .35 * .9 = .1575);
# beam 2 also keeps 4 (p .4), which ends at once: 4 E (.4 * .9 = .36).
TRAP = {
    (): {3: 0.5, 4: 0.4, 5: 0.06, E: 0.04},
    (3,): {5: 0.35, 4: 0.3, 3: 0.25, E: 0.1},
    (4,): {E: 0.9, 3: 0.05, 4: 0.03, 5: 0.02},
    (3, 5): {E: 0.9, 3: 0.05, 4: 0.03, 5: 0.02},
    (3, 4): {3: 0.7, E: 0.2, 4: 0.06, 5: 0.04},
}
# Sentence 4, "penalty": 3 E (.6 * .5 = .3, |Y| = 2) against 3 5 E (.6 * .45 * .9 = .243, |Y| = 3):
# gnmt 0.6 prefers the short one, average 0.6 (|Y|^0.6 grows faster) the long one.
PENALTY = {
    (): {3: 0.6, 4: 0.38, 5: 0.015, E: 0.005},
    (3,): {E: 0.5, 5: 0.45, 3: 0.03, 4: 0.02},
    (3, 5): {E: 0.9, 3: 0.04, 4: 0.035, 5: 0.025},
}
DEFAULT = {E: 0.7, 3: 0.12, 4: 0.1, 5: 0.08}  # any prefix not in the table
LONG = {3: 0.6, 4: 0.25, 5: 0.1, E: 0.05}  # sentence 5: every prefix; runs to its maximum length
TABLES = {3: TRAP, 4: PENALTY}


def next_log_probs(sentence: int, prefix: tuple[int, ...]) -> list[float]:
    probs = LONG if sentence == 5 else TABLES[sentence].get(prefix, DEFAULT)
    assert math.isclose(sum(probs.values()), 1.0)
    out = [-50.0] * 6  # pad and BOS: never chosen (exp(-50) vanishes next to 1 in float32)
    for token, p in probs.items():
        out[token] = math.log(p)
    return out


@dataclass
class ScriptedCache:
    sentence: Tensor  # (B,) the scripted sentence of each row
    prefix: Tensor  # (B, T) BOS and the tokens fed so far

    def expand(self, beam: int) -> None:
        self.reorder(torch.arange(self.sentence.size(0)).repeat_interleave(beam))

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        self.sentence, self.prefix = self.sentence[index], self.prefix[index]


class ScriptedModel(nn.Module):
    """encode/new_cache/decode like Transformer; the first source token picks the table."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []  # batch rows of every decode call: the work done

    def encode(self, src: Tensor) -> Memory:
        return Memory(src[:, :1, None].float(), None)  # (B, 1, 1): the sentence id

    def new_cache(self, memory: Memory, max_len: int) -> ScriptedCache:
        sentence = memory.states[:, 0, 0].long()
        return ScriptedCache(sentence, sentence.new_empty(sentence.size(0), 0))

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache: ScriptedCache | None = None) -> Tensor:
        self.rows.append(tgt_in.size(0))
        if cache is None:  # the whole prefix: log-probs after each of its positions
            sentence = memory.states[:, 0, 0].long()  # (B,)
            prefix, first = tgt_in, 0
        else:  # like Transformer: what the rows need of the source is in the cache
            sentence = cache.sentence  # (B,)
            cache.prefix = torch.cat([cache.prefix, tgt_in], dim=1)
            prefix, first = cache.prefix, cache.prefix.size(1) - tgt_in.size(1)
        assert bool((prefix[:, 0] == BOS).all())
        out = [
            [next_log_probs(s, tuple(p[1 : i + 1])) for i in range(first, len(p))]
            for s, p in zip(sentence.tolist(), prefix.tolist())
        ]
        return torch.tensor(out)  # (B, L, V)


def gnmt(length: int, alpha: float = 0.6) -> float:
    return ((5 + length) / 6) ** alpha  # Wu et al. 2016; length counts EOS


def check(hyps: list[Hypothesis], expected: list[tuple[list[int], float, float]]) -> None:
    assert [h.tokens for h in hyps] == [tokens for tokens, _, _ in expected]
    for h, (_, score, log_prob) in zip(hyps, expected):
        assert h.score == pytest.approx(score, rel=1e-5)
        assert h.log_prob == pytest.approx(log_prob, rel=1e-5)


# Maximum length 0 * 1 + 5 = 5 tokens for every scripted sentence unless a test says otherwise.
SCRIPTED = SearchConfig(beam_size=2, alpha=0.6, max_len_a=0.0, max_len_b=5, stopping="exact")


def test_length_penalty_formulas() -> None:
    assert length_penalty(2, 0.6) == pytest.approx((7 / 6) ** 0.6)
    assert length_penalty(2, 0.6, "average") == pytest.approx(2**0.6)
    assert length_penalty(7, 0.0) == 1.0 and length_penalty(7, 0.0, "average") == 1.0
    lengths = torch.tensor([1, 4, 10])
    expected = [((5 + n) / 6) ** 0.6 for n in (1, 4, 10)]
    assert length_penalty(lengths, 0.6).tolist() == pytest.approx(expected)
    assert length_penalty(lengths, 1.0, "average").tolist() == pytest.approx([1.0, 4.0, 10.0])
    with pytest.raises(ValueError, match="unknown length penalty"):
        length_penalty(3, 0.6, "wu")


def test_max_lengths_from_the_source_length() -> None:
    src = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0], [5, 6, 7, 8]])
    config = SearchConfig(max_len_a=1.5, max_len_b=2)
    assert max_lengths(src, config).tolist() == [6, 3, 8]  # floor(1.5 * n + 2)
    assert max_lengths(src, SearchConfig()).tolist() == [53, 51, 54]  # §6.1: input + 50
    with pytest.raises(ValueError, match="at least 1"):
        greedy_search(ScriptedModel(), src, max_len=0)
    with pytest.raises(ValueError, match="tensor"):
        greedy_search(ScriptedModel(), src, max_len=torch.tensor([3, 3]))


def test_greedy_takes_the_locally_best_token() -> None:
    model = ScriptedModel()
    assert greedy_search(model, torch.tensor([[3]]), max_len=5) == [[3, 5]]
    (hyp,) = search(model, torch.tensor([[3]]), SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=5))[0]
    log_prob = math.log(0.5 * 0.35 * 0.9)
    check([hyp], [([3, 5], log_prob / gnmt(3), log_prob)])


def test_beam_two_finds_the_better_sequence_with_exact_scores() -> None:
    """Step 1: 3 (.5), 4 (.4) live. Step 2: 4 E (.36) ranks first and finishes; 3 5 (.175) and 3 4 (.15)
    stay live, but even 3 5 cannot reach -0.931 any more: ln .175 / lp(5) = -1.283. Done."""
    model = ScriptedModel()
    (hyps,) = beam_search(model, torch.tensor([[3]]), SCRIPTED)
    check(hyps, [([4], math.log(0.36) / gnmt(2), math.log(0.36))])
    assert len(model.rows) == 2  # stopped after two steps, not at the maximum length


def test_n_best_ordering() -> None:
    """With n_best 2, step 3 goes on: 3 5 E (.1575) ranks first and finishes; 3 4 E (.03) ranks third,
    outside the beam, and is dropped; the live 3 4 3 (.105) is bounded by ln .105 / lp(5) = -1.659,
    below 3 5 E's -1.555. Done, best first."""
    (hyps,) = beam_search(ScriptedModel(), torch.tensor([[3]]), replace(SCRIPTED, n_best=2))
    check(
        hyps,
        [
            ([4], math.log(0.36) / gnmt(2), math.log(0.36)),
            ([3, 5], math.log(0.1575) / gnmt(3), math.log(0.1575)),
        ],
    )
    assert hyps[0].score > hyps[1].score


def test_average_penalty_changes_the_winner() -> None:
    """Both searches finish 3 E at step 2 and 3 5 E at step 3; only the ranking differs."""
    src = torch.tensor([[4]])
    short, long = math.log(0.6 * 0.5), math.log(0.6 * 0.45 * 0.9)
    gnmt_config = SearchConfig(beam_size=2, alpha=0.6, max_len_a=0.0, max_len_b=4)
    average_config = replace(gnmt_config, length_penalty="average")
    assert short / gnmt(2) > long / gnmt(3) and short / 2**0.6 < long / 3**0.6  # the case is as built
    check(beam_search(ScriptedModel(), src, gnmt_config)[0], [([3], short / gnmt(2), short)])
    check(beam_search(ScriptedModel(), src, average_config)[0], [([3, 5], long / 3**0.6, long)])


def test_beam_one_follows_greedy_on_the_scripted_model() -> None:
    config = replace(SCRIPTED, beam_size=1)
    (hyps,) = beam_search(ScriptedModel(), torch.tensor([[3]]), config)
    check(hyps, [([3, 5], math.log(0.1575) / gnmt(3), math.log(0.1575))])


def test_finished_sentences_leave_the_batch() -> None:
    """ "trap" (source length 1, at most 5 tokens) is done after step 2; "long" (source length 3, at
    most 7 tokens) runs to its maximum. Both equal their results alone, and after step 2 only the
    2 rows of "long" are decoded."""
    config = SearchConfig(beam_size=2, alpha=0.6, max_len_a=1.0, max_len_b=4, stopping="exact")
    src = torch.tensor([[3, 0, 0], [5, 7, 7]])
    model = ScriptedModel()
    together = beam_search(model, src, config)
    assert model.rows == [4, 4, 2, 2, 2, 2, 2]
    assert together[0] == beam_search(ScriptedModel(), src[:1, :1], config)[0]
    assert together[1] == beam_search(ScriptedModel(), src[1:], config)[0]
    assert together[0][0].tokens == [4] and len(together[1][0].tokens) == 7  # "long" ends without EOS

    model = ScriptedModel()
    assert greedy_search(model, src, max_len=max_lengths(src, config)) == [[3, 5], [3] * 7]
    assert model.rows == [2, 2, 2, 1, 1, 1, 1]


# --- A random tiny Transformer --------------------------------------------------------------------

V = 20
SEEDS = [9, 12, 14, 15]  # seeds whose outputs end both in EOS and at the maximum length
CONFIG = SearchConfig(beam_size=3, alpha=0.6, max_len_a=1.0, max_len_b=3)


def tiny_model(seed: int) -> Transformer:
    """Random weights. Untied output: with the embedding tied to the output (and the residual
    carrying it), a random model just repeats its last token, which would test little."""
    torch.manual_seed(seed)
    return Transformer(preset("tiny", vocab_size=V, share_embeddings=False, tie_output=False)).eval()


def random_batch(seed: int, lengths: tuple[int, ...] = (5, 1, 7, 3, 6, 2, 4)) -> Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(3, V, (n,), generator=g)
    return src  # (B, S) padded


def naive_greedy(model: Transformer, src: Tensor, limit: int) -> list[int]:
    """No cache: the whole prefix through model(src, prefix) every step."""
    prefix = [BOS]
    for _ in range(limit):
        token = FIRST_OUTPUT + int(model(src, torch.tensor([prefix]))[0, -1, FIRST_OUTPUT:].argmax())
        if token == E:
            break
        prefix.append(token)
    return prefix[1:]


def naive_beam(model: Transformer, src: Tensor, config: SearchConfig, limit: int) -> list[Hypothesis]:
    """The same beam algorithm for one sentence, in Python lists, without a cache, with either stopping rule."""
    N = config.beam_size
    live: list[tuple[list[int], float]] = [([], 0.0)]  # one beam on the first step
    finished: list[Hypothesis] = []
    for t in range(limit):
        prefixes = torch.tensor([[BOS, *tokens] for tokens, _ in live])
        logits = model(src.expand(len(live), -1), prefixes)[:, -1]
        lprobs = torch.log_softmax(logits.float(), dim=-1).tolist()
        candidates = sorted(
            (
                (score + lp[v], tokens, v)
                for (tokens, score), lp in zip(live, lprobs)
                for v in range(FIRST_OUTPUT, V)
            ),
            key=lambda c: -c[0],
        )[: 2 * N]
        for score, tokens, v in candidates[:N]:
            if v == E or t + 1 == limit:
                kept = tokens if v == E else [*tokens, v]
                finished.append(Hypothesis(kept, score / length_penalty(t + 1, config.alpha), score))
        if t + 1 == limit:
            break
        live = [([*tokens, v], score) for score, tokens, v in candidates if v != E][:N]
        if config.stopping == "beam" and len(finished) >= N:
            break
        best = sorted((h.score for h in finished), reverse=True)[: config.n_best]
        bound = live[0][1] / length_penalty(limit, config.alpha)
        if config.stopping == "exact" and len(best) == config.n_best and bound <= best[-1]:
            break
    return sorted(finished, key=lambda h: h.score, reverse=True)[: config.n_best]


def same(got: list[Hypothesis], expected: list[Hypothesis]) -> None:
    assert [h.tokens for h in got] == [h.tokens for h in expected]
    assert [h.score for h in got] == pytest.approx([h.score for h in expected], rel=1e-4)
    assert [h.log_prob for h in got] == pytest.approx([h.log_prob for h in expected], rel=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_beam_one_equals_greedy(seed: int) -> None:
    model, src = tiny_model(seed), random_batch(seed)
    limit = max_lengths(src, CONFIG)
    greedy = search(model, src, replace(CONFIG, beam_size=1))
    tokens = greedy_search(model, src, max_len=limit)
    assert [h[0].tokens for h in greedy] == tokens
    # Without a length penalty beam 1 must stop at greedy's EOS: nothing live can beat it.
    beam_one = beam_search(model, src, replace(CONFIG, beam_size=1, alpha=0.0))
    for (b,), (g,) in zip(beam_one, greedy):
        assert b.tokens == g.tokens and b.log_prob == pytest.approx(g.log_prob, rel=1e-5)
    # Stopping at one finished hypothesis, beam 1 is greedy; stopping exactly, it may go on past
    # greedy's EOS, and then only for a better score.
    beam_one = beam_search(model, src, replace(CONFIG, beam_size=1))
    assert [b.tokens for (b,) in beam_one] == [g.tokens for (g,) in greedy]
    beam_one = beam_search(model, src, replace(CONFIG, beam_size=1, stopping="exact"))
    for (b,), (g,) in zip(beam_one, greedy):
        assert b.score >= g.score - 1e-6
        if b.tokens != g.tokens:
            assert b.score > g.score


@pytest.mark.parametrize("stopping", ["beam", "exact"])
@pytest.mark.parametrize("seed", SEEDS)
def test_cached_search_equals_naive_full_prefix_search(seed: int, stopping: str) -> None:
    model, src = tiny_model(seed), random_batch(seed)
    limit = max_lengths(src, CONFIG).tolist()
    config = replace(CONFIG, n_best=2, stopping=stopping)
    greedy = greedy_search(model, src, max_len=max_lengths(src, CONFIG))
    beams = beam_search(model, src, config)
    with torch.inference_mode():
        for i, n in enumerate(limit):
            one = src[i : i + 1, : int((src[i] != PAD).sum())]  # (1, S_i) unpadded
            assert greedy[i] == naive_greedy(model, one, n)
            same(beams[i], naive_beam(model, one, config, n))
    ended = [len(h[0].tokens) < n for h, n in zip(beams, limit)]
    assert any(ended) and not all(ended), "the test should see both EOS and maximum-length endings"


def test_beam_stopping_is_exact_stopping_cut_short() -> None:
    """The two rules follow the same beams; "beam" stops a sentence at its N-th finished hypothesis, so
    with n_best = N "exact" finds those N and perhaps more: its best is at least as good, and it never
    stops sooner (over the seeds, it decodes more rows)."""
    config = replace(CONFIG, n_best=3)
    rows = {"beam": 0, "exact": 0}
    for seed in SEEDS:
        model, src = tiny_model(seed), random_batch(seed)
        found = {}
        for stopping in rows:
            counted = Counted(model)
            found[stopping] = beam_search(counted, src, replace(config, stopping=stopping))
            rows[stopping] += sum(counted.rows)
            assert all(len(hyps) == 3 for hyps in found[stopping])
        for exact, cut_short in zip(found["exact"], found["beam"]):
            assert exact[0].score >= cut_short[0].score - 1e-6
    assert rows["beam"] < rows["exact"], rows


class Counted(nn.Module):
    """A model that notes the rows of each decoding step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.rows = model, []

    def encode(self, src: Tensor) -> Memory:
        return self.model.encode(src)

    def new_cache(self, memory: Memory, max_len: int):
        return self.model.new_cache(memory, max_len)

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache=None) -> Tensor:
        self.rows.append(tgt_in.size(0))
        return self.model.decode(tgt_in, memory, cache)


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_equals_one_at_a_time(seed: int) -> None:
    model, src = tiny_model(seed), random_batch(seed)
    config = replace(CONFIG, n_best=3)
    batched = beam_search(model, src, config)
    greedy = greedy_search(model, src, max_len=max_lengths(src, config))
    for i in range(src.size(0)):
        one = src[i : i + 1, : int((src[i] != PAD).sum())]
        same(batched[i], beam_search(model, one, config)[0])
        assert greedy[i] == greedy_search(model, one, max_len=max_lengths(one, config))[0]
        assert len(batched[i]) == 3
        assert [h.score for h in batched[i]] == sorted((h.score for h in batched[i]), reverse=True)
    reversed_order = beam_search(model, src.flip(0), config)
    for a, b in zip(batched, reversed(reversed_order)):
        same(a, b)


@pytest.mark.parametrize("kind", ["gnmt", "average"])
def test_maximum_length_is_respected(kind: str) -> None:
    model, src = tiny_model(0), random_batch(0)
    config = SearchConfig(beam_size=4, n_best=4, max_len_a=0.5, max_len_b=2, length_penalty=kind)
    limit = max_lengths(src, config).tolist()  # floor(n / 2) + 2
    assert limit == [4, 2, 5, 3, 5, 3, 4]
    for hyps, n in zip(search(model, src, config), limit):
        assert all(len(h.tokens) <= n for h in hyps)
    for tokens, n in zip(greedy_search(model, src, max_len=torch.tensor(limit)), limit):
        assert len(tokens) <= n


class NoEos(nn.Module):
    """A model that never ends a sentence (as speed benchmarks use): EOS gets no probability."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def encode(self, src: Tensor) -> Memory:
        return self.model.encode(src)

    def new_cache(self, memory: Memory, max_len: int):
        return self.model.new_cache(memory, max_len)

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache=None) -> Tensor:
        logits = self.model.decode(tgt_in, memory, cache)
        logits[..., E] = -math.inf
        return logits


def test_a_sentence_without_eos_runs_to_exactly_its_maximum_length() -> None:
    model, src = NoEos(tiny_model(1)), random_batch(1)
    assert all(len(t) == 24 for t in greedy_search(model, src, max_len=24))
    for hyps in beam_search(model, src, CONFIG, max_len=24):
        assert len(hyps[0].tokens) == 24 and E not in hyps[0].tokens
    limit = max_lengths(src, CONFIG)
    for hyps, n in zip(search(model, src, CONFIG), limit.tolist()):
        assert len(hyps[0].tokens) == n


def test_empty_batch() -> None:
    src = torch.zeros(0, 4, dtype=torch.long)
    assert greedy_search(tiny_model(0), src, max_len=5) == []
    assert beam_search(tiny_model(0), src, CONFIG) == []


@pytest.mark.parametrize(
    "shape, k",
    [
        ((1, 4, 8000), 8),  # beam 4 over a vocabulary of `small`: V a multiple of the block
        ((3, 4, 8001), 8),  # a last block with one value
        ((2, 2, 7), 4),  # fewer blocks in V than k: rows are padded to k blocks in all
        ((2, 16, 1000), 32),
    ],
)
def test_top_k_by_blocks_equals_torch_topk(shape: tuple[int, int, int], k: int) -> None:
    """top_k (blocks' maxima first) returns torch.topk's values and, distinct values given, its positions."""
    B, N, V = shape
    x = torch.randn(generator=torch.Generator().manual_seed(V), size=shape)
    values, index = top_k(x, k)
    expected = x.view(B, N * V).topk(k, dim=1)
    assert torch.equal(values, expected.values)
    assert torch.equal(index, expected.indices)


def test_top_k_by_blocks_with_ties_and_minus_infinity() -> None:
    """Equal values: the same k values, at positions that hold them. A sentence with fewer than k finite
    values (the first beam step of a tiny vocabulary, or EOS suppressed): -inf at real positions."""
    x = torch.randint(0, 4, (3, 4, 300), generator=torch.Generator().manual_seed(1)).float()  # many ties
    values, index = top_k(x, 8)
    assert torch.equal(values, x.view(3, -1).topk(8, dim=1).values)
    assert torch.equal(x.view(3, -1).gather(1, index), values)
    assert all(row.unique().numel() == 8 for row in index)  # distinct positions

    x = torch.full((1, 2, 40), -math.inf)
    x[0, 0, :3] = torch.tensor([1.0, 3.0, 2.0])
    values, index = top_k(x, 8)
    assert values[0, :3].tolist() == [3.0, 2.0, 1.0] and index[0, :3].tolist() == [1, 2, 0]
    assert values[0, 3:].eq(-math.inf).all() and index.lt(80).all() and index.ge(0).all()
