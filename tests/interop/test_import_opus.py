"""Importing OPUS-MT-shaped directories: a MarianMTModel with random weights beside SentencePiece models
trained on a slice of Multi30k, a vocab.json in OPUS-MT's order (</s>, <unk>, the pieces, language tags,
<pad> last) and MarianTokenizer's files, as save_pretrained and save_vocabulary write them. aiayn's ids are
MarianTokenizer's (reordered), its log-probabilities transformers', its tokens generate's. Skipped without
the shared Multi30k."""

import json

import pytest
import torch
from conftest import MULTI30K, assert_one_line_error, multi30k_lines, opus_mt_directory, run_cli

from aiayn.checkpoint import Languages, ModelDir, load_model, load_search
from aiayn.precision import translation_dtype
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

pytestmark = pytest.mark.skipif(not (MULTI30K / "train.en.gz").is_file(), reason="no shared Multi30k")


@pytest.fixture(scope="module", params=["joint, swish, fp32", "two vocabularies, relu, fp16"])
def opus(request, tmp_path_factory):
    """(the OPUS-MT directory, MarianTokenizer of it, the aiayn import of it)."""
    shared = request.param.startswith("joint")
    root = tmp_path_factory.mktemp("opus")
    source = opus_mt_directory(root / "hf", shared=shared, activation=request.param.split(", ")[1],
                     dtype=torch.float32 if shared else torch.float16)  # fmt: skip
    code, _, err = run_cli(["import", source, "--out", root / "aiayn"])
    assert code == 0, err
    return source, transformers.MarianTokenizer.from_pretrained(source), root / "aiayn"


def texts_to_check() -> list[str]:
    """1,000 Multi30k lines and what a tokenizer must not get wrong: language tags, unknown characters,
    special tokens written in the text, empty lines and whitespace."""
    odd = [
        ">>de<< A man.", ">>fr<<A dog runs", " >>de<< tag after a space", ">>xx<< an unknown tag",
        "a >>de<< tag inside", "snowman ☃ and 中文", "</s>", "a </s> b <pad>c<unk>", "<s> is text", "",
        "   ", "two  spaces\tand a tab", "ÆØÅ ß ﬁ ①",
    ]  # fmt: skip
    return multi30k_lines("val.en.gz", 1000) + odd


def marian_ids(tokenizer, texts: list[str], target: bool = False) -> list[list[int]]:
    return tokenizer(text_target=texts)["input_ids"] if target else tokenizer(texts)["input_ids"]


def test_token_ids_are_marian_tokenizers(opus):
    source, marian, imported = opus
    tokenizer = Tokenizer.load(imported)
    order = json.loads((imported / "sentencepiece.json").read_text())
    src_pieces = order.get("pieces") or order["source_pieces"]
    tgt_pieces = order.get("pieces") or order["target_pieces"]
    to_marian = lambda pieces, vocab: [vocab.get(p, vocab["<pad>"]) for p in pieces]  # noqa: E731
    src_vocab = json.loads((source / "vocab.json").read_text())
    tgt_vocab = json.loads((source / "target_vocab.json").read_text()) if not tokenizer.joint else src_vocab
    src_of, tgt_of = to_marian(src_pieces, src_vocab), to_marian(tgt_pieces, tgt_vocab)
    src_of[BOS_ID] = tgt_of[BOS_ID] = src_vocab["<pad>"]  # aiayn's names for ids 0-3
    src_of[EOS_ID] = tgt_of[EOS_ID] = src_vocab["</s>"]
    src_of[UNK_ID] = tgt_of[UNK_ID] = src_vocab["<unk>"]
    texts = texts_to_check()
    ours = tokenizer.encode_src(texts)
    assert [[src_of[i] for i in ids] for ids in ours] == marian_ids(marian, texts)
    assert PAD_ID not in {i for ids in ours for i in ids}
    german = multi30k_lines("val.de.gz", 1000) + texts[-13:]
    assert [[tgt_of[i] for i in ids] for ids in tokenizer.encode_tgt(german)] == marian_ids(
        marian, german, True
    )
    # decoding: MarianTokenizer's text (where there is no <unk>, which aiayn shows and it leaves out)
    sample = [text for text, ids in zip(german, tokenizer.encode_tgt(german)) if UNK_ID not in ids][:200]
    want = marian.batch_decode(marian_ids(marian, sample, True), skip_special_tokens=True)
    assert tokenizer.decode_tgt(tokenizer.encode_tgt(sample)) == want


