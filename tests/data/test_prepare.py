"""Tests for aiayn.data.prepare: a corpus streamed through the tokenizer into memory-mapped files holds
exactly the tokenizer's ids of every kept pair, counts what it dropped, holds out what split_valid
would, reads pipes, and trains bit for bit as the files it came from."""

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, train_argv, write_lines

from aiayn import checkpoint
from aiayn.data.corpus import clean_pairs, collate, read_parallel, split_valid
from aiayn.data.prepare import MANIFEST, TokenizerOptions, collate_ids, open_prepared, prepare_files
from aiayn.data.synthetic import generate
from aiayn.tokenizer import Tokenizer

SRC, TGT = generate(400, seed=11)
QUIET = dict(say=lambda line: None)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """400 pairs with some blank sides (to be dropped and counted), as PREFIX.en / PREFIX.xx."""
    src, tgt = list(SRC), list(TGT)
    src[3], tgt[10], src[20], tgt[20] = "", "   ", "", ""
    write_lines(tmp_path / "c.en", src), write_lines(tmp_path / "c.xx", tgt)
    return tmp_path / "c"


def decoded(ids) -> list[list[int]]:
    return [ids[i].tolist() for i in range(len(ids))]


def test_the_stored_ids_are_the_tokenizers_encoding_of_every_kept_pair(corpus, tmp_path):
    data = prepare_files(
        tmp_path / "data", str(corpus), "en", "xx", options=TokenizerOptions(vocab_size=400), **QUIET
    )
    src, tgt = read_parallel(corpus, "en", "xx")
    kept_src, kept_tgt, report = clean_pairs(src, tgt)
    assert data.manifest["report"] == report == {"kept": 397, "empty": 3, "too_long": 0}
    assert data.manifest["pairs"] == len(data.src) == len(data.tgt) == 397
    assert decoded(data.src) == data.tokenizer.encode_src(kept_src)
    assert decoded(data.tgt) == data.tokenizer.encode_tgt(kept_tgt)
    assert data.manifest["src_tokens"] == sum(map(len, data.tokenizer.encode_src(kept_src)))
    assert data.src.flat.dtype == np.uint16 and isinstance(data.src.flat, np.memmap)
    # Fewer pairs than the sample: the vocabulary is the one learned from all of them, in order.
    full = Tokenizer.train(kept_src, kept_tgt, vocab_size=400)
    assert data.tokenizer.files() == full.files()
    committed = data.commit(tmp_path / "DATA")
    assert committed.manifest == data.manifest and decoded(committed.src) == decoded(data.src)
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_batch_gathered_from_the_flat_ids_is_the_one_collate_pads_sentence_by_sentence(corpus, tmp_path):
    data = prepare_files(
        tmp_path / "data", str(corpus), "en", "xx", options=TokenizerOptions(vocab_size=400), **QUIET
    )
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 64, len(data.src)):
        rows = rng.choice(len(data.src), size, replace=False)
        for fast, slow in zip(
            collate_ids(data.src, data.tgt, rows), collate(data.src, data.tgt, rows.tolist())
        ):
            assert fast.dtype == slow.dtype and fast.shape == slow.shape and bool((fast == slow).all())


def test_a_bounded_sample_teaches_the_tokenizer(corpus, tmp_path):
    options = TokenizerOptions(vocab_size=300, sample=50)
    one = prepare_files(tmp_path / "a", str(corpus), "en", "xx", options=options, seed=5, **QUIET)
    two = prepare_files(tmp_path / "b", str(corpus), "en", "xx", options=options, seed=5, **QUIET)
    full = prepare_files(
        tmp_path / "c", str(corpus), "en", "xx", options=TokenizerOptions(vocab_size=300), **QUIET
    )
    assert one.tokenizer.files() == two.tokenizer.files() != full.tokenizer.files()  # seeded, and a sample
    kept_src, _, _ = clean_pairs(*read_parallel(corpus, "en", "xx"))
    assert decoded(one.src) == one.tokenizer.encode_src(kept_src)  # every pair, by the sample's vocabulary


def test_without_a_vocabulary_size_the_corpus_size_picks_the_recipes(corpus, tmp_path, monkeypatch):
    from aiayn import config

    said: list[str] = []
    prepare_files(tmp_path / "a", str(corpus), "en", "xx", options=TokenizerOptions(), say=said.append)
    size = config.RECIPES["low-resource"].vocab_size  # 397 pairs: a small corpus
    assert f"tokenizer: learning bpe vocab_size {size} from 397 pairs" in said
    monkeypatch.setattr(config, "LOW_RESOURCE_PAIRS", 300)
    said.clear()
    prepare_files(tmp_path / "b", str(corpus), "en", "xx", options=TokenizerOptions(), say=said.append)
    assert f"tokenizer: learning bpe vocab_size {config.Recipe().vocab_size} from 397 pairs" in said


