"""The built-in demo task: seeded toy English -> an invented SOV language with agreement, made on the spot.

Copying is too easy to show that attention learns anything, so the target language ("xx") reorders and agrees:

- Source (toy English): SUBJECT VERB OBJECT [PREPOSITION NP] [ADVERB].
  A noun phrase (NP) is DETERMINER ADJECTIVE{0,2} NOUN, singular or plural ("a" becomes "an" before a vowel);
  the verb is present ("sees"/"see", agreeing with the subject) or past ("saw"). 5 to 15 words.
- Target: SUBJECT [NP POSTPOSITION] OBJECT ka [ADVERB] VERB, verb last (SOV).
  An NP is NOUN ADJECTIVE* DETERMINER: adjectives follow their noun in English order, the determiner ends it.
  Every noun has a gender, a or o, not visible in its stem. Plural nouns add -en, plural determiners -s.
  Adjectives take the agreement suffix of their noun, AGREEMENT[gender, plural]: -a, -ai, -o, -oi.
  The verb is STEM + tense (past -ek) + the agreement suffix of the subject, so it agrees across the sentence.
  The object NP is followed by the case particle "ka". Each word maps through a fixed lexicon, so the
  target is a deterministic function of the source.

Worked example (dog = vorn, gender a; old = grav; the = ta; river = salm; near = bi; apple = pomk, gender a;
red = rud; a = un; yesterday = ieri; see = vid):

    The old dogs saw a red apple near the river yesterday.
    Vornen gravai tas salm ta bi pomk ruda un ka ieri videkai.

"Vornen gravai tas": dogs = vorn+en, old agrees a-plural (grav+ai), plural "the" (ta+s); "salm ta bi": near
the river as a postposition; "pomk ruda un ka": the object, red agrees a-singular, then the case particle;
"videkai": see + past (ek) + a-plural agreement with "the old dogs".
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

SRC_LANG, TGT_LANG = "en", "xx"


class Noun(NamedTuple):
    singular: str
    plural: str
    stem: str  # target
    gender: str  # "a" or "o"


class Verb(NamedTuple):
    third: str  # present, third person singular
    base: str  # present plural
    past: str
    stem: str  # target


class Determiner(NamedTuple):
    singular: str
    plural: str
    stem: str  # target


# fmt: off
NOUNS = (  # 30 nouns, 15 of each gender
    Noun("dog", "dogs", "vorn", "a"), Noun("cat", "cats", "mesk", "o"), Noun("bird", "birds", "pilt", "a"),
    Noun("horse", "horses", "drav", "o"), Noun("child", "children", "talm", "a"),
    Noun("woman", "women", "resk", "o"), Noun("man", "men", "gord", "a"),
    Noun("teacher", "teachers", "lurn", "o"), Noun("king", "kings", "dorv", "o"),
    Noun("queen", "queens", "selv", "a"), Noun("friend", "friends", "jelt", "o"),
    Noun("baby", "babies", "nump", "a"), Noun("wolf", "wolves", "grul", "a"),
    Noun("ball", "balls", "bol", "o"), Noun("book", "books", "lipr", "a"), Noun("tree", "trees", "sorb", "o"),
    Noun("house", "houses", "domb", "a"), Noun("river", "rivers", "salm", "o"),
    Noun("garden", "gardens", "kelt", "a"), Noun("apple", "apples", "pomk", "a"),
    Noun("box", "boxes", "kust", "o"),
    Noun("boat", "boats", "navk", "a"), Noun("city", "cities", "urb", "o"),
    Noun("forest", "forests", "silv", "a"), Noun("mountain", "mountains", "mont", "o"),
    Noun("car", "cars", "karn", "a"), Noun("song", "songs", "kant", "o"), Noun("door", "doors", "port", "a"),
    Noun("key", "keys", "klav", "o"), Noun("bridge", "bridges", "pont", "o"),
)
ADJECTIVES = MappingProxyType({
    "old": "grav", "young": "jun", "big": "mag", "small": "pik", "red": "rud", "blue": "blav",
    "green": "verd", "happy": "fel", "sad": "trist", "tall": "alt", "strong": "fort", "clever": "sag",
    "brave": "kor", "angry": "irk", "hungry": "famr",
})
VERBS = (
    Verb("sees", "see", "saw", "vid"), Verb("likes", "like", "liked", "plak"),
    Verb("finds", "find", "found", "trov"), Verb("holds", "hold", "held", "ten"),
    Verb("follows", "follow", "followed", "sekw"), Verb("helps", "help", "helped", "jut"),
    Verb("watches", "watch", "watched", "spek"), Verb("calls", "call", "called", "vok"),
    Verb("carries", "carry", "carried", "fer"), Verb("visits", "visit", "visited", "vizt"),
    Verb("takes", "take", "took", "pren"), Verb("meets", "meet", "met", "renk"),
    Verb("chases", "chase", "chased", "kas"), Verb("draws", "draw", "drew", "pint"),
    Verb("loves", "love", "loved", "lub"),
)
DETERMINERS = (
    Determiner("the", "the", "ta"), Determiner("a", "some", "un"), Determiner("this", "these", "ki"),
    Determiner("that", "those", "lo"), Determiner("my", "my", "mi"),
)
PREPOSITIONS = MappingProxyType({"near": "bi", "in": "ine", "on": "sur", "under": "sub", "behind": "dor"})
ADVERBS = MappingProxyType({
    "today": "hoi", "yesterday": "ieri", "often": "spes", "quickly": "rapi", "slowly": "lenti",
    "again": "redo",
})
# fmt: on
AGREEMENT = MappingProxyType(
    {("a", False): "a", ("a", True): "ai", ("o", False): "o", ("o", True): "oi"}
)  # (gender, plural)
NOUN_PLURAL, DETERMINER_PLURAL, PAST, OBJECT_MARKER = "en", "s", "ek", "ka"


@dataclass(frozen=True)
class NounPhrase:
    determiner: Determiner
    adjectives: tuple[str, ...]  # English adjectives, in order
    noun: Noun
    plural: bool


@dataclass(frozen=True)
class Clause:
    subject: NounPhrase
    verb: Verb
    past: bool
    object: NounPhrase
    preposition: str | None  # English preposition, with `place` its object
    place: NounPhrase | None
    adverb: str | None


def render_source(clause: Clause) -> str:
    """The toy English sentence."""
    if clause.past:
        verb = clause.verb.past
    else:
        verb = clause.verb.base if clause.subject.plural else clause.verb.third
    words = [*_english_np(clause.subject), verb, *_english_np(clause.object)]
    if clause.place is not None:
        words += [clause.preposition, *_english_np(clause.place)]
    if clause.adverb is not None:
        words.append(clause.adverb)
    return _sentence(words)


def render_target(clause: Clause) -> str:
    """The sentence in the invented language: SOV, NP-final determiners, agreement (see the module doc)."""
    words = _target_np(clause.subject)
    if clause.place is not None:
        words += [*_target_np(clause.place), PREPOSITIONS[clause.preposition]]
    words += [*_target_np(clause.object), OBJECT_MARKER]
    if clause.adverb is not None:
        words.append(ADVERBS[clause.adverb])
    subject = clause.subject
    tense = PAST if clause.past else ""
    words.append(clause.verb.stem + tense + AGREEMENT[subject.noun.gender, subject.plural])
    return _sentence(words)


def sample_clause(rng: random.Random) -> Clause:
    """A random clause: half the NPs plural, half the verbs past, 0-2 adjectives, maybe a place, an adverb."""
    has_place = rng.random() < 0.3
    return Clause(
        subject=_sample_np(rng),
        verb=rng.choice(VERBS),
        past=rng.random() < 0.5,
        object=_sample_np(rng),
        preposition=rng.choice(sorted(PREPOSITIONS)) if has_place else None,
        place=_sample_np(rng) if has_place else None,
        adverb=rng.choice(sorted(ADVERBS)) if rng.random() < 0.3 else None,
    )


def generate(n: int, seed: int) -> tuple[list[str], list[str]]:
    """n pairs (source sentences, target sentences) with distinct sources, the same for the same seed."""
    if n < 0:
        raise ValueError(f"n must not be negative, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    src, tgt = [], []
    while len(src) < n:
        clause = sample_clause(rng)
        source = render_source(clause)
        if source not in seen:  # short sentences repeat; a repeat would leak between train and valid
            seen.add(source)
            src.append(source)
            tgt.append(render_target(clause))
    return src, tgt


def write_task(
    directory: str | Path, n_train: int = 20000, n_valid: int = 500, seed: int = 0
) -> tuple[Path, Path]:
    """Write DIRECTORY/{train,valid}.{en,xx}; returns the prefixes (train, valid) for data.read_parallel.

    Validation sources never occur in training.
    """
    if n_train < 1 or n_valid < 1:
        raise ValueError(f"n_train and n_valid must be at least 1, got {n_train} and {n_valid}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    src, tgt = generate(n_valid + n_train, seed)
    prefixes = directory / "train", directory / "valid"
    for prefix, part in zip(prefixes, (slice(n_valid, None), slice(None, n_valid))):
        for lang, lines in ((SRC_LANG, src[part]), (TGT_LANG, tgt[part])):
            Path(f"{prefix}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return prefixes


def _sample_np(rng: random.Random) -> NounPhrase:
    n_adjectives = rng.choices((0, 1, 2), weights=(6, 3, 1))[0]
    return NounPhrase(
        determiner=rng.choice(DETERMINERS),
        adjectives=tuple(rng.sample(sorted(ADJECTIVES), n_adjectives)),
        noun=rng.choice(NOUNS),
        plural=rng.random() < 0.5,
    )


def _english_np(phrase: NounPhrase) -> list[str]:
    rest = [*phrase.adjectives, phrase.noun.plural if phrase.plural else phrase.noun.singular]
    determiner = phrase.determiner.plural if phrase.plural else phrase.determiner.singular
    if determiner == "a" and rest[0][0] in "aeiou":
        determiner = "an"
    return [determiner, *rest]


def _target_np(phrase: NounPhrase) -> list[str]:
    suffix = AGREEMENT[phrase.noun.gender, phrase.plural]
    noun = phrase.noun.stem + (NOUN_PLURAL if phrase.plural else "")
    adjectives = [ADJECTIVES[adjective] + suffix for adjective in phrase.adjectives]
    determiner = phrase.determiner.stem + (DETERMINER_PLURAL if phrase.plural else "")
    return [noun, *adjectives, determiner]


def _sentence(words: list[str]) -> str:
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


__all__ = [
    "SRC_LANG",
    "TGT_LANG",
    "generate",
    "write_task",
    "render_source",
    "render_target",
    "sample_clause",
    "Clause",
    "NounPhrase",
    "NOUNS",
    "ADJECTIVES",
    "VERBS",
    "DETERMINERS",
    "PREPOSITIONS",
    "ADVERBS",
    "AGREEMENT",
]
