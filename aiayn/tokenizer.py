"""Subword vocabularies: train, save, load, text -> ids (EOS appended) -> text, and the special tokens.

Two kinds of vocabulary sit behind one Tokenizer: the ones aiayn trains (byte-level BPE or words, Hugging
Face `tokenizers` files), and SentencePiece ones as OPUS-MT's Marian models ship them, which `aiayn import`
brings in and fine-tuning keeps."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Protocol

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from aiayn.extras import need
from aiayn.files import atomic_write, write_contents

# The special tokens: the same strings and ids in every vocabulary this project trains, and the one
# source of these ids for the model, search and batching. The trainers give special tokens the first ids
# in list order, and _check_specials makes sure of it after training and after loading.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = MappingProxyType({PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>", UNK_ID: "<unk>"})
JOINT_FILE = "tokenizer.json"
SRC_FILE = "tokenizer.src.json"
TGT_FILE = "tokenizer.tgt.json"
SPM_FILE = "sentencepiece.json"  # the SentencePiece kind: pieces in aiayn's id order, beside its two models
SPM_SRC, SPM_TGT = "source.spm", "target.spm"  # OPUS-MT's names for them
LAYOUTS = (
    (JOINT_FILE,),
    (SRC_FILE, TGT_FILE),
    (SPM_FILE, SPM_SRC, SPM_TGT),
)  # the files of a directory's tokenizer

_N_BYTES = 256  # byte-level BPE starts from one symbol per byte
_WORD_MARK = "▁"  # Metaspace's mark for "a space came before this word"
_DROPPED_ON_DECODE = frozenset({PAD_ID, BOS_ID, EOS_ID})  # UNK stays visible as "<unk>"
_SURROGATE = re.compile("[\ud800-\udfff]")


class Vocabulary(Protocol):
    """One side's vocabulary, as the Tokenizer uses it: text -> ids (EOS appended) -> text."""

    @property
    def size(self) -> int: ...

    def tokens(self) -> list[str]: ...

    def encode(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[list[int]]) -> list[str]: ...


