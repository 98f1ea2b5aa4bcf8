"""Scoring with sacreBLEU (BLEU and chrF, with their signatures) and evaluating a model on a test set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sacrebleu

from aiayn.translate import Translator


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus BLEU (cased, detokenized, 13a) and chrF of detokenized text, with sacreBLEU signatures."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b),
        "sentences": len(hypotheses),
    }


def split_lines(text: str) -> list[str]:
    """Lines split on "\\n" only (a final newline ends the last line), each without a trailing "\\r".

    Not str.splitlines(): it also splits on \\x0b, \\x0c, \\x85, \\u2028..., so the output would have more
    lines than `wc -l` counts and translations would no longer line up with their sources (data.py alike).
    """
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file without their newlines; a bad file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return split_lines(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 ({e.reason})") from None


def evaluate(
    translator: Translator, sources: list[str], references: list[str], progress: bool = False
) -> dict[str, Any]:
    """Translate `sources` and score against `references`."""
    if len(sources) != len(references):
        raise ValueError(f"{len(sources)} source lines but {len(references)} reference lines")
    hypotheses = translator.translate(sources, progress=progress)
    return {**score(hypotheses, references), "hypotheses": hypotheses}
