"""Read parallel text (files, .gz, TSV, Hugging Face datasets), clean and filter it, token-budget batches."""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from aiayn.tokenizer import BOS_ID, PAD_ID

if TYPE_CHECKING:
    import datasets

Errors = Literal["strict", "replace"]


# Reading --------------------------------------------------------------------------------------------------


def read_parallel(
    prefix: str | Path, src_lang: str, tgt_lang: str, *, errors: Errors = "strict"
) -> tuple[list[str], list[str]]:
    """Line-aligned files PREFIX.SRC_LANG and PREFIX.TGT_LANG, each plain or gzipped (PREFIX.SRC_LANG.gz)."""
    src_path, tgt_path = _find(prefix, src_lang), _find(prefix, tgt_lang)
    src_bytes, tgt_bytes = _read_bytes(src_path), _read_bytes(tgt_path)
    # Compare line counts before decoding: a misaligned corpus is the more useful error to see first.
    n_src, n_tgt = _count_lines(src_bytes), _count_lines(tgt_bytes)
    if n_src != n_tgt:
        raise ValueError(
            f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; parallel files must be line-aligned"
        )
    return _split_lines(src_bytes, src_path, errors), _split_lines(tgt_bytes, tgt_path, errors)


def read_tsv(path: str | Path, *, errors: Errors = "strict") -> tuple[list[str], list[str]]:
    """One pair per line, `source<TAB>target` (plain or gzipped; a pipe, or "-" for standard input)."""
    path = input_path(path)
    src, tgt = [], []
    for number, line in enumerate(_split_lines(_read_bytes(path), path, errors), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(
                f"{path}:{number}: expected source<TAB>target (exactly one tab), "
                f"found {len(fields) - 1} tabs in {line!r}"
            )
        src.append(fields[0])
        tgt.append(fields[1])
    return src, tgt


HF_SPEC = "hf:NAME[:CONFIG[:SPLIT]]"
FILE_BUILDERS = ("json", "csv", "parquet", "arrow", "text")  # Hugging Face's builders of local files


def read_hf(
    dataset: str | datasets.Dataset,
    src_lang: str,
    tgt_lang: str,
    *,
    split: str = "train",
    config: str | None = None,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """Pairs from the `translation` column ({lang: text}) of a Hugging Face dataset.

    `dataset` is a loaded `datasets.Dataset`, or a name for `datasets.load_dataset(dataset, config,
    data_files=data_files)` whose `split` is read: a hub name such as "Helsinki-NLP/opus_books" with
    config "de-en", a local directory of data files (train.jsonl, validation.jsonl, ...), or a builder
    such as "json" with `data_files={"train": "pairs.jsonl"}`.
    """
    # Imported here: `datasets` takes about a second to import and most runs read plain files.
    import datasets

    if isinstance(dataset, str):
        name = dataset if config is None else f"{dataset} ({config})"
        splits = hf_splits(dataset, config, data_files)
        if split not in splits:
            raise ValueError(f"hf:{name}: no split {split!r}; it has {sorted(splits)}")
        dataset = splits[split]
    else:
        name = "dataset"
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{name}: expected a datasets.Dataset, got {type(dataset).__name__}")
    if "translation" not in dataset.column_names:
        raise ValueError(f"{name}: no 'translation' column; columns are {dataset.column_names}")
    # Flattening the struct column gives one string column per language, far faster than Python dicts.
    flat = dataset.select_columns(["translation"]).flatten()
    langs = [column.removeprefix("translation.") for column in flat.column_names]
    texts = []
    for lang in (src_lang, tgt_lang):
        if lang not in langs:
            raise ValueError(f"{name}: the translation column has no language {lang!r}; it has {langs}")
        column = flat[f"translation.{lang}"][:]
        for row, text in enumerate(column):
            if not isinstance(text, str):
                raise ValueError(f"{name}: row {row} has no {lang!r} text (got {text!r})")
        texts.append(column)
    return texts[0], texts[1]


def hf_splits(name: str, config: str | None, data_files: Any) -> datasets.DatasetDict:
    """Every split of a Hugging Face dataset; one that cannot be loaded is a ValueError saying why."""
    import datasets

    if name in FILE_BUILDERS and not data_files:  # else datasets looks for a hub dataset of that name
        raise ValueError(f"hf:{name} reads local files: name them with --data-files SPLIT=PATH")
    try:
        loaded = datasets.load_dataset(name, config, data_files=data_files)
    except ConnectionError as e:
        raise ValueError(
            f"hf:{name}: cannot reach the Hugging Face hub ({e}); with no network, a dataset already in the "
            "local cache loads with HF_DATASETS_OFFLINE=1, and local files with hf:json --data-files"
        ) from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise ValueError(f"hf:{name}: no such dataset or data files ({e})") from None
    except datasets.exceptions.DatasetGenerationError as e:  # e.g. a builder (json) without --data-files
        cause = e.__cause__ or e
        raise ValueError(f"hf:{name}: cannot build the dataset ({type(cause).__name__}: {cause})") from None
    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"hf:{name}: expected a dataset with splits, got {type(loaded).__name__}")
    return loaded


def read_pairs(
    spec: str,
    src_lang: str,
    tgt_lang: str,
    *,
    errors: Errors = "strict",
    split: str = "train",
    data_files: dict[str, list[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """The CLI's one way in to a parallel corpus:

    - `hf:NAME[:CONFIG[:SPLIT]]`: a Hugging Face dataset (read_hf); SPLIT defaults to `split`;
    - `*.tsv[.gz]`, a file that is not a PREFIX (a pipe, say), or "-" for standard input: read_tsv;
    - otherwise PREFIX: PREFIX.SRC_LANG and PREFIX.TGT_LANG (read_parallel).

    `errors` applies to files (Hugging Face text arrives decoded); `data_files` to Hugging Face datasets.
    """
    if spec.startswith("hf:"):
        name, config, spec_split = (spec.removeprefix("hf:").split(":") + ["", ""])[:3]
        if not name or spec.count(":") > 3:
            raise ValueError(f"{spec!r}: expected {HF_SPEC}")
        return read_hf(
            name, src_lang, tgt_lang, split=spec_split or split, config=config or None, data_files=data_files
        )
    is_prefix = any(Path(f"{spec}.{lang}{gz}").exists() for lang in (src_lang,) for gz in ("", ".gz"))
    if spec == "-" or spec.endswith((".tsv", ".tsv.gz")) or (Path(spec).exists() and not is_prefix):
        return read_tsv(spec, errors=errors)
    return read_parallel(spec, src_lang, tgt_lang, errors=errors)


def _find(prefix: str | Path, lang: str) -> Path:
    tried = [Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")]
    for path in tried:
        if path.exists() and not path.is_dir():
            return input_path(path)
    raise ValueError(f"no {lang!r} file for prefix {str(prefix)!r}; tried {', '.join(map(str, tried))}")


STDIN = Path("-")  # standard input, as a path


def input_path(path: str | Path) -> Path:
    """A path to read from: a file, a pipe (`<(...)`, /dev/stdin) or "-" for standard input."""
    path = Path(path)
    if path == STDIN:
        return path
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: not readable (permission denied)")
    return path


def _read_bytes(path: Path) -> bytes:
    """All bytes of a file, pipe or standard input, gunzipped when they are gzip (by name or content)."""
    try:
        if path != STDIN:
            data = path.read_bytes()
        elif hasattr(sys.stdin, "buffer"):
            data = sys.stdin.buffer.read()
        else:  # a text stream put in its place (a notebook, a test): it has decoded already
            data = sys.stdin.read().encode("utf-8", "surrogateescape")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    if path.suffix == ".gz" or data[:2] == b"\x1f\x8b":
        # gzip reports damage as three unrelated types (OSError, EOFError, zlib.error); all mean the same.
        try:
            return gzip.decompress(data)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    return data


def _count_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _split_lines(data: bytes, path: Path, errors: Errors) -> list[str]:
    """Decode UTF-8 and split on "\\n" only, dropping a trailing "\\r" of each line (CRLF files)."""
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8, bad bytes {data[e.start : e.end]!r} "
            "(convert it to UTF-8, or read U+FFFD in their place with --encoding-errors replace)"
        ) from None
    return split_lines(text)


def split_lines(text: str) -> list[str]:
    """Lines split on "\\n" only (a final newline ends the last line), each without a trailing "\\r".

    Not str.splitlines(): it also splits on \\x0b, \\x1c, \\x85, \\u2028..., so there would be more
    lines than `wc -l` counts and translations would no longer line up with their sources.
    """
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: str | Path, errors: Errors = "strict") -> list[str]:
    """Lines of one UTF-8 text file (plain or gzipped; a pipe, or "-" for standard input); a missing or
    bad file is a ValueError naming it."""
    path = input_path(path)
    return _split_lines(_read_bytes(path), path, errors)


# Cleaning and filtering -----------------------------------------------------------------------------------


def clean_pairs(
    src: list[str], tgt: list[str], *, max_chars: int | None = None
) -> tuple[list[str], list[str], dict[str, int]]:
    """Drop pairs with an empty or whitespace-only side (and, with max_chars, a side longer than that).

    The report counts them: {"kept": n, "empty": m, "too_long": k}.
    """
    if len(src) != len(tgt):
        raise ValueError(f"clean_pairs: {len(src)} source lines but {len(tgt)} target lines")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    kept_src, kept_tgt = [], []
    empty = too_long = 0
    for s, t in zip(src, tgt):
        if not s.strip() or not t.strip():
            empty += 1
        elif max_chars is not None and max(len(s), len(t)) > max_chars:
            too_long += 1
        else:
            kept_src.append(s)
            kept_tgt.append(t)
    return kept_src, kept_tgt, {"kept": len(kept_src), "empty": empty, "too_long": too_long}


def filter_lengths(src_ids: list[list[int]], tgt_ids: list[list[int]], max_len: int) -> tuple[list[int], int]:
    """Indices of the tokenized pairs with at most max_len tokens on both sides, and how many were longer."""
    if len(src_ids) != len(tgt_ids):
        raise ValueError(
            f"filter_lengths: {len(src_ids)} source sequences but {len(tgt_ids)} target sequences"
        )
    kept = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids)) if len(s) <= max_len and len(t) <= max_len]
    return kept, len(src_ids) - len(kept)