def test_the_import_gives_transformers_tokens_greedy_and_beam(opus):
    """40 sentences through aiayn's search on the import and through generate on the original (OPUS-MT's
    generation config: pad banned; the same output limit per sentence, the same length penalty; beams run
    until no live hypothesis can win: aiayn's "exact" stopping, transformers' "never"). A random tied model repeats itself to the limit, so
    this compares long outputs; stopping at EOS is compared on the export's own tests. The import runs as
    a user's command does, in the default number format: fp32, exact, on every CPU class."""
    from aiayn.inference.translate import Translator

    source, marian, imported = opus
    hf = transformers.MarianMTModel.from_pretrained(source, torch_dtype=torch.float32).eval()
    translator = Translator.load(imported)  # no dtype, as `aiayn translate` with no flags
    assert translation_dtype(translator.dtype, translator.device) == "fp32"
    texts = multi30k_lines("val.en.gz", 40, skip=100)
    assert load_search(imported).beam_size == 4
    outputs = set()
    for beam in (1, 4):
        config = translator.search_config.__class__(
            beam_size=beam, alpha=1.0, length_penalty="average", stopping="exact"
        )
        ours = translator.translate_ids(translator.tokenizer.encode_src(texts), config)
        for text, hyp in zip(texts, ours):
            inputs = marian([text], return_tensors="pt")
            limit = config.max_len_a * (inputs["input_ids"].shape[1]) + config.max_len_b
            with torch.no_grad():
                out = hf.generate(**inputs, num_beams=beam, max_new_tokens=int(limit), length_penalty=1.0,
                                  early_stopping="never" if beam > 1 else False)[0, 1:].tolist()  # fmt: skip
            want = marian.batch_decode([out], skip_special_tokens=True)[0]
            assert translator.tokenizer.decode_tgt([hyp[0].tokens])[0] == want, (beam, text)
            outputs.add(tuple(hyp[0].tokens))
    assert len(outputs) > 40  # no two sentences alike


def test_export_import_export_is_the_same_directory(opus, tmp_path):
    """The import exported to transformers, imported again and exported again: the same files (weights,
    SentencePiece models, vocabularies, configs), and the second import's weights are the first's."""
    _, _, imported = opus
    for step, (command, source, out) in enumerate(
        [("export", imported, "hf1"), ("import", "hf1", "back"), ("export", "back", "hf2")]
    ):
        args = [command, source if step == 0 else tmp_path / source, "--out", tmp_path / out]
        code, _, err = run_cli(args + (["--format", "transformers"] if command == "export" else []))
        assert code == 0, err
    first, second = load_model(imported).state_dict(), load_model(tmp_path / "back").state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    names = sorted(p.name for p in (tmp_path / "hf1").iterdir())
    assert {"source.spm", "target.spm", "vocab.json", "model.safetensors"} <= set(names)
    assert names == sorted(p.name for p in (tmp_path / "hf2").iterdir())
    for name in names:
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf1")
    marian = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf1")
    assert marian(["A man."])["input_ids"] == Tokenizer.load(imported).encode_src(["A man."])
    assert hf.generation_config.bad_words_ids == [[PAD_ID], [BOS_ID]]


def test_a_damaged_or_partial_opus_mt_directory_is_a_one_line_error_and_leaves_no_out(opus, tmp_path):
    import shutil

    source, _, _ = opus
    damages = {
        "no target.spm": (lambda d: (d / "target.spm").unlink(), ["target.spm"]),
        "vocab.json cut": (lambda d: (d / "vocab.json").write_text('{"</s>": 0, "<u'), ["vocab.json", "JSON"]),
        "vocab.json without <unk>": (
            lambda d: (d / "vocab.json").write_text('{"</s>": 0, "<pad>": 1}'), ["vocab.json", "<unk>"]),
        "source.spm damaged": (lambda d: (d / "source.spm").write_bytes(b"\x00garbage"), ["SentencePiece model"]),
    }  # fmt: skip
    for name, (damage, needles) in damages.items():
        broken = tmp_path / name.replace(" ", "_")
        shutil.copytree(source, broken)
        damage(broken)
        code, _, err = run_cli(["import", broken, "--out", tmp_path / "refused"])
        assert_one_line_error(code, err, *needles)
        assert not (tmp_path / "refused").exists(), name


