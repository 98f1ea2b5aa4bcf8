"""Read parallel text (files, .gz, TSV, Hugging Face datasets), clean and filter it, token-budget batches."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import itertools
import os
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from aiayn.extras import need
from aiayn.tokenizer import BOS_ID, PAD_ID

if TYPE_CHECKING:
    import datasets

Errors = Literal["strict", "replace"]


# Reading --------------------------------------------------------------------------------------------------
# Every reader streams: a file is read a line at a time (gzip by name or content, a pipe, or "-" for
# standard input), so a corpus larger than memory can pass through. The read_* functions are the same
# readers gathered into lists, for data that fits (validation sets, texts to translate).

HF_SPEC = "hf:NAME[:CONFIG[:SPLIT]]"
FILE_BUILDERS = ("json", "csv", "parquet", "arrow", "text")  # Hugging Face's builders of local files
STDIN = Path("-")  # standard input, as a path
Pairs = Iterator[tuple[str, str]]


def iter_lines(path: str | Path, errors: Errors = "strict") -> Iterator[str]:
    """The lines of one UTF-8 text, split on "\\n" only, each without its "\\n" and a trailing "\\r" (CRLF).

    Not str.splitlines(): it also splits on \\x0b, \\x1c, \\x85, \\u2028..., so there would be more
    lines than `wc -l` counts and translations would no longer line up with their sources. A line that
    is not UTF-8 is a ValueError naming the file and the line.
    """
    path = input_path(path)
    with _open_binary(path) as f:
        try:
            for number, raw in enumerate(f, start=1):
                yield _decode(raw, path, number, errors)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            # gzip reports damage as three unrelated types (OSError, EOFError, zlib.error); all mean the same.
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def read_lines(path: str | Path, errors: Errors = "strict") -> list[str]:
    """Lines of one UTF-8 text file (plain or gzipped; a pipe, or "-" for standard input); a missing or
    bad file is a ValueError naming it."""
    return list(iter_lines(path, errors))


def iter_parallel(prefix: str | Path, src_lang: str, tgt_lang: str, *, errors: Errors = "strict") -> Pairs:
    """Line-aligned files PREFIX.SRC_LANG and PREFIX.TGT_LANG, each plain or gzipped (PREFIX.SRC_LANG.gz)."""
    src_path, tgt_path = _find(prefix, src_lang), _find(prefix, tgt_lang)
    if src_path.is_file() and tgt_path.is_file():
        # Compare line counts before decoding: a misaligned corpus is the more useful error to see first.
        n_src, n_tgt = _count_lines(src_path), _count_lines(tgt_path)
        if n_src != n_tgt:
            raise ValueError(
                f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; parallel files must be line-aligned"
            )
    src, tgt = iter_lines(src_path, errors), iter_lines(tgt_path, errors)
    for n, pair in enumerate(itertools.zip_longest(src, tgt), start=1):
        if None in pair:  # one file ended first: count the other to the end for the message
            rest = 1 + sum(1 for _ in (src if pair[1] is None else tgt))
            n_src, n_tgt = (n - 1 + rest, n - 1) if pair[1] is None else (n - 1, n - 1 + rest)
            raise ValueError(
                f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; parallel files must be line-aligned"
            )
        yield pair


def read_parallel(
    prefix: str | Path, src_lang: str, tgt_lang: str, *, errors: Errors = "strict"
) -> tuple[list[str], list[str]]:
    return _lists(iter_parallel(prefix, src_lang, tgt_lang, errors=errors))


def iter_tsv(path: str | Path, *, errors: Errors = "strict") -> Pairs:
    """One pair per line, `source<TAB>target` (plain or gzipped; a pipe, or "-" for standard input)."""
    for number, line in enumerate(iter_lines(path, errors), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(
                f"{path}:{number}: expected source<TAB>target (exactly one tab), "
                f"found {len(fields) - 1} tabs in {line!r}"
            )
        yield fields[0], fields[1]


def read_tsv(path: str | Path, *, errors: Errors = "strict") -> tuple[list[str], list[str]]:
    return _lists(iter_tsv(path, errors=errors))


def iter_hf(
    dataset: str | datasets.Dataset,
    src_lang: str,
    tgt_lang: str,
    *,
    split: str = "train",
    config: str | None = None,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
) -> Pairs:
    """Pairs from the `translation` column ({lang: text}) of a Hugging Face dataset, in batches.

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
    for lang in (src_lang, tgt_lang):
        if lang not in langs:
            raise ValueError(f"{name}: the translation column has no language {lang!r}; it has {langs}")
    columns = [f"translation.{src_lang}", f"translation.{tgt_lang}"]
    row = 0
    for batch in flat.select_columns(columns).iter(batch_size=10_000):
        for src, tgt in zip(batch[columns[0]], batch[columns[1]]):
            for lang, text in ((src_lang, src), (tgt_lang, tgt)):
                if not isinstance(text, str):
                    raise ValueError(f"{name}: row {row} has no {lang!r} text (got {text!r})")
            yield src, tgt
            row += 1