class Subwords:
    """A vocabulary aiayn trains (byte-level BPE or words): a Hugging Face `tokenizers` object."""

    def __init__(self, tok: HFTokenizer) -> None:
        # Text that happens to contain "</s>" or "<pad>" is text, not a control token. The library does
        # not save this flag in tokenizer.json, so it is set on every object, trained or loaded.
        tok.encode_special_tokens = True
        self.hf = tok

    @property
    def size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def tokens(self) -> list[str]:
        tokens = [self.hf.id_to_token(i) for i in range(self.size)]
        assert None not in tokens and len(set(tokens)) == len(tokens), "ids 0..V-1 map to V distinct tokens"
        return tokens

    def encode(self, texts: list[str]) -> list[list[int]]:
        _check_texts(texts)
        # No post-processor is configured: EOS is appended here, where it can be seen.
        return [enc.ids + [EOS_ID] for enc in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.hf.decode_batch(_kept(ids, self.size), skip_special_tokens=False)


class SentencePieces:
    """One side of a SentencePiece vocabulary as transformers' MarianTokenizer reads an OPUS-MT model's
    (source.spm or target.spm, and vocab.json): the SentencePiece model cuts text into pieces, and `pieces`
    (one per aiayn id) numbers them, not the model's own ids; a piece it lacks is <unk>. As MarianTokenizer
    does, the special tokens written in the text (`text_specials`, their ids) are split out first, and each
    stretch of text between them has a leading >>xx<< language tag as a token of its own."""

    def __init__(self, model: bytes, pieces: list[str], text_specials: Mapping[str, int], where: str) -> None:
        need("a SentencePiece vocabulary", "sentencepiece", "sentencepiece")
        import sentencepiece

        self.model = model
        self.pieces = list(pieces)
        self.text_specials = dict(text_specials)
        self.where = where
        self._ids = {piece: i for i, piece in enumerate(self.pieces)}
        if len(self._ids) != len(self.pieces):
            raise ValueError(f"{where}: the same piece has two ids")
        for i, token in SPECIAL_TOKENS.items():
            if self.pieces[i : i + 1] != [token]:
                raise ValueError(f"{where}: id {i} must be {token!r}, not {self.pieces[i : i + 1]}")
        if bad := {t: i for t, i in self.text_specials.items() if not 0 <= i < len(self.pieces)}:
            raise ValueError(f"{where}: special tokens outside the vocabulary: {bad}")
        self._spm = sentencepiece.SentencePieceProcessor()
        try:
            self._spm.LoadFromSerializedProto(model)
        except RuntimeError as e:  # sentencepiece's parse error (a damaged file)
            raise ValueError(f"{where}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        names = sorted(self.text_specials, key=len, reverse=True)  # the longest first, as a trie matches
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @property
    def size(self) -> int:
        return len(self.pieces)

    def tokens(self) -> list[str]:
        return list(self.pieces)

    def encode(self, texts: list[str]) -> list[list[int]]:
        _check_texts(texts)
        return [self._encode_one(text) + [EOS_ID] for text in texts]

    def _encode_one(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text) if self._split else [text]:
            if part in self.text_specials:
                ids.append(self.text_specials[part])
            elif part:
                tag = []
                if part.startswith(">>") and (end := part.find("<<")) != -1:
                    tag, part = [part[: end + 2]], part[end + 2 :]
                pieces = tag + self._spm.encode(part, out_type=str)
                ids.extend(self._ids.get(piece, UNK_ID) for piece in pieces)
        return ids

    def decode(self, ids: list[list[int]]) -> list[str]:
        texts = []
        for seq in _kept(ids, self.size):
            # As MarianTokenizer: <unk> is not a piece for the SentencePiece model to decode but is kept
            text, run = "", []
            for i in seq:
                if i == UNK_ID:
                    text += self._spm.decode_pieces(run) + SPECIAL_TOKENS[UNK_ID] + " "
                    run = []
                else:
                    run.append(self.pieces[i])
            texts.append((text + self._spm.decode_pieces(run)).replace(_WORD_MARK, " ").strip())
        return texts


class Tokenizer:
    """Source and target vocabularies (the same object when joint) turning text into ids and back."""

    def __init__(self, src: Vocabulary, tgt: Vocabulary, *, joint: bool) -> None:
        # joint: one id space for both sides. A trained one is one object; an OPUS-MT model's two
        # SentencePiece models (one per language) may share one list of pieces.
        assert type(src) is type(tgt), "both sides are of one kind"
        assert not joint or src is tgt or src.tokens() == tgt.tokens(), "a joint tokenizer has one vocabulary"
        self.joint = joint
        self._src = src
        self._tgt = tgt

    @classmethod
    def train(
        cls,
        src_texts: list[str],
        tgt_texts: list[str],
        *,
        vocab_size: int = 8000,
        kind: Literal["bpe", "word"] = "bpe",
        joint: bool = True,
        min_frequency: int = 2,
    ) -> Tokenizer:
        """Learn one vocabulary from source + target text (joint, §5.1) or one per side."""
        cls.check_options(vocab_size, kind, min_frequency)
        for name, texts in (("src_texts", src_texts), ("tgt_texts", tgt_texts)):
            if isinstance(texts, str):
                raise TypeError(f"{name} must be a list of strings, got one string")
            if not any(text.strip() for text in texts):
                raise ValueError(f"{name} has no text to train on ({len(texts)} lines, all blank)")
        if joint:
            shared = _train(
                itertools.chain(src_texts, tgt_texts),
                len(src_texts) + len(tgt_texts),
                kind=kind,
                vocab_size=vocab_size,
                min_frequency=min_frequency,
            )
            return cls(shared, shared, joint=True)
        src = _train(src_texts, len(src_texts), kind=kind, vocab_size=vocab_size, min_frequency=min_frequency)
        tgt = _train(tgt_texts, len(tgt_texts), kind=kind, vocab_size=vocab_size, min_frequency=min_frequency)
        return cls(src, tgt, joint=False)

    @classmethod
    def sentencepiece(
        cls,
        src_model: bytes,
        tgt_model: bytes,
        src_pieces: list[str],
        tgt_pieces: list[str] | None,
        text_specials: Mapping[str, int],
        where: str = "the SentencePiece vocabulary",
    ) -> Tokenizer:
        """A SentencePiece tokenizer: the two sides' SentencePiece models, their pieces in aiayn's id order
        (one list for both sides when tgt_pieces is None: joint), and the special tokens split out of text."""
        src = SentencePieces(src_model, src_pieces, text_specials, where)
        tgt = SentencePieces(
            tgt_model, src_pieces if tgt_pieces is None else tgt_pieces, text_specials, where
        )
        return cls(src, tgt, joint=tgt_pieces is None)

    @staticmethod
    def check_options(vocab_size: int, kind: str, min_frequency: int = 2) -> None:
        """Refuse options that cannot make a vocabulary (before any text is read)."""
        if kind not in ("bpe", "word"):
            raise ValueError(f"kind must be 'bpe' or 'word', got {kind!r}")
        smallest = len(SPECIAL_TOKENS) + (_N_BYTES if kind == "bpe" else 1)
        if vocab_size < smallest:
            what = f"{_N_BYTES} byte symbols" if kind == "bpe" else "one word"
            raise ValueError(
                f"vocab_size={vocab_size} is too small for kind={kind!r}: it must hold the "
                f"{len(SPECIAL_TOKENS)} special tokens and {what}, at least {smallest}"
            )
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be at least 1, got {min_frequency}")

    def files(self) -> dict[str, str | bytes]:
        """{file name: contents}: tokenizer.json (joint) or tokenizer.src.json + tokenizer.tgt.json; for
        SentencePiece, source.spm, target.spm and sentencepiece.json (the pieces, once when joint)."""
        src, tgt = self._src, self._tgt
        if isinstance(src, SentencePieces) and isinstance(tgt, SentencePieces):
            sides = (
                {"pieces": src.pieces}
                if self.joint
                else {"source_pieces": src.pieces, "target_pieces": tgt.pieces}
            )
            record = {**sides, "text_specials": src.text_specials}
            text = json.dumps(record, ensure_ascii=False, indent=0) + "\n"
            return {SPM_SRC: src.model, SPM_TGT: tgt.model, SPM_FILE: text}
        assert isinstance(src, Subwords) and isinstance(tgt, Subwords)
        if self.joint:
            return {JOINT_FILE: src.hf.to_str()}
        return {SRC_FILE: src.hf.to_str(), TGT_FILE: tgt.hf.to_str()}

    def save(self, directory: str | Path) -> None:
        """Write files(), each atomically, and remove the other layouts' files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.files().items():
            atomic_write(directory / name, lambda tmp, data=data: write_contents(tmp, data))
        for name in self.stale_files():  # a directory saved over with another layout must not hold both
            (directory / name).unlink(missing_ok=True)

    def stale_files(self) -> tuple[str, ...]:
        """The other layouts' file names, which a directory holding this tokenizer must not keep."""
        mine = (
            LAYOUTS[2] if isinstance(self._src, SentencePieces) else LAYOUTS[0] if self.joint else LAYOUTS[1]
        )
        return tuple(name for layout in LAYOUTS if layout != mine for name in layout)

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read what save() wrote; ValueError naming the directory or file if it is missing or broken."""
        directory = Path(directory)
        found = tuple(name for layout in LAYOUTS for name in layout if (directory / name).is_file())
        if found == (JOINT_FILE,):
            shared = _read(directory / JOINT_FILE)
            return cls(shared, shared, joint=True)
        if found == (SRC_FILE, TGT_FILE):
            return cls(_read(directory / SRC_FILE), _read(directory / TGT_FILE), joint=False)
        if found == (SPM_FILE, SPM_SRC, SPM_TGT):
            return _read_sentencepiece(directory)
        expected = " or ".join(" with ".join(layout) for layout in LAYOUTS)
        if not found:
            raise ValueError(f"no tokenizer in {directory}: expected {expected}")
        raise ValueError(f"{directory} holds {', '.join(found)}: expected {expected}")

    @classmethod
    def from_files(cls, src: str | Path, tgt: str | Path | None = None) -> Tokenizer:
        """Vocabularies from tokenizer files of any name (a transformers export's tokenizer.json, and its
        target's): one, joint, without tgt. ValueError naming a file that is missing or broken."""
        for path in (src, tgt):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"no tokenizer file {path}")
        if tgt is None:
            shared = _read(Path(src))
            return cls(shared, shared, joint=True)
        return cls(_read(Path(src)), _read(Path(tgt)), joint=False)

    def with_dropout(self, p: float, target: bool = True) -> Tokenizer:
        """A copy whose BPE leaves out each merge with probability p while encoding (BPE-dropout, Provilkov
        et al., 2020): many segmentations of one text from one vocabulary, for training only; of the
        source side alone when not target. Decoding is unchanged. The library draws from an unseeded
        generator, so two calls segment differently."""
        if not 0.0 < p < 1.0:
            raise ValueError(f"BPE-dropout must be in (0, 1), got {p}")
        copies = {}
        for side in (self._src, self._tgt) if target else (self._src,):
            if not isinstance(side, Subwords) or not isinstance(side.hf.model, models.BPE):
                raise ValueError("BPE-dropout needs a BPE vocabulary (--tokenizer bpe), not a word-level one")
            if id(side) not in copies:
                copy = HFTokenizer.from_str(side.hf.to_str())
                copy.model.dropout = p
                copies[id(side)] = Subwords(copy)
        if not target:  # two objects now, so not joint, though it encodes with the one vocabulary
            return Tokenizer(copies[id(self._src)], self._tgt, joint=False)
        return Tokenizer(copies[id(self._src)], copies[id(self._tgt)], joint=self.joint)

    @property
    def src_vocab_size(self) -> int:
        return self._src.size

    @property
    def tgt_vocab_size(self) -> int:
        return self._tgt.size

    def src_tokens(self) -> list[str]:
        """The source vocabulary as token strings in id order (for engines that take tokens, not ids)."""
        return self._src.tokens()

    def tgt_tokens(self) -> list[str]:
        """The target vocabulary as token strings in id order."""
        return self._tgt.tokens()

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids, EOS appended, no BOS."""
        return self._src.encode(texts)

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids, EOS appended, no BOS (training prepends BOS to form the decoder input)."""
        return self._tgt.encode(texts)

    def decode_src(self, ids: list[list[int]]) -> list[str]:
        """Text from source ids; pad, bos and eos are dropped, unknown ids read "<unk>"."""
        return self._src.decode(ids)

    def labels(self, ids: list[int], side: Literal["src", "tgt"]) -> list[str]:
        """One readable label per id, for pictures: its text piece (a space shown as ▁), the special
        tokens other than unk by name."""
        decode = self.decode_src if side == "src" else self.decode_tgt
        names = {i: token for i, token in SPECIAL_TOKENS.items() if i != UNK_ID}
        return [names.get(i) or decode([[i]])[0].replace(" ", "▁") or "·" for i in ids]

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        """Text from target ids; pad, bos and eos are dropped, unknown ids read "<unk>"."""
        return self._tgt.decode(ids)


def _train(
    texts: Iterable[str], length: int, *, kind: Literal["bpe", "word"], vocab_size: int, min_frequency: int
) -> Subwords:
    specials = [SPECIAL_TOKENS[i] for i in range(len(SPECIAL_TOKENS))]
    if kind == "bpe":
        # Byte-level BPE: every string is a byte sequence over a 256-symbol alphabet, so no character is
        # ever unknown and decode(encode(s)) == s for every s (no normalizer either, for the same reason).
        # add_prefix_space=False keeps that exact; the price is that a sentence-initial word and the same
        # word after a space are different tokens.
        tok = HFTokenizer(models.BPE(unk_token=SPECIAL_TOKENS[UNK_ID]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        # Words: whitespace runs become one space, the Metaspace mark records which words followed a
        # space, and punctuation is split off unmarked, so "shirt." -> "▁shirt" "." and decoding puts
        # the spaces back exactly. Unknown words become <unk>, which swallows the word's mark; the
        # Replace decoder gives it back so "a <unk> b" does not decode as "a<unk> b".
        tok = HFTokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS[UNK_ID]))
        tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Metaspace(replacement=_WORD_MARK, prepend_scheme="always", split=True),
                pre_tokenizers.Punctuation(behavior="isolated"),
            ]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace(SPECIAL_TOKENS[UNK_ID], _WORD_MARK + SPECIAL_TOKENS[UNK_ID]),
                decoders.Metaspace(replacement=_WORD_MARK, prepend_scheme="always", split=True),
            ]
        )
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials, show_progress=False
        )
    tok.train_from_iterator(texts, trainer, length=length)
    _check_specials(tok, "the trained vocabulary")
    return Subwords(tok)


