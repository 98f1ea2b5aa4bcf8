"""A corpus prepared for training: its token ids in memory-mapped files, read once through the tokenizer
in chunks, so that a corpus larger than memory trains, and every process of a run shares one copy.

A prepared directory (DATA, or OUT/data when `aiayn train` prepares its own) holds:
  manifest.json     what it holds and how it was made: counts, the cleaning report, digests, languages
  tokenizer files   the vocabulary the ids come from (trained on a bounded sample of the training pairs)
  src.bin tgt.bin   the ids of every kept training pair, one sentence after another, each ending with
                    EOS: uint16 when the vocabulary allows, else uint32
  src.len tgt.len   tokens per sentence (uint32), in the same order
  src.K.bin ...     with BPE-dropout (--bpe-dropout P): K = 1..views more segmentations of the same pairs,
                    each drawn once here with the merges left out at random, one per epoch in turn
  valid.json        the validation pairs, as text (BLEU is computed on text)
It is written under a temporary name and renamed whole (`Prepared.commit`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiayn.config import choose, recipe
from aiayn.data.corpus import (
    Corpus,
    Errors,
    TextDigest,
    blank,
    clean_pairs,
    held_out,
    hf_splits,
    iter_pairs,
    parse_hf,
    read_pairs,
    rereadable,
    text_digest,
)
from aiayn.files import TMP_SUFFIX, check_replaceable, replace_dir, write_text, writing
from aiayn.tokenizer import BOS_ID, PAD_ID, Tokenizer

MANIFEST, VALID = "manifest.json", "valid.json"
FORMAT = 1
CHUNK = 10_000  # pairs encoded at a time
SAMPLE = 1_000_000  # training pairs the tokenizer learns from, at most (a uniform sample)
VIEWS = 16  # BPE-dropout segmentations of the training pairs, by default (each as large as the ids)

PairSource = Callable[[], Iterator[tuple[str, str]]]  # gives the raw pairs again at every call


class Ids(Sequence):
    """Token ids of many sentences in one flat array (memory-mapped): sentence i is flat[o[i]:o[i+1]]."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray):
        self.flat, self.lengths = flat, lengths
        self._offsets: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        """(n + 1,) where each sentence starts, computed when first needed (opening reads no ids);
        4 bytes an offset while the ids fit (4.5M pairs of 30 tokens: 18 MB instead of 36)."""
        if self._offsets is None:
            dtype = np.uint32 if len(self.flat) < np.iinfo(np.uint32).max else np.int64
            self._offsets = np.zeros(len(self.lengths) + 1, dtype=dtype)
            np.cumsum(self.lengths, out=self._offsets[1:], dtype=dtype)
        return self._offsets

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: Any) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def padded(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sentences `rows` (B,) padded to the longest of them: ids (B, W) int64 and the mask (B, W) of
        real tokens, in one gather from the flat array instead of a copy a sentence."""
        lengths = self.lengths[rows].astype(np.int64)  # (B,)
        columns = np.arange(int(lengths.max(initial=0)))  # (W,)
        real = columns < lengths[:, None]  # (B, W)
        out = np.full(real.shape, PAD_ID, dtype=np.int64)  # (B, W)
        out[real] = self.flat[(self.offsets[rows].astype(np.int64)[:, None] + columns)[real]]
        return out, real


def collate_ids(src: Ids, tgt: Ids, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """data.collate of prepared ids, the same tensors, vectorised: a batch of the paper's 25,000 tokens has
    about 800 sentences, and three copies a sentence kept a GPU waiting for its next batch."""
    if (tgt.lengths[rows] == 0).any():
        i = int(rows[np.flatnonzero(tgt.lengths[rows] == 0)[0]])
        raise ValueError(f"pair {i} has an empty target; target ids must end with EOS")
    src_ids, _ = src.padded(rows)  # (B, S)
    tgt_out, real = tgt.padded(rows)  # (B, T)
    tgt_in = np.full_like(tgt_out, PAD_ID)  # (B, T): [BOS] + target without its last token (EOS)
    tgt_in[:, 0] = BOS_ID
    tgt_in[:, 1:] = np.where(real[:, 1:], tgt_out[:, :-1], PAD_ID)
    return torch.from_numpy(src_ids), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


@dataclass(frozen=True)
class Prepared:
    """An opened prepared directory: the tokenizer, the ids (memory-mapped), the validation text."""

    directory: Path
    manifest: dict[str, Any]
    tokenizer: Tokenizer
    src: Ids
    tgt: Ids
    valid_src: list[str]
    valid_tgt: list[str]
    views: list[tuple[Ids, Ids]] = field(default_factory=list)  # BPE-dropout's (src, tgt)

    @property
    def src_lang(self) -> str:
        return self.manifest["src_lang"]

    @property
    def tgt_lang(self) -> str:
        return self.manifest["tgt_lang"]

    def fingerprint(self) -> dict[str, str]:
        """The direction and the digests of the training and validation text: what a resume must share."""
        keys = ("src_lang", "tgt_lang", "train_data", "valid_data")
        fingerprint = {key: self.manifest[key] for key in keys}
        if self.views:  # other segmentations are other training data (named only where there are some)
            sides = " of the source" if self.manifest.get("bpe_dropout_sides") == "source" else ""
            fingerprint["bpe_dropout"] = f"{self.manifest['bpe_dropout']} x {len(self.views)} views{sides}"
        return fingerprint

    def commit(self, dest: str | Path, replace: bool = False) -> Prepared:
        """Rename this (temporary) directory to dest, whole; replace: remove what dest holds first."""
        dest = Path(dest)
        check_replaceable(dest, replace)
        replace_dir(self.directory, dest)
        return open_prepared(dest)


def open_prepared(directory: str | Path) -> Prepared:
    """Memory-map a prepared directory; a missing or damaged one is a ValueError naming it."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise ValueError(f"{directory}: not a prepared corpus (no {MANIFEST}; make one with `aiayn prepare`)")
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        valid = json.loads((directory / VALID).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{directory}: a damaged prepared corpus ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: prepared by another version (format {manifest.get('format')})")
    dtype = np.dtype(manifest["dtype"])
    sides = []
    for view, counts in enumerate([manifest] + manifest.get("views", [])):
        for side in ("src", "tgt"):
            stem = side if view == 0 else f"{side}.{view}"
            lengths = _memmap(directory / f"{stem}.len", np.uint32)
            flat = _memmap(directory / f"{stem}.bin", dtype)
            # Sizes against the manifest: opening touches none of the ids or lengths (memory stays flat).
            if len(lengths) != manifest["pairs"] or len(flat) != counts[f"{side}_tokens"]:
                raise ValueError(f"{directory}: {stem}.bin and {stem}.len do not fit {MANIFEST} (truncated?)")
            sides.append(Ids(flat, lengths))
    tokenizer = Tokenizer.load(directory)
    views = list(zip(sides[2::2], sides[3::2]))
    return Prepared(directory, manifest, tokenizer, *sides[:2], valid["src"], valid["tgt"], views)


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# --- Preparing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerOptions:
    """How to learn the vocabulary when none is given."""

    vocab_size: int | None = None  # None: the recipe's for a corpus of this size (config.choose)
    kind: str = "bpe"
    joint: bool = True
    sample: int = SAMPLE
    bpe_dropout: float | None = None  # None: the recipe's for a corpus of this size; 0: one segmentation
    views: int = VIEWS  # segmentations drawn with BPE-dropout, one per epoch in turn
    bpe_dropout_target: bool = True  # False: BPE-dropout of the source side only, the target as it is
    # the updates the training's budget buys (0: no budget), or a function of the preset that measures them
    # (training/calibrate.py): the recipe's BPE-dropout depends on it
    updates: int | Callable[[str], int] = 0


def prepare(
    dest: str | Path,
    pairs: PairSource,
    src_lang: str,
    tgt_lang: str,
    *,
    valid: tuple[list[str], list[str]] | None = None,
    valid_fraction: float | None = None,
    seed: int = 1,
    tokenizer: Tokenizer | None = None,
    options: TokenizerOptions = TokenizerOptions(),
    source: dict[str, Any] | None = None,
    say: Callable[[str], Any] = print,
) -> Prepared:
    """Prepare the pairs for training in a temporary directory beside dest; `commit` puts it in place.

    pairs: the raw training pairs, again at every call (cleaned here: pairs with a blank side are
    dropped and counted). valid: cleaned validation pairs; or valid_fraction of the training pairs is
    held out at random (seeded), as data.split_valid does. tokenizer: the vocabulary to use; None learns
    one from a uniform sample of at most options.sample training pairs (all of them when there are
    fewer, in their order). source: how the user named the data, kept in the manifest.

    Long for a reason: one pass of decisions over one temporary directory (hold out, learn the
    vocabulary, encode, write the manifest) whose failure anywhere must remove it whole.
    """
    if valid is not None and valid_fraction is not None:
        raise ValueError(
            "give validation data (--valid) or a fraction to hold out (--valid-fraction), not both"
        )
    if valid_fraction is not None and not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"the validation fraction must be in (0, 1), got {valid_fraction}")
    if tokenizer is None and options.vocab_size is not None:
        Tokenizer.check_options(options.vocab_size, options.kind)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=TMP_SUFFIX))
    try:
        with writing(dest):  # a full disk names the corpus being written, not its temporary name
            tmp.chmod(0o755)
            name = (source or {}).get("train") or "the training data"
            held = None  # (n,) True at the kept pairs held out for validation
            if valid_fraction is not None or tokenizer is None:
                n = sum(1 for _ in _cleaned(pairs))  # which pairs to hold out and sample depends on how many
                if valid_fraction is not None:
                    held = held_out(n, valid_fraction, seed)
            bpe_dropout, why = options.bpe_dropout or 0.0, ""
            if tokenizer is None:
                trainable = n - (int(held.sum()) if held is not None else 0)
                if not trainable:
                    raise ValueError(f"{name}: no training pairs left after dropping empty lines")
                tokenizer, bpe_dropout, why = _learn_tokenizer(pairs, held, trainable, options, seed, say)
            tokenizer.save(tmp)
            views = []
            if bpe_dropout:
                views = [tokenizer.with_dropout(bpe_dropout, options.bpe_dropout_target)] * options.views
                sides = "" if options.bpe_dropout_target else " (their sources)"
                say(
                    f"BPE-dropout {bpe_dropout}{why}: {len(views)} more segmentations of the training pairs{sides}"
                )
            report, held_pairs = _encode(tmp, pairs, held, tokenizer, views)
            say(f"training pairs: {report}")
            if report["kept"] - len(held_pairs[0]) == 0:
                raise ValueError(f"{name}: no training pairs left after dropping empty lines")
            if valid_fraction is not None:
                valid = held_pairs
            valid_src, valid_tgt = valid if valid is not None else ([], [])
            write_text(tmp / VALID, json.dumps({"src": valid_src, "tgt": valid_tgt}, ensure_ascii=False))
            manifest = json.loads((tmp / MANIFEST).read_text())
            manifest.update(
                src_lang=src_lang,
                tgt_lang=tgt_lang,
                valid_data=text_digest(zip(valid_src, valid_tgt)),
                held_out=len(held_pairs[0]),
                source=source or {},
                tokenizer={"vocab_size": tokenizer.src_vocab_size, "joint": tokenizer.joint},
                bpe_dropout=bpe_dropout,
                **({} if options.bpe_dropout_target or not views else {"bpe_dropout_sides": "source"}),
            )
            write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            return open_prepared(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _learn_tokenizer(
    pairs: PairSource,
    held: np.ndarray | None,
    trainable: int,
    options: TokenizerOptions,
    seed: int,
    say: Callable[[str], Any],
) -> tuple[Tokenizer, float, str]:
    """The vocabulary learned from a uniform sample of the `trainable` training pairs (those not held
    out), sized by the recipe for that many pairs unless the options say, and the BPE-dropout to train
    with: (tokenizer, bpe_dropout, why: where the BPE-dropout came from, for the message)."""
    sample = [_Side(pairs, held, _sample(trainable, options.sample, seed), side) for side in (0, 1)]
    asked = options.bpe_dropout if options.kind == "bpe" else 0.0  # (a word vocabulary has no merges to drop)
    chosen = choose(None, trainable, options.vocab_size, asked, options.updates)
    bpe_dropout, why = options.bpe_dropout or 0.0, ""
    budget = f"{chosen.updates:,} updates" if chosen.updates else "no budget"
    if asked is None:
        bpe_dropout = chosen.bpe_dropout
        why = f" (the recipe's for {trainable:,} pairs and {budget})"
        if not bpe_dropout and chosen.updates:
            least = recipe(chosen.preset).bpe_dropout_updates
            say(
                f"no BPE-dropout: the recipe takes it from {least:,} updates, and the budget buys {chosen.updates:,}"
            )
    if not bpe_dropout and not options.bpe_dropout_target:
        raise ValueError(
            f"--bpe-dropout-source-only, but the recipe for {trainable:,} pairs and {budget} takes no "
            "BPE-dropout: give --bpe-dropout P"
        )
    say(f"tokenizer: learning {options.kind} vocab_size {chosen.vocab_size} from {len(sample[0])} pairs")
    tokenizer = Tokenizer.train(*sample, vocab_size=chosen.vocab_size, kind=options.kind, joint=options.joint)
    return tokenizer, bpe_dropout, why


def _cleaned(pairs: PairSource) -> Iterator[tuple[int, str, str]]:
    """(index among kept pairs, src, tgt) of the pairs with no blank side."""
    k = 0
    for src, tgt in pairs():
        if not blank(src, tgt):
            yield k, src, tgt
            k += 1


def _sample(n: int, size: int, seed: int) -> np.ndarray:
    """(n,) True at a uniform sample of at most `size` of n training pairs (all of them when n <= size)."""
    if n <= size:
        return np.ones(n, dtype=bool)
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng([seed, n]).choice(n, size, replace=False)] = True
    return chosen