def read_hf(
    dataset: str | datasets.Dataset, src_lang: str, tgt_lang: str, **kwargs: Any
) -> tuple[list[str], list[str]]:
    return _lists(iter_hf(dataset, src_lang, tgt_lang, **kwargs))


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


def iter_pairs(
    spec: str,
    src_lang: str,
    tgt_lang: str,
    *,
    errors: Errors = "strict",
    split: str = "train",
    data_files: dict[str, list[str]] | None = None,
) -> Pairs:
    """The CLI's one way in to a parallel corpus:

    - `hf:NAME[:CONFIG[:SPLIT]]`: a Hugging Face dataset (iter_hf); SPLIT defaults to `split`;
    - `*.tsv[.gz]`, a file that is not a PREFIX (a pipe, say), or "-" for standard input: iter_tsv;
    - otherwise PREFIX: PREFIX.SRC_LANG and PREFIX.TGT_LANG (iter_parallel).

    `errors` applies to files (Hugging Face text arrives decoded); `data_files` to Hugging Face datasets.
    """
    if spec.startswith("hf:"):
        name, config, spec_split = parse_hf(spec)
        split = spec_split or split
        return iter_hf(name, src_lang, tgt_lang, split=split, config=config, data_files=data_files)
    if is_tsv(spec, src_lang):
        return iter_tsv(spec, errors=errors)
    return iter_parallel(spec, src_lang, tgt_lang, errors=errors)


def read_pairs(spec: str, src_lang: str, tgt_lang: str, **kwargs: Any) -> tuple[list[str], list[str]]:
    return _lists(iter_pairs(spec, src_lang, tgt_lang, **kwargs))


def check_sources(*specs: str | None) -> None:
    """What can be known of corpora before any work: each hf: source is well formed and its package,
    datasets, is installed (the hf extra). Files are checked as they are opened."""
    for spec in specs:
        if spec is not None and spec.startswith("hf:"):
            parse_hf(spec)


def parse_hf(spec: str) -> tuple[str, str | None, str | None]:
    """hf:NAME[:CONFIG[:SPLIT]] -> (NAME, CONFIG or None, SPLIT or None); every hf: source passes here
    first, so none is read without the datasets package."""
    need(f"{spec} (a Hugging Face dataset)", "hf", "datasets")
    name, config, split = (spec.removeprefix("hf:").split(":") + ["", ""])[:3]
    if not name or spec.count(":") > 3:
        raise ValueError(f"{spec!r}: expected {HF_SPEC}")
    return name, config or None, split or None


def is_tsv(spec: str, src_lang: str) -> bool:
    """A TSV spec: *.tsv[.gz], "-", or a file (a pipe, say) that is not the PREFIX of PREFIX.SRC_LANG."""
    is_prefix = any(Path(f"{spec}.{src_lang}{gz}").exists() for gz in ("", ".gz"))
    return spec == "-" or spec.endswith((".tsv", ".tsv.gz")) or (Path(spec).exists() and not is_prefix)


