"""Scoring with sacreBLEU (BLEU and chrF, with their signatures) and evaluating a model on a test set."""

from __future__ import annotations

from typing import Any

import sacrebleu

from aiayn.inference.translate import Translator

# sacreBLEU's BLEU tokenizers that need no extra package and no download (ja-mecab, ko-mecab and the
# spm/flores ones do): what --tokenize offers.
TOKENIZERS = ("13a", "intl", "none", "zh", "char")


def score(
    hypotheses: list[str], references: list[str], lowercase: bool = False, tokenize: str = "13a"
) -> dict[str, Any]:
    """Corpus BLEU and chrF of detokenized text with their sacreBLEU signatures. The default is
    sacreBLEU's: cased, 13a; lowercase and tokenize are its own options (chrF takes lowercase only)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if tokenize not in TOKENIZERS:
        raise ValueError(f"tokenize must be one of {list(TOKENIZERS)}, got {tokenize!r}")
    bleu = sacrebleu.metrics.BLEU(lowercase=lowercase, tokenize=tokenize)
    chrf = sacrebleu.metrics.CHRF(lowercase=lowercase)
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


def evaluate(
    translator: Translator,
    sources: list[str],
    references: list[str],
    progress: bool = False,
    lowercase: bool = False,
    tokenize: str = "13a",
) -> dict[str, Any]:
    """Translate `sources` and score against `references` (score's options)."""
    if len(sources) != len(references):
        raise ValueError(f"{len(sources)} source lines but {len(references)} reference lines")
    hypotheses = translator.translate(sources, progress=progress)
    return {**score(hypotheses, references, lowercase, tokenize), "hypotheses": hypotheses}
