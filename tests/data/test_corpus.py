"""Tests for aiayn/data/corpus.py: reading parallel text, cleaning, splitting and token-budget batching."""

import gzip
import io
import json
import os
import random
import sys
import threading

import datasets
import pytest
import torch

from aiayn.data.corpus import (
    clean_pairs,
    collate,
    filter_lengths,
    make_batches,
    read_hf,
    read_lines,
    read_pairs,
    read_parallel,
    read_tsv,
    split_valid,
)
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID


def write(path, data: bytes):
    path.write_bytes(data)
    return path


# Reading ---------------------------------------------------------------------------------------------------


def test_read_parallel_strips_only_the_newline(tmp_path):
    write(tmp_path / "p.de", b"Hallo  \r\nWelt\n\n\tTab\n")
    write(tmp_path / "p.en", "Hello\nWörld\n \nTab\t".encode())  # no final newline
    src, tgt = read_parallel(tmp_path / "p", "de", "en")
    assert src == ["Hallo  ", "Welt", "", "\tTab"]
    assert tgt == ["Hello", "Wörld", " ", "Tab\t"]


def test_read_parallel_keeps_unicode_line_separators_inside_a_line(tmp_path):
    # str.splitlines() would cut these lines in two and misalign the corpus.
    write(tmp_path / "p.de", "a\u2028b\x85c\rd\n".encode())
    write(tmp_path / "p.en", b"x\n")
    assert read_parallel(tmp_path / "p", "de", "en") == (["a\u2028b\x85c\rd"], ["x"])


def test_gz_and_plain_read_the_same(tmp_path):
    src = "Ein Haus.\r\nZwei Häuser.\n"
    tgt = "A house.\nTwo houses.\n"
    (tmp_path / "plain").mkdir()
    (tmp_path / "gz").mkdir()
    write(tmp_path / "plain/t.de", src.encode())
    write(tmp_path / "plain/t.en", tgt.encode())
    write(tmp_path / "gz/t.de.gz", gzip.compress(src.encode()))
    write(tmp_path / "gz/t.en", tgt.encode())  # one side plain, one gzipped
    plain = read_parallel(tmp_path / "plain/t", "de", "en")
    assert plain == (["Ein Haus.", "Zwei Häuser."], ["A house.", "Two houses."])
    assert read_parallel(str(tmp_path / "gz/t"), "de", "en") == plain


def test_missing_file_names_the_paths_tried(tmp_path):
    write(tmp_path / "p.de", b"a\n")
    with pytest.raises(ValueError) as e:
        read_parallel(tmp_path / "p", "de", "en")
    assert f"{tmp_path}/p.en" in str(e.value) and f"{tmp_path}/p.en.gz" in str(e.value)


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    write(tmp_path / "p.de", b"a\nb\nc\n")
    write(tmp_path / "p.en", b"a\nb\xff\n")  # the count error comes before any decoding error
    with pytest.raises(ValueError) as e:
        read_parallel(tmp_path / "p", "de", "en")
    message = str(e.value)
    assert f"{tmp_path}/p.de has 3 lines" in message and f"{tmp_path}/p.en has 2" in message


def test_non_utf8_names_file_line_and_bytes_and_replace_works(tmp_path):
    write(tmp_path / "p.de", b"gut\nschl\xe9cht\nok\n")  # Latin-1 e-acute on line 2
    write(tmp_path / "p.en", b"good\nbad\nok\n")
    with pytest.raises(ValueError) as e:
        read_parallel(tmp_path / "p", "de", "en")
    assert f"{tmp_path}/p.de:2:" in str(e.value) and r"b'\xe9'" in str(e.value)
    src, _ = read_parallel(tmp_path / "p", "de", "en", errors="replace")
    assert src == ["gut", "schl\ufffdcht", "ok"]


def test_non_utf8_in_gz_names_the_gz_file(tmp_path):
    write(tmp_path / "p.de.gz", gzip.compress(b"a\nb\nc\xc3\n"))  # truncated 2-byte sequence on line 3
    write(tmp_path / "p.en", b"a\nb\nc\n")
    with pytest.raises(ValueError, match=r"p\.de\.gz:3:.*xc3"):
        read_parallel(tmp_path / "p", "de", "en")