def rereadable(spec: str, src_lang: str) -> bool:
    """Whether a corpus can be read twice: not standard input, not a pipe."""
    if spec.startswith("hf:"):
        return True
    paths = [Path(spec)] if is_tsv(spec, src_lang) else [Path(f"{spec}.{src_lang}")]
    return all(p != STDIN and (not p.exists() or p.is_file()) for p in paths)


def _lists(pairs: Pairs) -> tuple[list[str], list[str]]:
    src, tgt = [], []
    for s, t in pairs:
        src.append(s)
        tgt.append(t)
    return src, tgt


def _find(prefix: str | Path, lang: str) -> Path:
    tried = [Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")]
    for path in tried:
        if path.exists() and not path.is_dir():
            return input_path(path)
    raise ValueError(f"no {lang!r} file for prefix {str(prefix)!r}; tried {', '.join(map(str, tried))}")


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


@contextlib.contextmanager
def _open_binary(path: Path) -> Iterator[IO[bytes]]:
    """The bytes of a file, pipe or standard input, through gunzip when they are gzip (by name or content)."""
    if path == STDIN:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in its place (a notebook, a test): it has decoded already
            stream = io.BytesIO(sys.stdin.read().encode("utf-8", "surrogateescape"))
        raw, owned = io.BufferedReader(stream) if not hasattr(stream, "peek") else stream, False
    else:
        try:
            raw, owned = open(path, "rb"), True
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        if path.suffix == ".gz" or raw.peek(2)[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped
        else:
            yield raw
    finally:
        if owned:
            raw.close()


def _count_lines(path: Path) -> int:
    """Lines as iter_lines counts them, read in blocks without decoding."""
    with _open_binary(path) as f:
        try:
            n, last = 0, b"\n"
            while block := f.read(1 << 20):
                n, last = n + block.count(b"\n"), block[-1:]
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    return n + (last != b"\n")


def _decode(raw: bytes, path: Path, number: int, errors: Errors) -> str:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{number}: not UTF-8, bad bytes {raw[e.start : e.end]!r} "
            "(convert it to UTF-8, or read U+FFFD in their place with --encoding-errors replace)"
        ) from None


# Cleaning and filtering -----------------------------------------------------------------------------------


def blank(src: str, tgt: str) -> bool:
    """A pair with an empty or whitespace-only side: dropped from training and validation alike."""
    return not src.strip() or not tgt.strip()


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
        if blank(s, t):
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


def held_out(n: int, fraction: float, seed: int) -> np.ndarray:
    """(n,) True at a seeded random `fraction` of n pairs (one at least), the validation split."""
    n_valid = max(1, round(n * fraction))
    if n_valid >= n:
        raise ValueError(f"cannot hold out {fraction} of {n} pairs and keep any for training")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(seed).choice(n, n_valid, replace=False)] = True
    return held


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
    is_valid = held_out(len(src), fraction, seed)
    train = np.flatnonzero(~is_valid).tolist()
    valid = np.flatnonzero(is_valid).tolist()
    return [src[i] for i in train], [tgt[i] for i in train], [src[i] for i in valid], [tgt[i] for i in valid]


# The text of a corpus -------------------------------------------------------------------------------------


class TextDigest:
    """A digest of pairs of text, fed a pair at a time: what a resumed run must train on again."""

    def __init__(self) -> None:
        self.h, self.pairs = hashlib.sha256(), 0

    def update(self, src: str, tgt: str) -> None:
        self.h.update(
            src.encode("utf-8", "surrogatepass") + b"\t" + tgt.encode("utf-8", "surrogatepass") + b"\n"
        )
        self.pairs += 1

    def value(self) -> str:
        return f"{self.pairs} pairs, sha256 {self.h.hexdigest()[:16]}"


def text_digest(pairs: Iterable[tuple[str, str]]) -> str:
    digest = TextDigest()
    for src, tgt in pairs:
        digest.update(src, tgt)
    return digest.value()


