"""A model's languages on the command line: `aiayn train` records its corpus's in the model directory and
its checkpoints (a resume keeps them, a fine-tuning run keeps the tag it chose its target by), and
`aiayn translate --tgt-lang` puts a multilingual model's tag in front of each line, refusing a language
the model does not write."""

from types import SimpleNamespace

import pytest
from conftest import assert_one_line_error, run_cli, run_train, train_argv, write_lines, write_parallel

from aiayn import checkpoint
from aiayn.checkpoint import Languages, ModelDir
from aiayn.config import TrainConfig, preset
from aiayn.data.corpus import Corpus
from aiayn.data.synthetic import generate
from aiayn.tokenizer import Tokenizer
from aiayn.training.run import run_languages

TINY = ["--preset", "tiny", "--vocab-size", 300, "--max-tokens", 1500, "--set", "dtype=fp32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 updates on en -> xx with a validation at 2 and 4, and a source text to translate."""
    root = tmp_path_factory.mktemp("languages")
    src, tgt = generate(120, seed=3)
    prefix = write_parallel(root / "train", src[:100], tgt[:100])
    code, _, err = run_cli(train_argv(prefix, root / "model", *TINY, "--max-updates", 4,
                                      "--valid-fraction", 0.1, "--set", "valid_every=2"))  # fmt: skip
    assert code == 0, err
    return root, root / "model", write_lines(root / "in.en", src[100:104])


def test_train_records_the_languages_of_its_corpus_in_the_model_and_every_checkpoint(trained):
    _, model, _ = trained
    en_xx = Languages(("en",), ("xx",), {})
    assert ModelDir.read(model).languages == en_xx
    saved = checkpoint.list_checkpoints(model)
    assert saved and all(ModelDir.read(path).languages == en_xx for path in saved)


def test_a_resumed_run_keeps_the_languages_of_its_checkpoints(tmp_path):
    """A run resumed without being told its languages (the library's train() with none) keeps those its
    last checkpoint holds: in OUT's model and in the checkpoints it goes on to write."""
    src, tgt = generate(60, seed=4)
    tokenizer = Tokenizer.train(src, tgt, vocab_size=300)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size)
    languages = Languages(("en",), ("xx",), {})
    cfg = TrainConfig(max_updates=2, max_tokens=800, warmup_steps=2, dtype="fp32", average_last=0)
    run_train(tmp_path, config, cfg, tokenizer, Corpus(src, tgt), languages=languages)
    first = checkpoint.list_checkpoints(tmp_path)
    more = TrainConfig(max_updates=4, max_tokens=800, warmup_steps=2, dtype="fp32", average_last=0)
    run_train(tmp_path, config, more, tokenizer, Corpus(src, tgt), mode="resume")
    new = [path for path in checkpoint.list_checkpoints(tmp_path) if path not in first]
    assert new and all(ModelDir.read(path).languages == languages for path in new)
    assert ModelDir.read(tmp_path).languages == languages


def test_the_languages_of_a_run_are_its_corpus_direction_with_the_tag_its_start_chose_it_by():
    corpus = SimpleNamespace(src_lang="en", tgt_lang="fr")
    tagged = Languages(("en",), ("de", "fr"), {"de": ">>de<<", "fr": ">>fr<<"})
    assert run_languages(corpus) == Languages(("en",), ("fr",), {})
    assert run_languages(corpus, tagged) == Languages(("en",), ("fr",), {"fr": ">>fr<<"})
    said = []
    unnamed = SimpleNamespace(src_lang="source", tgt_lang="target")  # files train.source, train.target
    assert run_languages(unnamed, say=said.append) is None
    assert run_languages(unnamed, tagged, say=said.append) == tagged
    assert said[0] == (
        "aiayn: source -> target are not language codes (two or three lowercase letters, then optionally a "
        "script or region: de, deu, pt_br, zh_Hant): the model records no languages"
    )


def test_translate_tgt_lang_puts_the_models_tag_in_front_of_each_line(trained, tmp_path):
    """A model with tags: --tgt-lang de translates as the lines with ">>de<< " written in front by hand;
    a language it does not write is a one-line error naming it and the model's languages."""
    root, model, source = trained
    tagged = tmp_path / "tagged"
    read = ModelDir.read(model)
    languages = Languages(("en",), ("xx", "de"), {"xx": ">>xx<<", "de": ">>de<<"})
    checkpoint.save_model(tagged, read.model(), read.tokenizer, read.search, languages)
    lines = source.read_text().splitlines()
    by_hand = write_lines(tmp_path / "by_hand.en", [f">>de<< {line}" for line in lines])
    quick = ["--beam-size", 1, "--quiet"]
    code, with_flag, err = run_cli(["translate", tagged, "--input", source, "--tgt-lang", "de", *quick])
    assert code == 0, err
    code, written, err = run_cli(["translate", tagged, "--input", by_hand, *quick])
    assert code == 0, err
    assert with_flag == written and len(with_flag.splitlines()) == len(lines)
    code, _, err = run_cli(["translate", tagged, "--input", source, "--tgt-lang", "fr", *quick])
    assert_one_line_error(code, err, str(tagged), "--tgt-lang fr", "en -> xx, de (tags >>xx<<, >>de<<)")


def test_translate_tgt_lang_of_a_model_without_tags_is_its_target_or_an_error(trained, tmp_path):
    _, model, source = trained
    quick = ["--input", source, "--beam-size", 1, "--quiet"]
    code, with_flag, err = run_cli(["translate", model, "--tgt-lang", "xx", *quick])
    assert code == 0, err
    assert with_flag == run_cli(["translate", model, *quick])[1]  # nothing in front: it writes xx alone
    code, _, err = run_cli(["translate", model, "--tgt-lang", "de", *quick])
    assert_one_line_error(code, err, "--tgt-lang de", "not a language the model writes", "en -> xx")
    unknown = tmp_path / "unknown"
    read = ModelDir.read(model)
    checkpoint.save_model(unknown, read.model(), read.tokenizer, read.search)  # no languages.json
    code, _, err = run_cli(["translate", unknown, "--tgt-lang", "xx", *quick])
    assert_one_line_error(code, err, str(unknown), "languages are unknown")