class _Side:
    """One side of the sampled training pairs, in their order, read again from the source each time it is
    iterated (the tokenizer trainer reads it once): the sample costs a bit a pair, not its text."""

    def __init__(self, pairs: PairSource, held: np.ndarray | None, chosen: np.ndarray, side: int):
        self.pairs, self.held, self.chosen, self.side = pairs, held, chosen, side

    def __len__(self) -> int:
        return int(self.chosen.sum())

    def __iter__(self) -> Iterator[str]:
        position = 0  # among the training pairs (the kept ones not held out)
        for k, src, tgt in _cleaned(self.pairs):
            if self.held is None or not self.held[k]:
                if self.chosen[position]:
                    yield (src, tgt)[self.side]
                position += 1


def _encode(
    directory: Path,
    pairs: PairSource,
    held_out: np.ndarray | None,
    tokenizer: Tokenizer,
    views: Sequence[Tokenizer] = (),
) -> tuple[dict[str, int], tuple[list[str], list[str]]]:
    """Stream the pairs through the tokenizer into DIR/{src,tgt}.{bin,len}, and through each of `views`
    (BPE-dropout's) into DIR/{src,tgt}.K.{bin,len}, K = 1, 2, ...; the held-out ones come back as text.
    Writes a first manifest with the counts and the digest of the training text.

    Long for a reason: one streaming pass writes every file of the corpus together, so no side
    is read twice and memory stays flat.
    """
    vocab = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    stems = ["", *(f".{k}" for k in range(1, len(views) + 1))]
    files = {
        f"{side}{stem}.{kind}": None for stem in stems for side in ("src", "tgt") for kind in ("bin", "len")
    }
    report = {"kept": 0, "empty": 0, "too_long": 0}
    held: tuple[list[str], list[str]] = ([], [])
    digest, every = TextDigest(), TextDigest()  # of the training pairs; of all kept pairs
    tokens = [{"src_tokens": 0, "tgt_tokens": 0} for _ in stems]
    chunk: tuple[list[str], list[str]] = ([], [])

    def flush() -> None:
        for view, (stem, tok) in enumerate(zip(stems, [tokenizer, *views])):
            for side, texts, encode in (("src", chunk[0], tok.encode_src), ("tgt", chunk[1], tok.encode_tgt)):
                ids = encode(texts)
                lengths = np.fromiter((len(x) for x in ids), dtype=np.uint32, count=len(ids))
                files[f"{side}{stem}.len"].write(lengths.tobytes())
                files[f"{side}{stem}.bin"].write(
                    np.fromiter((t for x in ids for t in x), dtype=dtype).tobytes()
                )
                tokens[view][f"{side}_tokens"] += int(lengths.sum(dtype=np.int64))
        chunk[0].clear(), chunk[1].clear()

    try:
        for name in files:
            files[name] = open(directory / name, "wb")
        for src, tgt in pairs():
            if not src.strip() or not tgt.strip():
                report["empty"] += 1
                continue
            every.update(src, tgt)
            if held_out is not None and held_out[report["kept"]]:
                held[0].append(src), held[1].append(tgt)
            else:
                chunk[0].append(src), chunk[1].append(tgt)
                digest.update(src, tgt)
                if len(chunk[0]) == CHUNK:
                    flush()
            report["kept"] += 1
        flush()
    finally:
        for f in files.values():
            if f is not None:
                f.close()
    manifest = {
        "format": FORMAT,
        "pairs": digest.pairs,
        "report": report,
        "dtype": np.dtype(dtype).name,
        **tokens[0],
        "views": tokens[1:],
        "train_data": digest.value(),
        "input_data": every.value(),  # before any pairs were held out for validation
    }
    write_text(directory / MANIFEST, json.dumps(manifest))
    return report, held