@dataclass(frozen=True)
class Corpus:
    """Training and validation pairs of one translation direction, as text in memory (prepare.py turns
    them, as any other source, into the ids training reads)."""

    train_src: list[str]
    train_tgt: list[str]
    valid_src: list[str] = field(default_factory=list)
    valid_tgt: list[str] = field(default_factory=list)
    src_lang: str = "src"
    tgt_lang: str = "tgt"

    def pairs(self) -> Iterator[tuple[str, str]]:
        return zip(self.train_src, self.train_tgt)


# Batching -------------------------------------------------------------------------------------------------


def make_batches(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int],
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    bucket: bool = True,
) -> list[list[int]]:
    """batch_plan as lists of pair indices."""
    return list(batch_plan(src_lens, tgt_lens, max_tokens, seed=seed, epoch=epoch, bucket=bucket))


@dataclass(frozen=True)
class BatchPlan(Sequence):
    """The batches of one epoch in three arrays, not a list per batch: a few bytes per pair, so that the
    plan of a corpus of millions of pairs stays small. plan[j] is the j-th batch (a list of pair indices)."""

    order: np.ndarray  # (P,) pair indices in packing order
    starts: np.ndarray  # (n + 1,) where each batch begins in `order`, then P
    schedule: np.ndarray  # (n,) the batches in the order they are used

    def __len__(self) -> int:
        return len(self.schedule)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        b = int(self.schedule[j])
        return self.order[self.starts[b] : self.starts[b + 1]].tolist()


def batch_plan(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int],
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    bucket: bool = True,
) -> BatchPlan:
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
    src = np.asarray(src_lens, dtype=np.int32).reshape(-1)  # 4 bytes a pair: plans of millions stay small
    tgt = np.asarray(tgt_lens, dtype=np.int32).reshape(-1)
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
    order = order.astype(np.int32) if len(order) < np.iinfo(np.int32).max else order
    widths = longest[order]
    del longest, src, tgt

    starts, size, width = [0], 0, 0
    for lo in range(0, len(order), 1 << 16):  # in blocks: a list of every length at once would be large
        for length in widths[lo : lo + (1 << 16)].tolist():
            new_width = max(width, length)
            if (size + 1) * new_width > max_tokens:
                starts.append(starts[-1] + size)
                size, new_width = 0, length
            size += 1
            width = new_width
    if size:
        starts.append(starts[-1] + size)
    n = len(starts) - 1
    schedule = rng.permutation(n) if bucket else np.arange(n)
    return BatchPlan(order, np.asarray(starts, dtype=np.int64), schedule)


def collate(
    src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], batch: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad one batch to its own longest sequences (never to a fixed maximum).

    src_ids[i], tgt_ids[i]: the ids of pair i (lists, or arrays of a prepared corpus). Target ids end
    with EOS; the decoder reads tgt_in = [BOS] + tgt[:-1] and predicts tgt_out = tgt.
    """
    srcs, tgts = [src_ids[i] for i in batch], [tgt_ids[i] for i in batch]
    for i, t in zip(batch, tgts):
        if len(t) == 0:
            raise ValueError(f"pair {i} has an empty target; target ids must end with EOS")
    src = np.full((len(batch), max(len(x) for x in srcs)), PAD_ID, dtype=np.int64)  # (B, S)
    tgt_out = np.full((len(batch), max(len(y) for y in tgts)), PAD_ID, dtype=np.int64)  # (B, T)
    tgt_in = tgt_out.copy()  # (B, T)
    for row, (x, y) in enumerate(zip(srcs, tgts)):
        src[row, : len(x)] = x
        tgt_out[row, : len(y)] = y
        tgt_in[row, 0], tgt_in[row, 1 : len(y)] = BOS_ID, y[:-1]
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


__all__ = [
    "Corpus",
    "text_digest",
    "read_parallel",
    "read_tsv",
    "read_hf",
    "read_pairs",
    "clean_pairs",
    "filter_lengths",
    "split_valid",
    "held_out",
    "blank",
    "make_batches",
    "batch_plan",
    "BatchPlan",
    "collate",
]
