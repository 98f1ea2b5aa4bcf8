"""Read parallel text (files, .gz, TSV, Hugging Face datasets), clean and filter it, token-budget batches."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

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
    """One pair per line, `source<TAB>target` (plain or .gz)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
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


def read_hf(
    dataset: str | datasets.Dataset,
    src_lang: str,
    tgt_lang: str,
    *,
    split: str = "train",
    config: str | None = None,
    data_files: str | list[str] | None = None,
) -> tuple[list[str], list[str]]:
    """Pairs from the `translation` column ({lang: text}) of a Hugging Face dataset.

    `dataset` is a loaded `datasets.Dataset`, or a name for
    `datasets.load_dataset(dataset, config, split=split, data_files=data_files)`: a hub name such as
    "Helsinki-NLP/opus_books" with config "de-en", or a local builder such as "json" with
    `data_files="pairs.jsonl"`.
    """
    # Imported here: `datasets` takes about a second to import and most runs read plain files.
    import datasets

    if isinstance(dataset, str):
        name = dataset if config is None else f"{dataset} ({config})"
        dataset = datasets.load_dataset(dataset, config, split=split, data_files=data_files)
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


def read_pairs(
    spec: str, src_lang: str, tgt_lang: str, *, errors: Errors = "strict", split: str = "train"
) -> tuple[list[str], list[str]]:
    """The CLI's one way in: `hf:NAME[:CONFIG]` -> read_hf, `*.tsv[.gz]` -> read_tsv, else read_parallel.

    `errors` applies to files (Hugging Face text arrives decoded); `split` to Hugging Face datasets.
    """
    if spec.startswith("hf:"):
        name, _, config = spec.removeprefix("hf:").partition(":")
        if not name:
            raise ValueError(f"{spec!r}: expected hf:NAME[:CONFIG]")
        return read_hf(name, src_lang, tgt_lang, split=split, config=config or None)
    if spec.endswith((".tsv", ".tsv.gz")):
        return read_tsv(spec, errors=errors)
    return read_parallel(spec, src_lang, tgt_lang, errors=errors)


def _find(prefix: str | Path, lang: str) -> Path:
    tried = [Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")]
    for path in tried:
        if path.is_file():
            return path
    raise ValueError(f"no {lang!r} file for prefix {str(prefix)!r}; tried {', '.join(map(str, tried))}")


def _read_bytes(path: Path) -> bytes:
    if path.suffix == ".gz":
        # gzip reports damage as three unrelated types (OSError, EOFError, zlib.error); all mean the same.
        try:
            with gzip.open(path, "rb") as f:
                return f.read()
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    return path.read_bytes()


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
            "(to substitute U+FFFD instead: `aiayn train --encoding-errors replace`, or errors='replace')"
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
    """Lines of one UTF-8 text file (plain or .gz); a missing or bad file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
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
    src_ids: list[list[int]], tgt_ids: list[list[int]], batch: list[int], pad_id: int, bos_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad one batch to its own longest sequences (never to a fixed maximum).

    Target ids end with EOS; the decoder reads tgt_in = [BOS] + tgt[:-1] and predicts tgt_out = tgt.
    """
    for i in batch:
        if not tgt_ids[i]:
            raise ValueError(f"pair {i} has an empty target; target ids must end with EOS")
    n_src = max(len(src_ids[i]) for i in batch)
    n_tgt = max(len(tgt_ids[i]) for i in batch)
    src_rows = [src_ids[i] + [pad_id] * (n_src - len(src_ids[i])) for i in batch]
    tgt_in_rows = [[bos_id, *tgt_ids[i][:-1]] + [pad_id] * (n_tgt - len(tgt_ids[i])) for i in batch]
    tgt_out_rows = [tgt_ids[i] + [pad_id] * (n_tgt - len(tgt_ids[i])) for i in batch]
    src = torch.tensor(src_rows, dtype=torch.long)  # (B, S)
    tgt_in = torch.tensor(tgt_in_rows, dtype=torch.long)  # (B, T)
    tgt_out = torch.tensor(tgt_out_rows, dtype=torch.long)  # (B, T)
    return src, tgt_in, tgt_out


__all__ = [
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