def test_a_hub_name_offline_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hub"))  # an empty cache
    code, _, err = run_cli(["import", "Helsinki-NLP/opus-mt-en-de", "--out", tmp_path / "out"])
    assert_one_line_error(code, err, "Helsinki-NLP/opus-mt-en-de", "offline")
    assert not (tmp_path / "out").exists()


def test_an_imported_model_translates_fine_tunes_and_exports(opus, tmp_path):
    """The import is an aiayn model like any other: translate (fp32 and int8), fine-tune with --init on
    Multi30k text encoded by its SentencePiece vocabulary, average, shortlist, evaluate, and export to
    CTranslate2, whose greedy tokens are aiayn's."""
    from aiayn.inference.translate import Translator
    from aiayn.interop.ctranslate2 import CTranslate2Translator

    _, marian, imported = opus
    (tmp_path / "in.txt").write_text("\n".join(multi30k_lines("val.en.gz", 3)) + "\n")
    outputs = {}
    for dtype in ("fp32", "int8"):
        code, out, err = run_cli(["translate", imported, "--input", tmp_path / "in.txt", "--beam-size", 1,
                                  "--dtype", dtype, "--no-compile", "--quiet"])  # fmt: skip
        assert code == 0, err
        outputs[dtype] = out.splitlines()
    assert len(outputs["fp32"]) == 3 and all(outputs["fp32"])
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text(
            "\n".join(multi30k_lines(f"train.{lang}.gz", 300, skip=5000)) + "\n"
        )
    argv = ["train", "--train", tmp_path / "train", "--src-lang", "en", "--tgt-lang", "de", "--out",
            tmp_path / "tuned", "--init", imported, "--max-updates", 4, "--valid-fraction", 0.1, "--set", "valid_every=2", "--set",
            "dtype=fp32", "--quiet"]  # fmt: skip
    code, _, err = run_cli(argv)
    assert code == 0, err
    tuned = Tokenizer.load(tmp_path / "tuned")
    assert tuned.files() == Tokenizer.load(imported).files()  # the imported vocabulary, as it was
    assert ModelDir.read(tmp_path / "tuned").languages == Languages(("en",), ("de",))  # the corpus's
    before, after = load_model(imported).state_dict(), load_model(tmp_path / "tuned").state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)  # it learned
    assert torch.isneginf(after["generator.bias"][PAD_ID])  # and PAD stays impossible
    (tmp_path / "ref.txt").write_text("\n".join(multi30k_lines("val.de.gz", 3)) + "\n")
    for argv in (
        ["average", tmp_path / "tuned", "--last", 2, "--out", tmp_path / "averaged"],
        ["shortlist", tmp_path / "tuned"],  # from the run's corpus, encoded with the imported vocabulary
        ["translate", tmp_path / "tuned", "--input", tmp_path / "in.txt", "--shortlist", "--beam-size", 1],
        ["evaluate", tmp_path / "averaged", "--src", tmp_path / "in.txt", "--ref", tmp_path / "ref.txt"],
    ):
        code, out, err = run_cli([*argv, "--quiet"] if argv[0] in ("translate", "evaluate") else argv)
        assert code == 0, (argv[0], err)
    assert "bleu" in json.loads(out.splitlines()[-1])
    assert ModelDir.read(tmp_path / "averaged").languages == Languages(("en",), ("de",))
    code, _, err = run_cli(["export", imported, "--format", "ctranslate2", "--out", tmp_path / "ct2"])
    assert code == 0, err
    ids = Tokenizer.load(imported).encode_src(multi30k_lines("val.en.gz", 10))
    config = load_search(imported).__class__(beam_size=1)
    ours = Translator.load(imported, dtype="fp32").translate_ids(ids, config)
    theirs = CTranslate2Translator(tmp_path / "ct2", threads=1).translate_ids(ids, config)
    assert [h[0].tokens for h in theirs] == [h[0].tokens for h in ours]


