"""Importing OPUS-MT-shaped directories: a MarianMTModel with random weights beside SentencePiece models
trained on a slice of Multi30k, a vocab.json in OPUS-MT's order (</s>, <unk>, the pieces, language tags,
<pad> last) and MarianTokenizer's files, as save_pretrained and save_vocabulary write them. aiayn's ids are
MarianTokenizer's (reordered), its log-probabilities transformers', its tokens generate's. Skipped without
the shared Multi30k."""

import gzip
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, run_cli

from aiayn.checkpoint import load_model, load_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

MULTI30K = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"
pytestmark = pytest.mark.skipif(not (MULTI30K / "train.en.gz").is_file(), reason="no shared Multi30k")
TAGS = (">>de<<", ">>fr<<")  # OPUS-MT's target-language tags: tokens of their own at a text's start


def lines(name: str, count: int, skip: int = 0) -> list[str]:
    with gzip.open(MULTI30K / name, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(skip + count), f)][skip:]


def train_spm(texts: list[str], byte_fallback: bool) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=300, model_type="unigram",
        byte_fallback=byte_fallback, character_coverage=0.98, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def opus_vocab(models: list[bytes]) -> dict[str, int]:
    """OPUS-MT's order: </s> 0, <unk> 1, the pieces (some left out: a piece the corpus never showed is
    <unk>), the language tags, <pad> last."""
    pieces: list[str] = []
    for model in models:
        sp = spm.SentencePieceProcessor(model_proto=model)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in pieces:
                pieces.append(sp.id_to_piece(i))
    pieces = [p for k, p in enumerate(pieces) if k % 40 != 7]
    return {p: i for i, p in enumerate(["</s>", "<unk>", *pieces, *TAGS, "<pad>"])}


def opus_mt(directory: Path, *, shared: bool, activation: str, dtype: torch.dtype) -> Path:
    """An OPUS-MT-shaped directory: English source.spm, German target.spm (byte fallback), one vocab.json
    or two (separate_vocabs; of one size, as transformers' Marian needs), a MarianMTModel whose pad is its
    decoder start, a non-zero final_logits_bias, saved in dtype, and OPUS-MT's generation config."""
    directory.mkdir()
    models = [train_spm(lines("train.en.gz", 2000), False), train_spm(lines("train.de.gz", 2000), True)]
    (directory / "source.spm").write_bytes(models[0])
    (directory / "target.spm").write_bytes(models[1])
    vocab = opus_vocab(models)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    extra = {}
    if not shared:  # the target's own order: the same pieces, reversed between the specials
        middle = [p for p in vocab if p not in ("</s>", "<unk>", "<pad>")][::-1]
        target = {p: i for i, p in enumerate(["</s>", "<unk>", *middle, "<pad>"])}
        (directory / "target_vocab.json").write_text(json.dumps(target, ensure_ascii=False))
        extra = {"separate_vocabs": True, "target_vocab_file": str(directory / "target_vocab.json")}
    tokenizer = transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"), **extra
    )
    V = len(vocab)
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=128,
        activation_function=activation, pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0,
        share_encoder_decoder_embeddings=shared, tie_word_embeddings=shared, scale_embedding=True,
    )  # fmt: skip
    hf = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0.0, 1.0)
    hf.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[V - 1]], bos_token_id=0, decoder_start_token_id=V - 1, eos_token_id=0, max_length=128,
        num_beams=4, pad_token_id=V - 1,
    )  # fmt: skip
    hf.to(dtype).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["joint, swish, fp32", "two vocabularies, relu, fp16"])
def opus(request, tmp_path_factory):
    """(the OPUS-MT directory, MarianTokenizer of it, the aiayn import of it)."""
    shared = request.param.startswith("joint")
    root = tmp_path_factory.mktemp("opus")
    source = opus_mt(root / "hf", shared=shared, activation=request.param.split(", ")[1],
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
    return lines("val.en.gz", 1000) + odd


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
    german = lines("val.de.gz", 1000) + texts[-13:]
    assert [[tgt_of[i] for i in ids] for ids in tokenizer.encode_tgt(german)] == marian_ids(marian, german, True)
    # decoding: MarianTokenizer's text (where there is no <unk>, which aiayn shows and it leaves out)
    sample = [text for text, ids in zip(german, tokenizer.encode_tgt(german)) if UNK_ID not in ids][:200]
    want = marian.batch_decode(marian_ids(marian, sample, True), skip_special_tokens=True)
    assert tokenizer.decode_tgt(tokenizer.encode_tgt(sample)) == want


def test_the_import_gives_transformers_tokens_greedy_and_beam(opus):
    """40 sentences through aiayn's search on the import and through generate on the original (OPUS-MT's
    generation config: pad banned; the same output limit per sentence, the same length penalty; beams run
    until no live hypothesis can win, as aiayn's do). A random tied model repeats itself to the limit, so
    this compares long outputs; stopping at EOS is compared on the export's own tests."""
    from aiayn.inference.translate import Translator

    source, marian, imported = opus
    hf = transformers.MarianMTModel.from_pretrained(source, torch_dtype=torch.float32).eval()
    translator = Translator.load(imported)
    texts = lines("val.en.gz", 40, skip=100)
    assert load_search(imported).beam_size == 4
    outputs = set()
    for beam in (1, 4):
        config = translator.search_config.__class__(beam_size=beam, alpha=1.0, length_penalty="average")
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
