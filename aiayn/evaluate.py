"""Scoring with sacreBLEU (BLEU and chrF, with their signatures) and evaluating a model on a test set."""

from __future__ import annotations

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


def evaluate(
    translator: Translator, sources: list[str], references: list[str], progress: bool = False
) -> dict[str, Any]:
    """Translate `sources` and score against `references`."""
    if len(sources) != len(references):
        raise ValueError(f"{len(sources)} source lines but {len(references)} reference lines")
    hypotheses = translator.translate(sources, progress=progress)
    return {**score(hypotheses, references), "hypotheses": hypotheses}