def test_an_imported_model_serves_its_translations_and_attention_and_plots(opus, tmp_path):
    """`aiayn serve`'s app (eager: compiling is the compiled tests') answers with the imported model's own
    translations, and its attention with the SentencePiece pieces as labels; `aiayn plot` draws them."""
    from fastapi.testclient import TestClient

    from aiayn.config import SearchConfig, ServeConfig
    from aiayn.inference.translate import Translator
    from aiayn.serving.app import create_app

    _, _, imported = opus
    translator = Translator.load(imported, SearchConfig(beam_size=1), dtype="fp32", compile=False)
    texts = multi30k_lines("val.en.gz", 2)
    with TestClient(create_app(translator, ServeConfig(beam_size=1))) as client:
        response = client.post("/translate", json={"text": texts})
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == translator.translate(texts, beam_size=1)
        body = client.post("/attention", json={"text": texts[0]}).json()
    src_ids = translator.tokenizer.encode_src(texts[:1])[0]
    assert body["source_tokens"] == translator.tokenizer.labels(src_ids, "src")
    assert (
        body["source_tokens"][-1] == "</s>"
        and body["translation"] == translator.translate(texts[:1], beam_size=1)[0]
    )
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(["plot", imported, "--sentence", texts[0], "--out", tmp_path / "plots"])
    assert code == 0, err
    assert any(p.suffix == ".png" for p in (tmp_path / "plots").iterdir())


def test_a_tag_is_one_token_as_marian_tokenizer_makes_it(opus):
    """A tag in front of a text (">>fr<< ") is the tag's own id, then the text's pieces: MarianTokenizer's ids."""
    source, marian, imported = opus
    tokenizer = Tokenizer.load(imported)
    pieces, vocab = tokenizer.src_tokens(), json.loads((source / "vocab.json").read_text())
    for text in (">>fr<< A man sleeps on a bench.", ">>de<< Two dogs."):
        ours = tokenizer.encode_src([text])[0]
        assert ours[0] == pieces.index(text[:6]) and ours[-1] == EOS_ID
        assert [vocab[pieces[i]] for i in ours] == marian([text])["input_ids"][0]  # (aiayn's </s> is its)
        assert ours[1:] == tokenizer.encode_src([text[7:]])[0]  # the rest as the text alone


def test_the_languages_of_a_tagged_opus_mt_model_come_from_its_name_and_its_tags(opus, tmp_path):
    """Imported from "hf", nothing says what it reads: no languages. Named opus-mt-en-mul, it reads en
    (its name) and writes de and fr (its >>de<< and >>fr<< tags, which choose them); flags win, and a target
    without a tag is refused. `translate --tgt-lang fr` is the text with ">>fr<< " written in front."""
    import shutil

    source, _, imported = opus
    assert ModelDir.read(imported).languages is None
    named = shutil.copytree(source, tmp_path / "opus-mt-en-mul")
    tags = {"de": ">>de<<", "fr": ">>fr<<"}
    for flags, expected in (
        ([], Languages(("en",), ("de", "fr"), tags)),
        (["--tgt-lang", "fr"], Languages(("en",), ("fr",), {"fr": ">>fr<<"})),
        (["--src-lang", "en,de"], Languages(("en", "de"), ("de", "fr"), tags)),
    ):
        out = tmp_path / f"import{''.join(flags)}"
        code, _, err = run_cli(["import", named, "--out", out, *flags])
        assert code == 0, err
        assert ModelDir.read(out).languages == expected, flags
    code, _, err = run_cli(["import", named, "--out", tmp_path / "refused", "--tgt-lang", "it"])
    assert_one_line_error(code, err, "opus-mt-en-mul", "no tag for it", ">>de<<, >>fr<<")
    lines = multi30k_lines("val.en.gz", 3)
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "by_hand.txt").write_text("\n".join(f">>fr<< {line}" for line in lines) + "\n")
    quick = ["--beam-size", 1, "--no-compile", "--quiet"]
    code, with_flag, err = run_cli(["translate", tmp_path / "import", "--input", tmp_path / "in.txt",
                                    "--tgt-lang", "fr", *quick])  # fmt: skip
    assert code == 0, err
    code, by_hand, err = run_cli(
        ["translate", tmp_path / "import", "--input", tmp_path / "by_hand.txt", *quick]
    )
    assert code == 0, err
    assert with_flag == by_hand and len(with_flag.splitlines()) == 3