def test_read_tsv(tmp_path):
    path = write(tmp_path / "pairs.tsv", b"Haus\thouse\r\nBaum\ttree\n\t\n")
    assert read_tsv(path) == (["Haus", "Baum", ""], ["house", "tree", ""])


@pytest.mark.parametrize("line", [b"no tab here", b"two\ttabs\there"])
def test_read_tsv_refuses_lines_without_exactly_one_tab(tmp_path, line):
    path = write(tmp_path / "pairs.tsv", b"ok\tfine\n" + line + b"\n")
    with pytest.raises(ValueError) as e:
        read_tsv(path)
    assert f"{path}:2:" in str(e.value) and repr(line.decode()) in str(e.value)


def test_read_tsv_non_utf8_and_missing(tmp_path):
    path = write(tmp_path / "pairs.tsv", b"a\tb\nc\td\xff\n")
    with pytest.raises(ValueError, match=r"pairs\.tsv:2:.*xff"):
        read_tsv(path)
    assert read_tsv(path, errors="replace") == (["a", "c"], ["b", "d\ufffd"])
    with pytest.raises(ValueError, match="no such file"):
        read_tsv(tmp_path / "missing.tsv")


def test_read_hf_from_a_loaded_dataset():
    rows = [{"de": "Ein Haus.", "en": "A house."}, {"de": "Zwei.", "en": "Two."}]
    dataset = datasets.Dataset.from_dict({"id": ["0", "1"], "translation": rows})
    assert read_hf(dataset, "de", "en") == (["Ein Haus.", "Zwei."], ["A house.", "Two."])
    assert read_hf(dataset, "en", "de") == (["A house.", "Two."], ["Ein Haus.", "Zwei."])
    # The hub's opus_books declares a Translation feature rather than a plain struct.
    features = datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
    typed = datasets.Dataset.from_dict({"translation": rows}, features=features)
    assert read_hf(typed.select([1]), "de", "en") == (["Zwei."], ["Two."])


def test_read_hf_errors_name_the_missing_column_or_language():
    dataset = datasets.Dataset.from_dict({"translation": [{"de": "a", "en": "b"}]})
    with pytest.raises(ValueError, match="'fr'.*\\['de', 'en'\\]"):
        read_hf(dataset, "de", "fr")
    with pytest.raises(ValueError, match="no 'translation' column.*\\['de', 'en'\\]"):
        read_hf(datasets.Dataset.from_dict({"de": ["a"], "en": ["b"]}), "de", "en")
    holes = datasets.Dataset.from_dict({"translation": [{"de": "a", "en": "b"}, {"de": "c"}]})
    with pytest.raises(ValueError, match="row 1 has no 'en' text"):
        read_hf(holes, "de", "en")


def test_read_hf_loads_a_local_json_lines_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"translation": {"de": "Haus", "en": "house"}}, {"translation": {"de": "Baum", "en": "tree"}}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = (["Haus", "Baum"], ["house", "tree"])
    assert read_hf("json", "de", "en", data_files=str(path)) == expected


def test_read_pairs_dispatches(tmp_path):
    write(tmp_path / "p.de", b"Haus\n")
    write(tmp_path / "p.en", b"house\n")
    write(tmp_path / "p.tsv", b"Baum\ttree\n")
    write(tmp_path / "q.tsv.gz", gzip.compress(b"Hund\tdog\n"))
    assert read_pairs(str(tmp_path / "p"), "de", "en") == (["Haus"], ["house"])
    assert read_pairs(str(tmp_path / "p.tsv"), "de", "en") == (["Baum"], ["tree"])
    assert read_pairs(str(tmp_path / "q.tsv.gz"), "de", "en") == (["Hund"], ["dog"])
    with pytest.raises(ValueError, match="hf:NAME"):
        read_pairs("hf:", "de", "en")