def _check_specials(tok: HFTokenizer, where: str) -> None:
    for expected, token in SPECIAL_TOKENS.items():
        got = tok.token_to_id(token)
        if got != expected:
            raise ValueError(f"{where}: special token {token!r} has id {got}, expected {expected}")


def _check_texts(texts: list[str]) -> None:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, got one string")
    for number, text in enumerate(texts, start=1):
        # A lone surrogate (from errors="surrogateescape" decoding) is not Unicode text; the libraries
        # would reject it with an error that does not say which text or why.
        if not text.isascii() and (bad := _SURROGATE.search(text)):
            raise ValueError(
                f"text {number} holds the lone surrogate U+{ord(bad.group()):04X}, which is not Unicode text "
                "(undecodable bytes read with errors='surrogateescape'?)"
            )


def _kept(ids: list[list[int]], vocab_size: int) -> list[list[int]]:
    """The ids to decode: pad, bos and eos dropped; an id out of range is a ValueError (the libraries
    skip ids they do not know, but one means the model and the vocabulary do not belong together)."""
    kept = [[i for i in seq if i not in _DROPPED_ON_DECODE] for seq in ids]
    for seq in kept:
        if seq and (min(seq) < 0 or max(seq) >= vocab_size):
            bad = next(i for i in seq if not 0 <= i < vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary of {vocab_size}")
    return kept


def _read(path: Path) -> Subwords:
    """A tokenizer file, checked before the library parses it: the library reports every problem with a
    bare Exception, which cannot be told apart from a bug, so what it would refuse is refused here first."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid tokenizer file: not UTF-8 JSON ({e})") from None
    model = data.get("model") if isinstance(data, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in ("BPE", "WordLevel") or not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{path} is not a valid tokenizer file: no BPE or WordLevel model with a vocabulary")
    if kind == "BPE" and not isinstance(model.get("merges"), list):
        raise ValueError(f"{path} is not a valid tokenizer file: a BPE model without its merges")
    tok = HFTokenizer.from_str(json.dumps(data))
    _check_specials(tok, str(path))
    return Subwords(tok)


def _read_sentencepiece(directory: Path) -> Tokenizer:
    """What Tokenizer.save wrote of a SentencePiece tokenizer; a ValueError naming a broken file."""
    path = directory / SPM_FILE
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid SentencePiece vocabulary: not UTF-8 JSON ({e})") from None
    joint = isinstance(record, dict) and "pieces" in record
    keys = ("pieces",) if joint else ("source_pieces", "target_pieces")
    lists = [record.get(k) if isinstance(record, dict) else None for k in keys]
    specials = record.get("text_specials") if isinstance(record, dict) else None
    if not all(
        isinstance(pieces, list) and all(isinstance(p, str) for p in pieces) for pieces in lists
    ) or not (isinstance(specials, dict) and all(isinstance(i, int) for i in specials.values())):
        raise ValueError(f"{path} is not a valid SentencePiece vocabulary: expected {', '.join(keys)} "
                         "(lists of pieces) and text_specials (piece: id)")  # fmt: skip
    src, tgt = (directory / SPM_SRC).read_bytes(), (directory / SPM_TGT).read_bytes()
    return Tokenizer.sentencepiece(src, tgt, lists[0], None if joint else lists[1], specials, str(directory))
