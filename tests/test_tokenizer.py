"""Tests for aiayn.tokenizer: exact round trips, stable special ids, save/load, unknown text, errors."""

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from aiayn.tokenizer import BOS_ID, EOS_ID, JOINT_FILE, PAD_ID, SRC_FILE, TGT_FILE, UNK_ID, Tokenizer

EN_SUBJECTS = ["A man", "The woman", "Two dogs", "A little girl", "The old fisherman", "Three children"]
EN_VERBS = ["is walking", "runs", "sits", "is playing", "jumps", "looks"]
EN_PLACES = ["in the park", "on the beach", "near a red car", "under a tree", "in a cafe", "on the street"]
DE_SUBJECTS = ["Ein Mann", "Die Frau", "Zwei Hunde", "Ein kleines Mädchen", "Der alte Fischer", "Drei Kinder"]
DE_VERBS = ["geht", "läuft", "sitzt", "spielt", "springt", "schaut"]
DE_PLACES = [
    "im Park",
    "am Strand",
    "neben einem roten Auto",
    "unter einem Baum",
    "über die Straße",
    "im Café",
]
ENDINGS = [".", "!", "?", ", 2 times.", " at 10:30.", ". It is 3.5 km away."]


def make_corpus(seed: int, n: int = 300) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        s, v, p, e = (rng.randrange(6) for _ in range(4))
        src.append(f"{EN_SUBJECTS[s]} {EN_VERBS[v]} {EN_PLACES[p]}{ENDINGS[e]}")
        tgt.append(f"{DE_SUBJECTS[s]} {DE_VERBS[v]} {DE_PLACES[p]}{ENDINGS[e]}")
    return src, tgt


SRC, TGT = make_corpus(seed=0)

# Ordinary text, none of it copied from the corpus: punctuation, digits, accents, umlauts, two sentences.
ORDINARY = [
    "A man, in a red shirt.",
    "Zoë's café costs 3,50 €; the crème brûlée is 12.99!",
    "Größere Hunde laufen über die Brücke. Ein Mädchen schaut zu.",
    '"Where is it?" she asked -- twice (at 10:30).',
    "Ça va? Très bien. Äpfel, Öl und Übung sind schön.",
    "Numbers: 1, 22, 333, 4444 and 3.14159.",
]
UNKNOWN = ["Ein Hund 🐕 läuft in 東京.", "zero\x00width\u200bspace", "😀", "日本語のテキスト"]


@pytest.fixture(scope="module")
def bpe_joint() -> Tokenizer:
    return Tokenizer.train(SRC, TGT, vocab_size=400)


@pytest.fixture(scope="module")
def bpe_separate() -> Tokenizer:
    return Tokenizer.train(SRC, TGT, vocab_size=5000, joint=False)


@pytest.fixture(scope="module")
def word() -> Tokenizer:
    return Tokenizer.train(SRC, TGT, vocab_size=5000, kind="word", min_frequency=1)


def test_bpe_joint_round_trip_is_exact(bpe_joint: Tokenizer) -> None:
    assert bpe_joint.joint
    assert bpe_joint.src_vocab_size == bpe_joint.tgt_vocab_size == 400
    texts = ORDINARY + SRC[:50] + TGT[:50]
    assert bpe_joint.decode_src(bpe_joint.encode_src(texts)) == texts
    assert bpe_joint.decode_tgt(bpe_joint.encode_tgt(texts)) == texts
    # One shared vocabulary: both sides give the same ids.
    assert bpe_joint.encode_src(texts) == bpe_joint.encode_tgt(texts)
    # EOS appended, no BOS, no other special id inside.
    for ids in bpe_joint.encode_src(texts):
        assert ids[-1] == EOS_ID and not {PAD_ID, BOS_ID, EOS_ID, UNK_ID} & set(ids[:-1])
    # Merges were learned: corpus text takes far fewer tokens than bytes.
    n_tokens = sum(len(ids) - 1 for ids in bpe_joint.encode_src(SRC))
    assert n_tokens < 0.5 * sum(len(text.encode()) for text in SRC)


def test_bpe_separate_vocabularies_are_independent(bpe_separate: Tokenizer) -> None:
    assert not bpe_separate.joint
    # With a large cap the trainer stops when no pair is frequent enough, which depends on each corpus.
    assert bpe_separate.src_vocab_size != bpe_separate.tgt_vocab_size
    assert bpe_separate.decode_src(bpe_separate.encode_src(ORDINARY + SRC)) == ORDINARY + SRC
    assert bpe_separate.decode_tgt(bpe_separate.encode_tgt(ORDINARY + TGT)) == ORDINARY + TGT
    # A German phrase is one or two tokens in the German vocabulary, many in the English one.
    (in_tgt,) = bpe_separate.encode_tgt(["neben einem roten Auto"])
    (in_src,) = bpe_separate.encode_src(["neben einem roten Auto"])
    assert len(in_tgt) < len(in_src) - 4
    # A vocabulary trained on the German side alone is the target vocabulary.
    german_only = Tokenizer.train(TGT, TGT, vocab_size=5000, joint=False)
    assert german_only.src_vocab_size == bpe_separate.tgt_vocab_size
    assert german_only.encode_src(ORDINARY) == bpe_separate.encode_tgt(ORDINARY)