def test_read_pairs_hf_spec_splits_name_config_and_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, config, data_files):
        calls.append((name, config, data_files))
        split = datasets.Dataset.from_dict({"translation": [{"de": name, "en": config or "-"}]})
        return datasets.DatasetDict({"train": split, "validation": split, "test": split})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert read_pairs("hf:Helsinki-NLP/opus_books:de-en", "de", "en") == (
        ["Helsinki-NLP/opus_books"],
        ["de-en"],
    )
    read_pairs("hf:some/set", "de", "en", split="validation")
    read_pairs("hf:some/set::test", "de", "en", split="validation")  # the spec's split wins
    read_pairs("hf:json", "de", "en", data_files={"train": ["a.jsonl"]})
    assert calls == [
        ("Helsinki-NLP/opus_books", "de-en", None),
        ("some/set", None, None),
        ("some/set", None, None),
        ("json", None, {"train": ["a.jsonl"]}),
    ]
    with pytest.raises(ValueError, match="no split 'dev'.*'test', 'train', 'validation'"):
        read_pairs("hf:some/set::dev", "de", "en")
    with pytest.raises(ValueError, match="hf:NAME"):
        read_pairs("hf:a:b:c:d", "de", "en")


def test_an_unreachable_hub_is_a_value_error_that_says_what_to_do(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'some/set' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        ValueError, match="hf:some/set: cannot reach the Hugging Face hub.*HF_DATASETS_OFFLINE"
    ):
        read_pairs("hf:some/set", "de", "en")
    with pytest.raises(ValueError, match="hf:/no/such/dir: no such dataset"):
        monkeypatch.undo()
        read_pairs("hf:/no/such/dir", "de", "en")


def write_jsonl(path, pairs):
    path.write_text("".join(json.dumps({"translation": {"de": d, "en": e}}) + "\n" for d, e in pairs))
    return path


TRAIN_PAIRS = [(f"Haus {i}", f"house {i}") for i in range(6)]
VALID_PAIRS = [("Baum", "tree"), ("Hund", "dog")]


# Pipes and standard input ------------------------------------------------------------------------------


def fifo_with(tmp_path, name: str, data: bytes):
    """A named pipe that a thread fills with `data` (what `<(...)` gives a program)."""
    path = tmp_path / name
    os.mkfifo(path)

    def fill():
        with open(path, "wb") as f:
            f.write(data)

    threading.Thread(target=fill, daemon=True).start()
    return path


def test_pipes_and_standard_input_are_files_to_read(tmp_path, monkeypatch):
    assert read_lines(fifo_with(tmp_path, "lines", b"eins\nzwei\n")) == ["eins", "zwei"]
    assert read_lines(fifo_with(tmp_path, "gz", gzip.compress(b"drei\n"))) == ["drei"]  # gzip by content
    assert read_pairs(str(fifo_with(tmp_path, "pairs", b"Haus\thouse\n")), "de", "en") == (
        ["Haus"],
        ["house"],
    )
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Baum\ttree\n")))
    assert read_pairs("-", "de", "en") == (["Baum"], ["tree"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"vier\n")))
    assert read_lines("-") == ["vier"]
    with pytest.raises(ValueError, match="is a directory"):
        read_lines(tmp_path)
    with pytest.raises(ValueError, match="nothing: no such file"):
        read_lines(tmp_path / "nothing")


# Cleaning and filtering -------------------------------------------------------------------------------------


def test_clean_pairs_skips_and_counts_empty_lines(tmp_path):
    write(tmp_path / "p.de", b"eins\n\ndrei\n \t\nf\xc3\xbcnf\n")
    write(tmp_path / "p.en", b"one\ntwo\n\nfour\nfive\n")
    src, tgt, report = clean_pairs(*read_parallel(tmp_path / "p", "de", "en"))
    assert (src, tgt) == (["eins", "fünf"], ["one", "five"])
    assert report == {"kept": 2, "empty": 3, "too_long": 0}


def test_clean_pairs_max_chars():
    src, tgt, report = clean_pairs(["abc", "abcd", "a"], ["x", "y", "wxyzw"], max_chars=4)
    assert (src, tgt, report) == (["abc", "abcd"], ["x", "y"], {"kept": 2, "empty": 0, "too_long": 1})


def test_filter_lengths():
    src = [[1] * 3, [1] * 5, [1] * 2, [1] * 4]
    tgt = [[1] * 4, [1] * 1, [1] * 6, [1] * 4]
    assert filter_lengths(src, tgt, max_len=4) == ([0, 3], 2)