# --- From the command line's names of the data -----------------------------------------------------


def prepare_files(
    dest: str | Path,
    train: str,
    src_lang: str,
    tgt_lang: str,
    *,
    valid: str | None = None,
    valid_fraction: float | None = None,
    seed: int = 1,
    errors: Errors = "strict",
    data_files: dict[str, list[str]] | None = None,
    tokenizer: Tokenizer | None = None,
    options: TokenizerOptions = TokenizerOptions(),
    say: Callable[[str], Any] = print,
) -> Prepared:
    """prepare() of --train / --valid / --valid-fraction as the command line names them: files, pipes,
    "-", or hf:NAME[:CONFIG[:SPLIT]] (whose validation split validates when --valid is not given).
    A pipe or standard input is read once, into a spool file beside dest, since preparing reads twice.

    Long for a reason: each way the command line names the data (files, a pipe, TSV, hf:) checked
    and read here, before any of the work, so a mistake is one line naming the input.
    """
    if valid is not None and valid_fraction is not None:
        raise ValueError(
            "give validation data (--valid) or a fraction to hold out (--valid-fraction), not both"
        )
    spool = None
    if not rereadable(train, src_lang):
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.spool.", suffix=TMP_SUFFIX)
        os.close(fd)
        spool = Path(name)
        with writing(dest), open(spool, "w", encoding="utf-8") as f:
            for pair in iter_pairs(train, src_lang, tgt_lang, errors=errors, data_files=data_files):
                f.write(json.dumps(pair) + "\n")  # exact, tabs and lone surrogates included
    try:
        spec = str(spool) if spool else train
        source = {"train": train, "valid": valid, "valid_fraction": valid_fraction, "seed": seed}

        def pairs() -> Iterator[tuple[str, str]]:
            if spool:
                return _spooled(spool)
            return iter_pairs(spec, src_lang, tgt_lang, errors=errors, data_files=data_files)

        if valid is None and valid_fraction is None and train.startswith("hf:") and not parse_hf(train)[2]:
            name, config, _ = parse_hf(train)
            if "validation" in hf_splits(name, config, data_files):
                valid = train  # its validation split
            else:
                say(f"{train} has no validation split: training without validation")
        valid_pairs = None
        if valid is not None:
            raw = read_pairs(
                valid, src_lang, tgt_lang, errors=errors, split="validation", data_files=data_files
            )
            valid_src, valid_tgt, valid_report = clean_pairs(*raw)
            say(f"validation pairs: {valid_report}")
            if not valid_src:
                raise ValueError(
                    f"{valid}: no validation pairs ({valid_report}); leave out --valid to train without"
                )
            valid_pairs = (valid_src, valid_tgt)
        return prepare(
            dest,
            pairs,
            src_lang,
            tgt_lang,
            valid=valid_pairs,
            valid_fraction=valid_fraction,
            seed=seed,
            tokenizer=tokenizer,
            options=options,
            source=source,
            say=say,
        )
    finally:
        if spool:
            spool.unlink(missing_ok=True)