def test_word_level_round_trip_and_unknown_words(word: Tokenizer) -> None:
    assert word.decode_src(word.encode_src(SRC)) == SRC
    assert word.decode_tgt(word.encode_tgt(TGT)) == TGT
    (ids,) = word.encode_src(["A man, in a red car."])
    assert len(ids) == 9 and UNK_ID not in ids  # A man , in a red car . </s>
    assert word.decode_src([ids]) == ["A man, in a red car."]
    # "shirt" never occurs in the corpus: one unknown word, the rest intact, spacing kept.
    (ids,) = word.encode_src(["A man, in a red shirt."])
    assert ids.count(UNK_ID) == 1 and ids[6] == UNK_ID
    assert word.decode_src([ids]) == ["A man, in a red <unk>."]
    assert word.decode_src(word.encode_src(["shirt man"])) == ["<unk> man"]
    # Whitespace of any kind separates words.
    assert word.encode_src(["A  man\tsits\n"]) == word.encode_src(["A man sits"])
    # Separate vocabularies: English words are unknown on the German side.
    separate = Tokenizer.train(SRC, TGT, vocab_size=5000, kind="word", joint=False, min_frequency=1)
    assert separate.src_vocab_size != separate.tgt_vocab_size
    assert UNK_ID not in separate.encode_tgt(["Ein Mann"])[0]
    assert separate.encode_tgt(["man"]) == [[UNK_ID, EOS_ID]]
    assert separate.encode_src(["man"])[0][0] != UNK_ID


def test_word_vocab_size_caps_and_min_frequency_filters() -> None:
    capped = Tokenizer.train(SRC, TGT, vocab_size=20, kind="word", min_frequency=1)
    assert capped.src_vocab_size == 20
    rare = ["the rare word here", "the"]
    filtered = Tokenizer.train(rare, rare, vocab_size=100, kind="word", min_frequency=3)
    # "▁the" occurs four times; every other word only twice.
    assert filtered.src_vocab_size == 5
    assert filtered.encode_src(["the rare"]) == [[4, UNK_ID, EOS_ID]]


def _specials_in_file(path) -> dict[int, str]:
    return {t["id"]: t["content"] for t in json.loads(path.read_text())["added_tokens"] if t["special"]}


@pytest.mark.parametrize("layout", ["bpe_joint", "bpe_separate", "word"])
def test_save_load_keeps_ids_and_encodings(layout: str, request: pytest.FixtureRequest, tmp_path) -> None:
    tok: Tokenizer = request.getfixturevalue(layout)
    tok.save(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ([JOINT_FILE] if tok.joint else [SRC_FILE, TGT_FILE])  # no temporary files left
    for name in files:
        assert _specials_in_file(tmp_path / name) == {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}
    loaded = Tokenizer.load(tmp_path)
    assert loaded.joint == tok.joint
    assert (loaded.src_vocab_size, loaded.tgt_vocab_size) == (tok.src_vocab_size, tok.tgt_vocab_size)
    texts = ORDINARY + UNKNOWN + SRC[:20] + ["", "a </s> b <pad>"]
    assert loaded.encode_src(texts) == tok.encode_src(texts)
    assert loaded.encode_tgt(texts) == tok.encode_tgt(texts)
    ids = tok.encode_tgt(texts)
    assert loaded.decode_tgt(ids) == tok.decode_tgt(ids)


@pytest.mark.parametrize("layout", ["bpe_joint", "word"])
def test_special_ids_are_dropped_and_special_strings_are_text(
    layout: str, request: pytest.FixtureRequest
) -> None:
    tok: Tokenizer = request.getfixturevalue(layout)
    (ids,) = tok.encode_tgt(["A man sits."])
    padded = [BOS_ID, *ids, PAD_ID, PAD_ID]
    assert tok.decode_tgt([padded, ids]) == ["A man sits.", "A man sits."]
    # A literal "</s>" in the text must not end the sentence early.
    for text in ["a </s> b", "<pad><s>"]:
        (ids,) = tok.encode_src([text])
        assert ids.index(EOS_ID) == len(ids) - 1 and PAD_ID not in ids and BOS_ID not in ids
        if layout == "bpe_joint":
            assert tok.decode_src([ids]) == [text]


def test_saving_the_other_layout_replaces_the_files(
    bpe_joint: Tokenizer, bpe_separate: Tokenizer, tmp_path
) -> None:
    bpe_separate.save(tmp_path)
    bpe_joint.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [JOINT_FILE]
    assert Tokenizer.load(tmp_path).joint
    bpe_separate.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SRC_FILE, TGT_FILE]
    assert not Tokenizer.load(tmp_path).joint


def test_unknown_characters(bpe_joint: Tokenizer, word: Tokenizer) -> None:
    # Byte-level BPE has no unknown characters: exact round trip, no UNK.
    ids = bpe_joint.encode_src(UNKNOWN)
    assert all(UNK_ID not in seq for seq in ids)
    assert bpe_joint.decode_src(ids) == UNKNOWN
    # Word level: unknown words become UNK, known words and spacing survive.
    ids = word.encode_tgt(UNKNOWN)
    assert word.decode_tgt(ids) == ["Ein <unk> <unk> läuft in <unk>.", "<unk>", "<unk>", "<unk>"]