def test_split_valid_is_seeded_disjoint_and_complete():
    src = [f"s{i}" for i in range(100)]
    tgt = [f"t{i}" for i in range(100)]
    train_src, train_tgt, valid_src, valid_tgt = split_valid(src, tgt, 0.1, seed=3)
    assert len(valid_src) == 10 and len(train_src) == 90
    assert sorted(train_src + valid_src) == sorted(src)
    assert [s[1:] for s in valid_src] == [t[1:] for t in valid_tgt]  # pairs stay together
    assert [s[1:] for s in train_src] == [t[1:] for t in train_tgt]
    assert split_valid(src, tgt, 0.1, seed=3)[2] == valid_src
    assert split_valid(src, tgt, 0.1, seed=4)[2] != valid_src
    for fraction in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="fraction"):
            split_valid(src, tgt, fraction, seed=0)


# Batching --------------------------------------------------------------------------------------------------


def cost(batch, src_lens, tgt_lens):
    return len(batch) * max(max(src_lens[i], tgt_lens[i]) for i in batch)


@pytest.mark.parametrize("bucket", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_every_pair_once_and_no_batch_over_budget(seed, bucket):
    rng = random.Random(seed)
    n = rng.randint(1, 2000)
    max_tokens = rng.choice([64, 100, 257, 1000])
    src_lens = [rng.randint(0, 64) for _ in range(n)]
    tgt_lens = [rng.randint(1, 64) for _ in range(n)]
    for epoch in range(3):
        batches = make_batches(src_lens, tgt_lens, max_tokens, seed=seed, epoch=epoch, bucket=bucket)
        assert sorted(i for batch in batches for i in batch) == list(range(n))
        assert all(batch and cost(batch, src_lens, tgt_lens) <= max_tokens for batch in batches)


def test_bucketing_wastes_little_padding():
    rng = random.Random(0)
    src_lens = [rng.randint(1, 100) for _ in range(5000)]
    tgt_lens = [s + rng.randint(-3, 3) or 1 for s in src_lens]
    batches = make_batches(src_lens, tgt_lens, 2000, seed=0, epoch=0)
    used = sum(max(src_lens[i], tgt_lens[i]) for i in range(5000))
    padded = sum(cost(batch, src_lens, tgt_lens) for batch in batches)
    assert used / padded > 0.95
    shuffled = make_batches(src_lens, tgt_lens, 2000, seed=0, epoch=0, bucket=False)
    assert len(batches) < len(shuffled)


@pytest.mark.parametrize("bucket", [True, False])
def test_batches_are_deterministic_per_epoch_and_differ_across_epochs(bucket):
    rng = random.Random(7)
    src_lens = [rng.randint(1, 30) for _ in range(500)]
    tgt_lens = [rng.randint(1, 30) for _ in range(500)]

    def batches(seed, epoch):
        return make_batches(src_lens, tgt_lens, 120, seed=seed, epoch=epoch, bucket=bucket)

    assert batches(1, 0) == batches(1, 0)
    assert batches(1, 0) != batches(1, 1)
    assert batches(1, 0) != batches(2, 0)
    assert batches(1, 0) != batches(0, 1)  # seed + epoch alone would make these equal


def test_a_pair_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="pair 1 has 3 source and 9 target tokens.*max_len.*max_tokens"):
        make_batches([2, 3, 4], [2, 9, 4], 8, seed=0, epoch=0)
    assert make_batches([8], [8], 8, seed=0, epoch=0) == [[0]]
    assert make_batches([], [], 8, seed=0, epoch=0) == []


def test_collate_pads_to_the_batch_and_shifts_in_bos():
    pad, bos, eos = PAD_ID, BOS_ID, EOS_ID
    src_ids = [[5, 6, 7, eos], [8, eos], [9, 9, 9, 9, 9, 9, eos]]
    tgt_ids = [[10, eos], [11, 12, 13, eos], [14, eos]]
    src, tgt_in, tgt_out = collate(src_ids, tgt_ids, [1, 0])
    assert torch.equal(src, torch.tensor([[8, eos, pad, pad], [5, 6, 7, eos]]))
    assert torch.equal(tgt_in, torch.tensor([[bos, 11, 12, 13], [bos, 10, pad, pad]]))
    assert torch.equal(tgt_out, torch.tensor([[11, 12, 13, eos], [10, eos, pad, pad]]))
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long
    with pytest.raises(ValueError, match="pair 0 has an empty target"):
        collate([[5]], [[]], [0])