def test_held_out_pairs_are_those_split_valid_holds_out(corpus, tmp_path):
    data = prepare_files(tmp_path / "d", str(corpus), "en", "xx", valid_fraction=0.1, seed=3, **QUIET)
    kept_src, kept_tgt, _ = clean_pairs(*read_parallel(corpus, "en", "xx"))
    train_src, train_tgt, valid_src, valid_tgt = split_valid(kept_src, kept_tgt, 0.1, 3)
    assert (data.valid_src, data.valid_tgt) == (valid_src, valid_tgt)
    assert decoded(data.tgt) == data.tokenizer.encode_tgt(train_tgt)
    assert data.manifest["held_out"] == len(valid_src) == 40 and data.manifest["pairs"] == 357
    # The vocabulary was learned from the training pairs only, as before the split existed.
    assert data.tokenizer.files() == Tokenizer.train(train_src, train_tgt, vocab_size=8000).files()


def test_a_pipe_is_read_once_and_gives_what_the_file_gives(corpus, tmp_path):
    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(SRC, TGT))
    write_lines(tmp_path / "pairs.tsv", tsv.splitlines())
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.write_text(tsv), daemon=True).start()
    options = TokenizerOptions(vocab_size=300)
    piped = prepare_files(tmp_path / "p", str(fifo), "en", "xx", options=options, **QUIET)
    filed = prepare_files(tmp_path / "f", str(tmp_path / "pairs.tsv"), "en", "xx", options=options, **QUIET)
    assert piped.manifest["train_data"] == filed.manifest["train_data"]
    assert decoded(piped.src) == decoded(filed.src) and piped.tokenizer.files() == filed.tokenizer.files()
    assert not list(tmp_path.glob(".*spool*"))  # the spool file is gone


def test_ids_past_65535_are_stored_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    src = [" ".join(words[i : i + 7]) for i in range(0, 70_000, 7)]
    write_lines(tmp_path / "big.en", src), write_lines(tmp_path / "big.xx", src)
    options = TokenizerOptions(vocab_size=80_000, kind="word")
    data = prepare_files(tmp_path / "d", str(tmp_path / "big"), "en", "xx", options=options, **QUIET)
    assert data.src.flat.dtype == np.uint32 and int(data.src.flat.max()) > 65_535
    assert decoded(data.src)[:100] == data.tokenizer.encode_src(src[:100])


def test_local_datasets_and_their_splits(tmp_path):
    rows = lambda pairs: "".join(json.dumps({"translation": {"de": d, "en": e}}) + "\n" for d, e in pairs)  # noqa: E731
    train_pairs, valid_pairs = (
        [(f"Haus {i}", f"house {i}") for i in range(6)],
        [("Baum", "tree"), ("Hund", "dog")],
    )
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text(rows(train_pairs))
    (tmp_path / "ds" / "validation.jsonl").write_text(rows(valid_pairs))
    spec = f"hf:{tmp_path / 'ds'}"
    for n, valid in enumerate((spec, None)):  # --valid hf: reads the validation split; it is the default
        data = prepare_files(tmp_path / f"d{n}", spec, "de", "en", valid=valid, **QUIET)
        assert (data.valid_src, data.valid_tgt) == (["Baum", "Hund"], ["tree", "dog"])
        assert data.manifest["pairs"] == 6
    files = {"train": [str(tmp_path / "ds" / "train.jsonl")]}
    said = []
    data = prepare_files(tmp_path / "d3", "hf:json", "en", "de", data_files=files, say=said.append)
    assert data.valid_src == [] and "no validation split" in said[0]
    with pytest.raises(ValueError, match="not both"):
        prepare_files(tmp_path / "d4", spec, "de", "en", valid=spec, valid_fraction=0.1, **QUIET)


def test_a_damaged_prepared_corpus_is_a_value_error(corpus, tmp_path):
    data = prepare_files(
        tmp_path / "x", str(corpus), "en", "xx", options=TokenizerOptions(vocab_size=300), **QUIET
    )
    directory = data.commit(tmp_path / "DATA").directory
    with open(directory / "tgt.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="tgt.bin and tgt.len do not fit manifest.json"):
        open_prepared(directory)
    (directory / MANIFEST).write_text("{")
    with pytest.raises(ValueError, match="a damaged prepared corpus"):
        open_prepared(directory)
    with pytest.raises(ValueError, match="not a prepared corpus"):
        open_prepared(tmp_path)


def test_train_from_data_equals_train_from_files(corpus, tmp_path):
    """`aiayn prepare` then `train --data` gives the weights `train --train` gives (it prepares the same)."""
    write_lines(tmp_path / "v.en", SRC[:8]), write_lines(tmp_path / "v.xx", TGT[:8])
    flags = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 4, "--max-tokens", 400]
    flags += ["--set", "valid_every=2", "--set", "dropout=0.1", "--set", "dtype=fp32"]
    code, _, stderr = run_cli(train_argv(corpus, tmp_path / "files", "--valid", tmp_path / "v", *flags))
    assert code == 0, stderr
    code, out, stderr = run_cli(
        ["prepare", "--train", corpus, "--valid", tmp_path / "v", "--src-lang", "en", "--tgt-lang", "xx"]
        + ["--out", tmp_path / "DATA", "--vocab-size", 300]
    )
    assert code == 0, stderr and json.loads(out)["pairs"] == 397
    code, _, stderr = run_cli(
        ["train", "--data", tmp_path / "DATA", "--out", tmp_path / "data", "--quiet", *flags]
    )
    assert code == 0, stderr
    for name in ("step_00000002", "step_00000004"):
        want = (tmp_path / "files" / "checkpoints" / name / checkpoint.WEIGHTS).read_bytes()
        assert (tmp_path / "data" / "checkpoints" / name / checkpoint.WEIGHTS).read_bytes() == want
    assert (tmp_path / "files" / "data" / MANIFEST).is_file()  # --train prepared into OUT/data
    assert not (tmp_path / "data" / "data").exists()  # --data is used where it is