def split_valid(
    src: list[str], tgt: list[str], fraction: float, seed: int
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Hold out a seeded random `fraction` of the pairs: (train_src, train_tgt, valid_src, valid_tgt).

    Both parts keep the input order.
    """
    if len(src) != len(tgt):
        raise ValueError(f"split_valid: {len(src)} source lines but {len(tgt)} target lines")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    n = len(src)
    n_valid = max(1, round(n * fraction))
    if n_valid >= n:
        raise ValueError(f"cannot hold out {fraction} of {n} pairs and keep any for training")
    is_valid = np.zeros(n, dtype=bool)
    is_valid[np.random.default_rng(seed).choice(n, n_valid, replace=False)] = True
    train = np.flatnonzero(~is_valid).tolist()
    valid = np.flatnonzero(is_valid).tolist()
    return [src[i] for i in train], [tgt[i] for i in train], [src[i] for i in valid], [tgt[i] for i in valid]


# The corpus of a training run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Cleaned training and validation pairs of one translation direction, as text."""

    train_src: list[str]
    train_tgt: list[str]
    valid_src: list[str] = field(default_factory=list)
    valid_tgt: list[str] = field(default_factory=list)
    src_lang: str = "src"
    tgt_lang: str = "tgt"

    def fingerprint(self) -> dict[str, str]:
        """The direction and a digest of the text of each part: what a resumed run must train on again."""

        def digest(src: list[str], tgt: list[str]) -> str:
            h = hashlib.sha256()
            for s, t in zip(src, tgt):
                h.update(
                    s.encode("utf-8", "surrogatepass") + b"\t" + t.encode("utf-8", "surrogatepass") + b"\n"
                )
            return f"{len(src)} pairs, sha256 {h.hexdigest()[:16]}"

        return {
            "src_lang": self.src_lang,
            "tgt_lang": self.tgt_lang,
            "train_data": digest(self.train_src, self.train_tgt),
            "valid_data": digest(self.valid_src, self.valid_tgt),
        }


def read_corpus(
    train: str,
    src_lang: str,
    tgt_lang: str,
    *,
    valid: str | None = None,
    valid_fraction: float | None = None,
    seed: int = 1,
    errors: Errors = "strict",
    data_files: dict[str, list[str]] | None = None,
    say: Any = print,
) -> Corpus:
    """Read and clean the training pairs and their validation pairs, from --valid, a held-out
    valid_fraction of the training pairs, or (for a Hugging Face dataset) its validation split.

    say: where to report what was read and dropped (one line each).
    """
    if valid is not None and valid_fraction is not None:
        raise ValueError(
            "give validation data (--valid) or a fraction to hold out (--valid-fraction), not both"
        )
    src, tgt, report = clean_pairs(
        *read_pairs(train, src_lang, tgt_lang, errors=errors, data_files=data_files)
    )
    say(f"training pairs: {report}")
    if not src:
        raise ValueError(f"{train}: no training pairs left after dropping empty lines")
    if valid_fraction is not None:
        src, tgt, valid_src, valid_tgt = split_valid(src, tgt, valid_fraction, seed)
        return Corpus(src, tgt, valid_src, valid_tgt, src_lang, tgt_lang)
    if valid is None and train.startswith("hf:") and train.count(":") < 3:  # no SPLIT named
        name, _, config = train.removeprefix("hf:").partition(":")
        if "validation" not in hf_splits(name, config or None, data_files):
            say(f"{train} has no validation split: training without validation")
            return Corpus(src, tgt, src_lang=src_lang, tgt_lang=tgt_lang)
        valid = train  # its validation split, read below
    if valid is None:
        return Corpus(src, tgt, src_lang=src_lang, tgt_lang=tgt_lang)
    pairs = read_pairs(valid, src_lang, tgt_lang, errors=errors, split="validation", data_files=data_files)
    valid_src, valid_tgt, valid_report = clean_pairs(*pairs)
    say(f"validation pairs: {valid_report}")
    if not valid_src:
        raise ValueError(f"{valid}: no validation pairs ({valid_report}); leave out --valid to train without")
    return Corpus(src, tgt, valid_src, valid_tgt, src_lang, tgt_lang)


# Batching -------------------------------------------------------------------------------------------------


def make_batches(
    src_lens: list[int], tgt_lens: list[int], max_tokens: int, *, seed: int, epoch: int, bucket: bool = True
) -> list[list[int]]:
    """Cut pair indices into batches whose padded size stays within max_tokens; every pair once per epoch.

    A batch costs len(batch) * max(longest source, longest target): the larger of the two padded tensors.
    bucket=True sorts by length (ties broken at random) so that a batch holds similar lengths and little
    padding, then shuffles the batch order; bucket=False shuffles the pairs and fills batches in that order.
    Deterministic given (seed, epoch); a new epoch gives new batches.
    """
    if len(src_lens) != len(tgt_lens):
        raise ValueError(f"make_batches: {len(src_lens)} source lengths but {len(tgt_lens)} target lengths")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    src = np.asarray(src_lens, dtype=np.int64).reshape(-1)
    tgt = np.asarray(tgt_lens, dtype=np.int64).reshape(-1)
    # A length-0 pair still takes a row of the batch, so it counts as 1.
    longest = np.maximum(np.maximum(src, tgt), 1)
    too_long = np.flatnonzero(longest > max_tokens)
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(
            f"pair {i} has {src[i]} source and {tgt[i]} target tokens, more than max_tokens={max_tokens} "
            f"({len(too_long)} such pairs); filter them with max_len (filter_lengths) or raise max_tokens"
        )
    # SeedSequence([seed, epoch]) keeps (seed=1, epoch=0) and (seed=0, epoch=1) apart, unlike seed + epoch.
    rng = np.random.default_rng([seed, epoch])
    if bucket:
        # Sort by the padded width, then by source length; the random key breaks the remaining ties, so
        # batch contents change a little from epoch to epoch as well as their order.
        order = np.lexsort((rng.random(len(src)), src, longest))
    else:
        order = rng.permutation(len(src))

    batches: list[list[int]] = []
    batch: list[int] = []
    width = 0
    for i, length in zip(order.tolist(), longest[order].tolist()):
        new_width = max(width, length)
        if (len(batch) + 1) * new_width > max_tokens:
            batches.append(batch)
            batch, new_width = [], length
        batch.append(i)
        width = new_width
    if batch:
        batches.append(batch)

    if bucket:
        batches = [batches[j] for j in rng.permutation(len(batches)).tolist()]
    return batches


def collate(
    src_ids: list[list[int]], tgt_ids: list[list[int]], batch: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad one batch to its own longest sequences (never to a fixed maximum).

    Target ids end with EOS; the decoder reads tgt_in = [BOS] + tgt[:-1] and predicts tgt_out = tgt.
    """
    for i in batch:
        if not tgt_ids[i]:
            raise ValueError(f"pair {i} has an empty target; target ids must end with EOS")
    n_src = max(len(src_ids[i]) for i in batch)
    n_tgt = max(len(tgt_ids[i]) for i in batch)
    src_rows = [src_ids[i] + [PAD_ID] * (n_src - len(src_ids[i])) for i in batch]
    tgt_in_rows = [[BOS_ID, *tgt_ids[i][:-1]] + [PAD_ID] * (n_tgt - len(tgt_ids[i])) for i in batch]
    tgt_out_rows = [tgt_ids[i] + [PAD_ID] * (n_tgt - len(tgt_ids[i])) for i in batch]
    src = torch.tensor(src_rows, dtype=torch.long)  # (B, S)
    tgt_in = torch.tensor(tgt_in_rows, dtype=torch.long)  # (B, T)
    tgt_out = torch.tensor(tgt_out_rows, dtype=torch.long)  # (B, T)
    return src, tgt_in, tgt_out


__all__ = [
    "Corpus",
    "read_corpus",
    "read_parallel",
    "read_tsv",
    "read_hf",
    "read_pairs",
    "clean_pairs",
    "filter_lengths",
    "split_valid",
    "make_batches",
    "collate",
]
