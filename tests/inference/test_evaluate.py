"""Tests for aiayn.inference.evaluate: BLEU and chrF equal sacreBLEU's own on fixed strings (and BLEU a hand
computation), signatures name the tokenizer, and reading test sets keeps lines aligned."""

import math
import re

import pytest
import sacrebleu

from aiayn.data.corpus import read_lines
from aiayn.inference.evaluate import evaluate, score

HYPS = [
    "The cat sat on the mat.",
    "A dog runs quickly through the park!",
    "Mr. Smith's car costs $3,500.",
    "they went home",
    "",
    "Ein Hund läuft über die Straße.",
]
REFS = [
    "The cat sat on the mat.",
    "A dog quickly runs through the park.",
    "Mr. Smith's car cost $3,500.",
    "They went home yesterday.",
    "Nothing here.",
    "Ein Hund läuft über die Straße.",
]


def test_bleu_and_chrf_equal_sacrebleu():
    result = score(HYPS, REFS)
    assert result["bleu"] == sacrebleu.corpus_bleu(HYPS, [REFS]).score
    assert result["chrf"] == sacrebleu.corpus_chrf(HYPS, [REFS]).score
    assert 0 < result["bleu"] < 100 and 0 < result["chrf"] < 100
    assert result["sentences"] == len(HYPS)
    assert result["bleu_detail"].startswith(f"BLEU = {result['bleu']:.2f}")


def test_signatures_name_13a_detokenized_mixed_case():
    result = score(HYPS, REFS)
    bleu_signature = result["bleu_signature"]
    assert "tok:13a" in bleu_signature and "case:mixed" in bleu_signature and "nrefs:1" in bleu_signature
    assert f"version:{sacrebleu.__version__}" in bleu_signature
    assert "nc:6" in result["chrf_signature"] and "nw:0" in result["chrf_signature"]  # chrF, not chrF++


@pytest.mark.parametrize("lowercase", [False, True])
@pytest.mark.parametrize("tokenize", ["13a", "intl", "none", "char"])
def test_the_options_are_sacrebleus_own(lowercase, tokenize):
    """--lowercase and --tokenize give what sacreBLEU gives with the same options, and its signature."""
    result = score(HYPS, REFS, lowercase=lowercase, tokenize=tokenize)
    bleu = sacrebleu.metrics.BLEU(lowercase=lowercase, tokenize=tokenize)
    chrf = sacrebleu.metrics.CHRF(lowercase=lowercase)
    assert result["bleu"] == bleu.corpus_score(HYPS, [REFS]).score
    assert result["chrf"] == chrf.corpus_score(HYPS, [REFS]).score
    assert result["bleu_signature"] == str(bleu.get_signature())
    assert result["chrf_signature"] == str(chrf.get_signature())
    assert f"tok:{tokenize}" in result["bleu_signature"]
    assert ("case:lc" if lowercase else "case:mixed") in result["bleu_signature"]


def test_lowercase_forgives_case_only():
    hyp, ref = ["the cat sat on the mat"], ["The cat sat on the mat"]
    assert score(hyp, ref, lowercase=True)["bleu"] == pytest.approx(100)
    assert score(hyp, ref)["bleu"] < 100
    with pytest.raises(ValueError, match="tokenize must be one of"):
        score(["a"], ["a"], tokenize="ja-mecab")


def test_bleu_by_hand():
    # Every n-gram of "a b c d" is in the reference, so BLEU is the brevity penalty alone: exp(1 - 5/4).
    assert score(["a b c d"], ["a b c d e"])["bleu"] == pytest.approx(100 * math.exp(1 - 5 / 4))
    assert score(["a b c d e"], ["a b c d e"])["bleu"] == pytest.approx(100)
    # 13a splits off the final period: 7 tokens, all matching, so 100 again, not a penalty for "mat."
    assert score(["The cat sat on the mat."], ["The cat sat on the mat ."])["bleu"] == pytest.approx(100)
    # Cased: "the" does not match "The".
    assert score(["the cat sat"], ["The cat sat"])["bleu"] < 100


def test_score_refuses_misaligned_lists():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        score(["a", "b"], ["a"])


class ScriptedTranslator:
    """Stands in for Translator: evaluate() needs only translate()."""

    def __init__(self, table: dict[str, str]):
        self.table = table
        self.calls: list[list[str]] = []

    def translate(self, texts: list[str], progress: bool = False) -> list[str]:
        self.calls.append(list(texts))
        return [self.table[t] for t in texts]


def test_evaluate_translates_then_scores():
    sources = [f"source {i}" for i in range(len(HYPS))]
    translator = ScriptedTranslator(dict(zip(sources, HYPS)))
    result = evaluate(translator, sources, REFS)
    assert translator.calls == [sources]  # one call, every sentence, in order
    assert result["hypotheses"] == HYPS
    assert result["bleu"] == sacrebleu.corpus_bleu(HYPS, [REFS]).score
    with pytest.raises(ValueError, match="2 source lines but 1 reference lines"):
        evaluate(translator, sources[:2], REFS[:1])


# --- reading test sets -------------------------------------------------------------------------------


def test_read_lines_keeps_every_line_and_only_splits_on_newlines(tmp_path):
    path = tmp_path / "test.en"
    # An empty line, CRLF, and characters str.splitlines() would split on (U+2028, NEL, form feed):
    # a line count that differs from `wc -l` would misalign hypotheses and references.
    lines = ["first", "", "tab\there", "line\u2028separator", "next\x85line", "form\x0cfeed", "last"]
    path.write_bytes(("\n".join(lines[:2]) + "\r\n" + "\n".join(lines[2:]) + "\n").encode("utf-8"))
    assert read_lines(path) == lines
    path.write_text("no final newline\nsecond", encoding="utf-8")
    assert read_lines(path) == ["no final newline", "second"]
    path.write_text("", encoding="utf-8")
    assert read_lines(path) == []
    path.write_text("\n", encoding="utf-8")
    assert read_lines(path) == [""]


def test_read_lines_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'missing.txt'}: no such file")):
        read_lines(tmp_path / "missing.txt")
    path = tmp_path / "latin1.txt"
    path.write_bytes("ok\nstill ok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not UTF-8")):
        read_lines(path)