def test_bpe_dropout_views_are_other_segmentations_of_the_same_pairs(corpus, tmp_path):
    """Each view holds every kept pair once more, in pieces the plain BPE would have merged: decoding any
    view gives the text back exactly (byte-level BPE), and the views differ from it and from each other."""
    options = TokenizerOptions(vocab_size=400, bpe_dropout=0.3, views=3)
    data = prepare_files(tmp_path / "d", str(corpus), "en", "xx", options=options, **QUIET)
    kept_src, kept_tgt, _ = clean_pairs(*read_parallel(corpus, "en", "xx"))
    assert len(data.views) == 3 and data.manifest["bpe_dropout"] == 0.3
    plain = (decoded(data.src), decoded(data.tgt))
    assert plain == (data.tokenizer.encode_src(kept_src), data.tokenizer.encode_tgt(kept_tgt))
    seen = [plain]
    for src, tgt in data.views:
        view = (decoded(src), decoded(tgt))
        assert (
            data.tokenizer.decode_src(view[0]) == kept_src and data.tokenizer.decode_tgt(view[1]) == kept_tgt
        )
        assert all(ids[-1] == 2 for ids in view[0] + view[1])  # each still ends with EOS
        assert sum(map(len, view[0])) > sum(map(len, plain[0])) and sum(map(len, view[1])) > sum(
            map(len, plain[1])
        )
        assert all(view != other for other in seen)
        seen.append(view)
    assert data.fingerprint()["bpe_dropout"] == "0.3 x 3 views"  # a resume must train on these same views
    # Without BPE-dropout nothing changes, the fingerprint of older runs included.
    none = prepare_files(
        tmp_path / "n", str(corpus), "en", "xx", options=TokenizerOptions(vocab_size=400), **QUIET
    )
    assert none.views == [] and "bpe_dropout" not in none.fingerprint()
    directory = data.commit(tmp_path / "DATA").directory
    assert len(open_prepared(directory).views) == 3
    with open(directory / "src.2.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"src\.2\.bin and src\.2\.len do not fit"):
        open_prepared(directory)


def test_bpe_dropout_of_the_source_only_keeps_the_targets_one_segmentation(corpus, tmp_path):
    options = TokenizerOptions(vocab_size=400, bpe_dropout=0.3, views=2, bpe_dropout_target=False)
    data = prepare_files(tmp_path / "d", str(corpus), "en", "xx", options=options, **QUIET)
    assert data.manifest["bpe_dropout_sides"] == "source"
    assert data.fingerprint()["bpe_dropout"] == "0.3 x 2 views of the source"
    for src, tgt in data.views:
        assert decoded(tgt) == decoded(data.tgt) and decoded(src) != decoded(data.src)
        assert data.tokenizer.decode_src(decoded(src)) == data.tokenizer.decode_src(decoded(data.src))
    code, _, stderr = run_cli(
        ["prepare", "--train", corpus, "--src-lang", "en", "--tgt-lang", "xx", "--out", tmp_path / "c"]
        + [
            "--vocab-size",
            "400",
            "--bpe-dropout",
            "0.3",
            "--bpe-dropout-views",
            "2",
            "--bpe-dropout-source-only",
        ]
    )
    assert code == 0, stderr
    assert open_prepared(tmp_path / "c").manifest["bpe_dropout_sides"] == "source"


def test_bpe_dropout_needs_a_bpe_vocabulary(corpus, tmp_path):
    options = TokenizerOptions(vocab_size=400, kind="word", bpe_dropout=0.1)
    with pytest.raises(ValueError, match="BPE-dropout needs a BPE vocabulary"):
        prepare_files(tmp_path / "w", str(corpus), "en", "xx", options=options, **QUIET)
    code, _, stderr = run_cli(
        ["prepare", "--train", corpus, "--src-lang", "en", "--tgt-lang", "xx", "--out", tmp_path / "c"]
        + ["--tokenizer", "word", "--bpe-dropout", "0.1"]
    )
    assert code == 2 and "--bpe-dropout needs --tokenizer bpe" in stderr
    for flag, value in (("--bpe-dropout", "1.0"), ("--bpe-dropout-views", "0")):
        code, _, stderr = run_cli(
            ["prepare", "--train", corpus, "--src-lang", "en", "--tgt-lang", "xx", "--out", tmp_path / "c"]
            + [flag, value]
        )
        assert code == 2 and flag in stderr, stderr