def check_same_input(
    data: Prepared,
    train: str,
    langs: tuple[str, str],
    *,
    valid: str | None,
    valid_fraction: float | None,
    seed: int,
    errors: Errors = "strict",
    data_files: dict[str, list[str]] | None = None,
) -> None:
    """Refuse, naming what differs, to resume on a prepared corpus made from other data than --train,
    --valid and --valid-fraction name now (one pass over the text, no tokenizing)."""
    source, manifest = data.manifest.get("source", {}), data.manifest
    differ = []
    if langs != (data.src_lang, data.tgt_lang):
        differ.append(f"{data.src_lang} -> {data.tgt_lang} then, {langs[0]} -> {langs[1]} now")
    if (source.get("valid_fraction"), source.get("seed", seed)) != (valid_fraction, seed) and (
        source.get("valid_fraction") is not None or valid_fraction is not None
    ):
        differ.append(f"--valid-fraction {source.get('valid_fraction')} then, {valid_fraction} now")
    cleaned = (
        (s, t)
        for s, t in iter_pairs(train, *langs, errors=errors, data_files=data_files)
        if s.strip() and t.strip()
    )
    if (now := text_digest(cleaned)) != manifest.get("input_data"):
        differ.append(f"--train: {manifest.get('input_data')} then, {now} now")
    if valid is not None:
        pairs = read_pairs(valid, *langs, errors=errors, split="validation", data_files=data_files)
        if (now := text_digest(zip(*clean_pairs(*pairs)[:2]))) != manifest["valid_data"]:
            differ.append(f"--valid: {manifest['valid_data']} then, {now} now")
    elif source.get("valid") is not None:
        differ.append(f"--valid {source['valid']} then, none now")
    if differ:
        raise ValueError(
            f"cannot resume on {data.directory}: it was prepared from other data ({'; '.join(differ)}); "
            "use the same data, or --force to start a new run"
        )


def _spooled(path: Path) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            src, tgt = json.loads(line)
            yield src, tgt


def prepare_corpus(dest: str | Path, corpus: Corpus, **kwargs: Any) -> Prepared:
    """prepare() of pairs held in memory."""
    valid = (corpus.valid_src, corpus.valid_tgt) if corpus.valid_src else None
    return prepare(dest, corpus.pairs, corpus.src_lang, corpus.tgt_lang, valid=valid, **kwargs)


__all__ = [
    "Prepared",
    "Ids",
    "TokenizerOptions",
    "prepare",
    "prepare_files",
    "prepare_corpus",
    "open_prepared",
    "collate_ids",
]
