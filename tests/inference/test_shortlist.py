"""The output-layer shortlist (shortlist.py): the Dice statistics against a count written here, the vmap.txt
file both ways, and decoding with it against decoding without."""

import itertools
import json

import numpy as np
import pytest
import torch

from aiayn.checkpoint import load_model
from aiayn.config import SearchConfig, preset
from aiayn.inference.search import search
from aiayn.inference.shortlist import VMAP_FILE, Shortlist, Shortlisted
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, Tokenizer
from tests.conftest import assert_one_line_error, run_cli

SRC = ["der hund läuft", "die katze schläft", "der hund schläft", "ein hund und eine katze", "die sonne"]
TGT = ["the dog runs", "the cat sleeps", "the dog sleeps", "a dog and a cat", "the sun"]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(SRC, TGT, vocab_size=100, kind="word", joint=False, min_frequency=1)


def naive_dice(src: list[list[int]], tgt: list[list[int]]) -> dict[tuple[int, int], float]:
    """2 c(s, t) / (c(s) + c(t)), counts of sentence pairs, by brute force."""
    c_s, c_t, c_st = {}, {}, {}
    for s_ids, t_ids in zip(src, tgt):
        for s in set(s_ids):
            c_s[s] = c_s.get(s, 0) + 1
        for t in set(t_ids):
            c_t[t] = c_t.get(t, 0) + 1
        for s, t in itertools.product(set(s_ids), set(t_ids)):
            c_st[s, t] = c_st.get((s, t), 0) + 1
    return {(s, t): 2 * c / (c_s[s] + c_t[t]) for (s, t), c in c_st.items()}


def test_learn_keeps_the_best_dice_targets_of_each_source_token_and_the_most_frequent(tokenizer):
    src, tgt = tokenizer.encode_src(SRC), tokenizer.encode_tgt(TGT)
    shortlist = Shortlist.learn([np.array(x) for x in src], [np.array(x) for x in tgt], 100, 100, 3, 2)
    dice = naive_dice(src, tgt)
    for s in {s for x in src for s in x}:
        ranked = sorted((t for (s2, t) in dice if s2 == s), key=lambda t: (-dice[s, t], t))[:3]
        assert shortlist.by_source[s, : len(ranked)].tolist() == ranked
    [dog] = tokenizer.encode_tgt(["dog"])[0][:1]
    [hund] = tokenizer.encode_src(["hund"])[0][:1]
    assert shortlist.by_source[hund, 0] == dog  # 3 of 3 sentences together: Dice 1
    [the] = tokenizer.encode_tgt(["the"])[0][:1]
    assert the in shortlist.always.tolist() and EOS_ID in shortlist.always.tolist()  # 4 sentences; special


def test_vmap_file_round_trips_and_names_a_bad_line(tokenizer, tmp_path):
    src, tgt = tokenizer.encode_src(SRC), tokenizer.encode_tgt(TGT)
    shortlist = Shortlist.learn([np.array(x) for x in src], [np.array(x) for x in tgt], 100, 100, 3, 2)
    shortlist.save(tmp_path / VMAP_FILE, tokenizer)
    lines = (tmp_path / VMAP_FILE).read_text().splitlines()
    rules = dict(line.split("\t") for line in lines[1:])
    [hund], [dog] = tokenizer.encode_src(["hund"])[0][:1], tokenizer.encode_tgt(["dog"])[0][:1]
    assert lines[0].startswith("\t")  # the tokens always allowed
    assert rules[tokenizer.src_tokens()[hund]].split(" ")[0] == tokenizer.tgt_tokens()[dog]
    again = Shortlist.load(tmp_path / VMAP_FILE, tokenizer)
    assert torch.equal(again.always, shortlist.always)
    for ids in ([src[0]], [src[3], src[4]]):
        batch = torch.tensor(list(itertools.chain(*ids)))[None]
        assert torch.equal(again.candidates(batch), shortlist.candidates(batch))
    dog_token, hund_token = tokenizer.tgt_tokens()[dog], tokenizer.src_tokens()[hund]
    (tmp_path / "bad.txt").write_text(f"\t{dog_token}\n{hund_token}\t{dog_token} zebra\n")
    with pytest.raises(ValueError, match=r"bad.txt, line 2: 'zebra' is not in the target vocabulary"):
        Shortlist.load(tmp_path / "bad.txt", tokenizer)


@pytest.mark.parametrize("output_bias", [False, True], ids=["no bias", "output bias"])
def test_decoding_with_a_shortlist_gives_the_candidates_the_full_logits_and_the_others_none(output_bias):
    """The candidates' logits are the full projection's, an imported model's output bias included."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=50, output_bias=output_bias)).eval()
    if output_bias:
        torch.nn.init.normal_(model.generator.bias, std=3.0)
    src = torch.randint(4, 50, (2, 6))
    vocabulary = torch.tensor([1, 2, 3, 7, 9, 30])
    with torch.no_grad():
        memory = model.encode(src)
        full = model.decode(torch.ones(2, 1, dtype=torch.long), memory, model.new_cache(memory, 5))
        memory.vocabulary = vocabulary
        short = model.decode(torch.ones(2, 1, dtype=torch.long), memory, model.new_cache(memory, 5))
    torch.testing.assert_close(short[..., vocabulary], full[..., vocabulary])
    others = torch.ones(50, dtype=torch.bool)
    others[vocabulary] = False
    assert torch.isneginf(short[..., others]).all()


@pytest.mark.parametrize("beam_size", [1, 4])
def test_search_with_a_shortlist_of_every_token_is_search_without(served_model, beam_size):
    model = load_model(served_model, torch.device("cpu")).eval()
    V = model.config.tgt_vocab_size
    everything = Shortlist(torch.arange(1, V), torch.full((model.config.src_vocab_size, 1), EOS_ID))
    src = torch.randint(4, model.config.src_vocab_size, (3, 7))
    config = SearchConfig(beam_size=beam_size)
    want = search(model, src, config)
    got = search(Shortlisted(model, everything), src, config)
    assert [[h.tokens for h in x] for x in got] == [[h.tokens for h in x] for x in want]
    small = Shortlist(torch.tensor([1, 2, 3]), torch.tensor(range(model.config.src_vocab_size))[:, None])
    for hyps in search(Shortlisted(model, small), src, config):
        allowed = set(small.candidates(src).tolist())
        assert set(hyps[0].tokens) <= allowed


def test_cli_learns_a_shortlist_and_translates_with_it(served_model, tmp_path):
    code, out, err = run_cli(["shortlist", served_model, "--per-token", "5", "--frequent", "10"])
    assert code == 0, err
    assert json.loads(out)["out"] == str(served_model / VMAP_FILE)
    source = tmp_path / "in.txt"
    source.write_text("a b c\nd e\n")
    code, out, err = run_cli(["translate", served_model, "--input", source, "--shortlist", "--quiet"])
    assert code == 0 and len(out.splitlines()) == 2, err
    (served_model / VMAP_FILE).unlink()
    code, out, err = run_cli(["translate", served_model, "--input", source, "--shortlist"])
    assert_one_line_error(code, err, "no vmap.txt", "aiayn shortlist")