@pytest.mark.parametrize("layout", ["bpe_joint", "bpe_separate", "word"])
def test_empty_string(layout: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(layout)
    assert tok.encode_src([""]) == tok.encode_tgt([""]) == [[EOS_ID]]
    assert tok.decode_src([[EOS_ID], []]) == tok.decode_tgt([[EOS_ID], [PAD_ID]]) == ["", ""]
    assert tok.encode_src([]) == [] and tok.decode_tgt([]) == []


def test_training_errors() -> None:
    with pytest.raises(ValueError, match="vocab_size=259"):
        Tokenizer.train(SRC, TGT, vocab_size=259)
    assert Tokenizer.train(SRC, TGT, vocab_size=260).src_vocab_size == 260  # specials + 256 bytes fits
    with pytest.raises(ValueError, match="vocab_size=4"):
        Tokenizer.train(SRC, TGT, vocab_size=4, kind="word")
    with pytest.raises(ValueError, match="src_texts"):
        Tokenizer.train([], TGT)
    with pytest.raises(ValueError, match="tgt_texts"):
        Tokenizer.train(SRC, ["", "  \n"], joint=False)
    with pytest.raises(ValueError, match="'char'"):
        Tokenizer.train(SRC, TGT, kind="char")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_frequency"):
        Tokenizer.train(SRC, TGT, min_frequency=0)
    with pytest.raises(TypeError, match="one string"):
        Tokenizer.train("corpus.txt", TGT)  # type: ignore[arg-type]


def test_use_errors(bpe_joint: Tokenizer) -> None:
    with pytest.raises(ValueError, match="400"):
        bpe_joint.decode_tgt([[5, 400]])
    with pytest.raises(ValueError, match="-1"):
        bpe_joint.decode_src([[-1]])
    with pytest.raises(TypeError, match="one string"):
        bpe_joint.encode_src("A man.")  # type: ignore[arg-type]


def test_load_errors(bpe_joint: Tokenizer, tmp_path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(ValueError, match="nothing-here"):
        Tokenizer.load(missing)
    bpe_joint.save(tmp_path)
    (tmp_path / SRC_FILE).write_text("{}")
    with pytest.raises(ValueError, match=f"{tmp_path}.*{JOINT_FILE}, {SRC_FILE}"):
        Tokenizer.load(tmp_path)  # ambiguous: two layouts
    (tmp_path / SRC_FILE).unlink()
    for corrupt in [b'{"version": "1.0", "model":', b"\xff\xfe garbage", b"{}"]:
        (tmp_path / JOINT_FILE).write_bytes(corrupt)
        with pytest.raises(ValueError, match=JOINT_FILE):
            Tokenizer.load(tmp_path)
    # A valid tokenizer file whose special ids are not ours.
    foreign = HFTokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3}, unk_token="<unk>"))
    foreign.add_special_tokens(["<unk>", "<pad>", "<s>", "</s>"])
    foreign.save(str(tmp_path / JOINT_FILE))
    with pytest.raises(ValueError, match="'<pad>' has id 1, expected 0"):
        Tokenizer.load(tmp_path)


def _random_text(rng: random.Random) -> str:
    chars = []
    for _ in range(rng.randrange(0, 25)):
        low, high = rng.choice(
            [
                (0, 0x20),
                (0x20, 0x7F),
                (0x7F, 0x250),
                (0x2000, 0x2070),
                (0x4E00, 0x9FFF),
                (0x1F300, 0x1FAFF),
                (0, 0x10FFFF),
            ]
        )
        code = rng.randrange(low, high)
        if 0xD800 <= code <= 0xDFFF:  # lone surrogates cannot come from a UTF-8 file
            code = 0xFFFD
        chars.append(chr(code))
    return "".join(chars)


@pytest.mark.parametrize("layout", ["bpe_joint", "bpe_separate", "word"])
def test_random_unicode_fuzz(layout: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(layout)
    rng = random.Random(1234)
    texts = [_random_text(rng) for _ in range(300)]
    for encode, decode, size in [
        (tok.encode_src, tok.decode_src, tok.src_vocab_size),
        (tok.encode_tgt, tok.decode_tgt, tok.tgt_vocab_size),
    ]:
        ids = encode(texts)
        assert len(ids) == len(texts)
        assert all(seq[-1] == EOS_ID and all(0 <= i < size for i in seq) for seq in ids)
        decoded = decode(ids)
        assert len(decoded) == len(texts)
        if layout.startswith("bpe"):
            assert decoded == texts  # bytes in, bytes out
        else:
            assert all(isinstance(text, str) for text in decoded)
        # Random token ids, including partial UTF-8 byte sequences, decode without raising.
        random_ids = [[rng.randrange(size) for _ in range(rng.randrange(10))] for _ in range(100)]
        assert len(decode(random_ids)) == 100
