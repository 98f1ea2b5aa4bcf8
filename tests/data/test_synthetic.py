"""Tests for aiayn/data/synthetic.py: the demo task is seeded, reorders, agrees, and splits train/valid cleanly."""

import dataclasses

import pytest

from aiayn.data import synthetic
from aiayn.data.corpus import read_parallel
from aiayn.data.synthetic import (
    ADJECTIVES,
    ADVERBS,
    AGREEMENT,
    DETERMINERS,
    NOUNS,
    PREPOSITIONS,
    VERBS,
    Clause,
    NounPhrase,
    generate,
    render_source,
    render_target,
    write_task,
)


def noun(english):
    return next(n for n in NOUNS if english in (n.singular, n.plural))


def verb(english):
    return next(v for v in VERBS if english in (v.third, v.base, v.past))


def test_the_worked_example_of_the_docstring():
    the, a = DETERMINERS[0], DETERMINERS[1]
    clause = Clause(
        subject=NounPhrase(the, ("old",), noun("dog"), plural=True),
        verb=verb("see"),
        past=True,
        object=NounPhrase(a, ("red",), noun("apple"), plural=False),
        preposition="near",
        place=NounPhrase(the, (), noun("river"), plural=False),
        adverb="yesterday",
    )
    source = "The old dogs saw a red apple near the river yesterday."
    target = "Vornen gravai tas salm ta bi pomk ruda un ka ieri videkai."
    assert render_source(clause) == source
    assert render_target(clause) == target
    assert source in synthetic.__doc__ and target in synthetic.__doc__


def test_present_tense_agrees_in_english_and_an_before_vowels():
    clause = Clause(
        subject=NounPhrase(DETERMINERS[1], (), noun("cat"), plural=False),
        verb=verb("chase"),
        past=False,
        object=NounPhrase(DETERMINERS[1], ("angry",), noun("wolf"), plural=False),
        preposition=None,
        place=None,
        adverb=None,
    )
    assert render_source(clause) == "A cat chases an angry wolf."
    assert render_target(clause) == "Mesk un grul irka un ka kaso."
    plural = dataclasses.replace(clause, subject=NounPhrase(DETERMINERS[1], (), noun("cat"), plural=True))
    assert render_source(plural) == "Some cats chase an angry wolf."
    assert render_target(plural) == "Mesken uns grul irka un ka kasoi."


def test_generate_is_deterministic_for_a_seed():
    assert generate(200, seed=5) == generate(200, seed=5)
    assert generate(200, seed=5) != generate(200, seed=6)
    assert generate(50, seed=5)[0] == generate(200, seed=5)[0][:50]


def test_sentences_are_ordinary_text():
    src, tgt = generate(2000, seed=0)
    assert len(set(src)) == len(src) == len(tgt) == 2000
    for sentence in src + tgt:
        assert sentence[0].isupper() and sentence.endswith(".") and sentence.count(".") == 1
        assert "  " not in sentence and sentence == sentence.strip()
    lengths = [len(s.split()) for s in src]
    assert 4 <= min(lengths) and max(lengths) <= 16


def words(sentence):
    return sentence[:-1].lower().split()


def parse_source(sentence):
    """Split toy English into (subject NP, verb, object NP, rest) using only the lexicon."""
    tokens = words(sentence)
    nouns = {w for n in NOUNS for w in (n.singular, n.plural)}
    first = next(i for i, w in enumerate(tokens) if w in nouns)
    second = next(i for i, w in enumerate(tokens) if w in nouns and i > first + 1)
    return tokens[: first + 1], tokens[first + 1], tokens[first + 2 : second + 1], tokens[second + 1 :]


