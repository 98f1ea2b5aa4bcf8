"""Seeded fuzzing of everything that takes outside input: random bytes, lengths and Unicode into the
tokenizer, the data readers and Translator.translate. The only exception allowed is the documented
ValueError, and every translation call gives one output per input, in order, empty for empty."""

import gzip
import random
import re

import pytest
import torch

from aiayn.config import SearchConfig, preset
from aiayn.data.corpus import read_parallel, read_tsv
from aiayn.data.synthetic import generate
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, Tokenizer

SRC, TGT = generate(120, seed=6)

# Characters that have broken text pipelines: line and paragraph separators, NUL and other controls,
# combining marks, a byte order mark, right-to-left text, emoji with joiners, the special tokens as text.
TRICKY = [
    "\n", "\r", "\r\n", "\t", "\x00", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "\u0301", "\ufeff",
    "\u200d", "\u202e", "שלום", "🙂", "👩‍👩‍👧", "</s>", "<pad>", "<unk>", "<s>", " ", "  ", "\ufffd",
]  # fmt: skip


def random_text(rng: random.Random) -> str:
    """Random length (often 0), drawn from ASCII, the tricky list, any code point, or raw bytes."""
    n = rng.choice([0, 1, 2, rng.randrange(40), rng.randrange(200)])
    kind = rng.randrange(5)
    if kind == 0:
        return "".join(rng.choice(TRICKY + list("ab .,")) for _ in range(n))
    if kind == 1:  # any code point, lone surrogates included (they must be a ValueError)
        return "".join(chr(rng.randrange(0x110000)) for _ in range(n))
    if kind == 2:
        return rng.randbytes(n).decode("utf-8", errors=rng.choice(["replace", "surrogateescape"]))
    if kind == 3:
        return " ".join(rng.choice(SRC).split()[: n // 10 + 1])  # in-domain words
    return "".join(chr(rng.randrange(32, 127)) for _ in range(n))


SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(texts: list[str]) -> bool:
    return any(SURROGATE.search(t) for t in texts)


@pytest.fixture(scope="module")
def tokenizers() -> list[Tokenizer]:
    return [
        Tokenizer.train(SRC, TGT, vocab_size=300),
        Tokenizer.train(SRC, TGT, vocab_size=300, kind="word", joint=False),
    ]


def test_tokenizer_fuzz(tokenizers):
    rng = random.Random(0)
    for case in range(300):
        tok = tokenizers[case % 2]
        texts = [random_text(rng) for _ in range(rng.randrange(4))]
        if has_surrogate(texts):
            with pytest.raises(ValueError, match="lone surrogate"):
                tok.encode_src(texts)
            continue
        for encode, decode, size in (
            (tok.encode_src, tok.decode_src, tok.src_vocab_size),
            (tok.encode_tgt, tok.decode_tgt, tok.tgt_vocab_size),
        ):
            ids = encode(texts)
            assert len(ids) == len(texts)
            assert all(seq[-1] == EOS_ID and all(0 <= i < size for i in seq) for seq in ids)
            assert len(decode(ids)) == len(texts)
        # Random ids: in range they decode to text, out of range they are the documented ValueError.
        ids = [[rng.randrange(-3, tok.tgt_vocab_size + 3) for _ in range(rng.randrange(8))]]
        if all(0 <= i < tok.tgt_vocab_size for i in ids[0]):
            assert isinstance(tok.decode_tgt(ids)[0], str)
        else:
            with pytest.raises(ValueError, match="outside the vocabulary"):
                tok.decode_tgt(ids)


def test_a_random_tokenizer_file_is_a_value_error(tmp_path):
    rng = random.Random(1)
    for _ in range(30):
        (tmp_path / "tokenizer.json").write_bytes(rng.randbytes(rng.randrange(200)))
        with pytest.raises(ValueError, match="tokenizer.json"):
            Tokenizer.load(tmp_path)


def random_file_bytes(rng: random.Random) -> bytes:
    """Random bytes with many newlines, sometimes valid UTF-8, sometimes gzipped, truncated or not."""
    lines = [rng.randbytes(rng.randrange(12)).replace(b"\n", b"") for _ in range(rng.randrange(6))]
    if rng.random() < 0.4:
        lines = [line.decode("utf-8", errors="replace").encode() for line in lines]
    if rng.random() < 0.3:
        lines = [line + b"\t" + line for line in lines]
    data = b"\n".join(lines) + rng.choice([b"", b"\n", b"\r\n"])
    return data


def test_reader_fuzz(tmp_path):
    """Random files: a result of aligned lists, or ValueError; never another exception."""
    rng = random.Random(2)
    outcomes = {"read": 0, "ValueError": 0}
    for case in range(200):
        directory = tmp_path / str(case)
        directory.mkdir()
        names = []
        for lang in ("de", "en"):
            data = random_file_bytes(rng)
            name = f"p.{lang}"
            if rng.random() < 0.25:
                name += ".gz"
                data = gzip.compress(data)
                if rng.random() < 0.5:  # a damaged download
                    data = data[: rng.randrange(len(data))] if rng.random() < 0.5 else rng.randbytes(30)
            (directory / name).write_bytes(data)
            names.append(name)
        (directory / "p.tsv").write_bytes(random_file_bytes(rng))
        errors = rng.choice(["strict", "replace"])
        for read, args in (
            (read_parallel, (directory / "p", "de", "en")),
            (read_tsv, (directory / "p.tsv",)),
        ):
            try:
                src, tgt = read(*args, errors=errors)
            except ValueError as e:
                assert str(directory) in str(e), e  # every error names the file
                outcomes["ValueError"] += 1
            else:
                assert len(src) == len(tgt) and all(isinstance(s, str) for s in src + tgt)
                assert not any("\n" in s for s in src + tgt)
                outcomes["read"] += 1
    assert min(outcomes.values()) > 50  # both outcomes are exercised


def test_replace_reads_any_aligned_plain_files(tmp_path):
    """With errors="replace", line-aligned plain files of any bytes always read, one pair per line."""
    rng = random.Random(3)
    for case in range(50):
        n = rng.randrange(6)
        for lang in ("de", "en"):
            lines = [rng.randbytes(rng.randrange(12)).replace(b"\n", b"") for _ in range(n)]
            (tmp_path / f"{case}.{lang}").write_bytes(b"".join(line + b"\n" for line in lines))
        src, tgt = read_parallel(tmp_path / str(case), "de", "en", errors="replace")
        assert len(src) == len(tgt) == n


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_translator_fuzz(tokenizers, positions):
    """One output per input, in order, empty for empty; the only error is a documented ValueError: a lone
    surrogate, or (learned positions) an input longer than max_positions."""
    tok = tokenizers[0]
    torch.manual_seed(0)
    config = preset(
        "tiny", vocab_size=tok.src_vocab_size, d_model=32, d_ff=64, positions=positions, max_positions=64
    )
    translator = Translator(Transformer(config), tok, SearchConfig(beam_size=2, max_len_a=0.5, max_len_b=5))
    rng = random.Random(4)
    translated = 0
    for case in range(60):
        texts = [random_text(rng) for _ in range(rng.randrange(5))]
        if has_surrogate(texts):
            with pytest.raises(ValueError, match="lone surrogate"):
                translator.translate(texts)
            continue
        too_long = positions == "learned" and any(len(ids) > 64 for ids in tok.encode_src(texts))
        if too_long:
            with pytest.raises(ValueError, match="more than max_positions=64"):
                translator.translate(texts)
            continue
        beam_size = rng.choice([1, 2])
        outputs = translator.translate(texts, beam_size=beam_size)
        assert len(outputs) == len(texts) and all(isinstance(o, str) for o in outputs)
        assert all(o == "" for t, o in zip(texts, outputs) if t == "")
        if case % 5 == 0:  # in order: each output is what its input alone gives
            assert outputs == [translator.translate([t], beam_size=beam_size)[0] for t in texts]
        translated += 1
    assert translated > 30  # most cases get past the documented errors