def target_forms():
    """Every word the target language can produce, by kind; built from the lexicon tables."""
    return {
        "noun": {n.stem + p: (n, p == "en") for n in NOUNS for p in ("", "en")},
        "adjective": {a + s: s for a in ADJECTIVES.values() for s in AGREEMENT.values()},
        "determiner": {d.stem + p for d in DETERMINERS for p in ("", "s")},
        "postposition": set(PREPOSITIONS.values()),
        "adverb": set(ADVERBS.values()),
        "marker": {"ka"},
        "verb": {v.stem + t + s for v in VERBS for t in ("", "ek") for s in AGREEMENT.values()},
    }


def test_every_target_word_has_one_reading():
    forms = [form for kind in target_forms().values() for form in kind]
    assert len(forms) == len(set(forms))


@pytest.mark.parametrize("seed", [0, 1])
def test_agreement_and_reordering_hold_on_generated_pairs(seed):
    forms = target_forms()
    for source, target in zip(*generate(500, seed)):
        subject, english_verb, obj, rest = parse_source(source)
        tokens = words(target)
        # SOV: the subject noun first, the verb last, the object (marked by ka) before adverb and verb.
        subject_noun = noun(subject[-1])
        subject_plural = subject[-1] == subject_noun.plural
        assert forms["noun"][tokens[0]] == (subject_noun, subject_plural)
        tense = "ek" if english_verb == verb(english_verb).past else ""
        agreement = AGREEMENT[subject_noun.gender, subject_plural]
        assert tokens[-1] == verb(english_verb).stem + tense + agreement  # agrees across the sentence
        has_adverb = rest[-1:] != [] and rest[-1] in ADVERBS
        assert tokens[-2:-1] == ([ADVERBS[rest[-1]]] if has_adverb else ["ka"])
        ka = tokens.index("ka")
        object_start = max(i for i in range(ka) if tokens[i] in forms["noun"])
        object_noun = noun(obj[-1])
        assert forms["noun"][tokens[object_start]] == (object_noun, obj[-1] == object_noun.plural)
        # Every adjective follows its noun (possibly after other adjectives) and carries its agreement.
        current = None
        for w in tokens:
            if w in forms["noun"]:
                current = forms["noun"][w]
            elif w in forms["adjective"]:
                assert forms["adjective"][w] == AGREEMENT[current[0].gender, current[1]]
            else:
                current = None
        # The object's adjectives keep the English order; its determiner ends the NP, then ka.
        stems = [ADJECTIVES[w] for w in obj[1:-1]]
        suffix = AGREEMENT[object_noun.gender, obj[-1] == object_noun.plural]
        assert [w.removesuffix(suffix) for w in tokens[object_start + 1 : ka - 1]] == stems
        assert tokens[ka - 1] in forms["determiner"]
        # A place phrase becomes a postpositional phrase between subject and object.
        if rest and rest[0] in PREPOSITIONS:
            assert tokens[object_start - 1] == PREPOSITIONS[rest[0]]
        else:
            assert not set(tokens) & forms["postposition"]


def test_target_is_a_function_of_the_source():
    src, tgt = generate(20000, seed=0)
    assert len(set(src)) == len(src)  # distinct sources, so no source has two targets
    assert len(set(tgt)) == len(tgt)  # and the mapping does not merge sentences


def test_write_task_makes_disjoint_files_of_the_asked_sizes(tmp_path):
    train, valid = write_task(tmp_path / "task", n_train=300, n_valid=40, seed=2)
    assert (train, valid) == (tmp_path / "task/train", tmp_path / "task/valid")
    train_src, train_tgt = read_parallel(train, synthetic.SRC_LANG, synthetic.TGT_LANG)
    valid_src, valid_tgt = read_parallel(valid, synthetic.SRC_LANG, synthetic.TGT_LANG)
    assert len(train_src) == len(train_tgt) == 300 and len(valid_src) == len(valid_tgt) == 40
    assert not set(train_src) & set(valid_src)
    assert (valid_src + train_src, valid_tgt + train_tgt) == generate(340, seed=2)
    write_task(tmp_path / "again", n_train=300, n_valid=40, seed=2)
    assert (tmp_path / "again/train.xx").read_text() == (tmp_path / "task/train.xx").read_text()
