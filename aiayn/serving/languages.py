"""Which language a text is in, among the languages a server translates (LibreTranslate's source=auto
and /detect), and the English names of language codes."""

from __future__ import annotations

import functools
from collections.abc import Collection

import langcodes
from lingua import IsoCode639_1, Language, LanguageDetector, LanguageDetectorBuilder

# The detector is lingua's, chosen by benchmarks/bench_text.py (docs/bench_text_cpu.json) among langid,
# langdetect, lingua and lexilang. All four are near perfect on whole sentences; on a few words (what a
# user types into a page) lingua, langdetect and lexilang are close and langid falls behind. Of those
# three lingua scores every language (what /detect answers; lexilang names one), answers the same text
# the same way every time (langdetect samples at random unless a process-wide seed is set), answers
# faster than langdetect, is built for exactly the languages served, and one detector serves many threads
# (its documentation says so). What it costs: the largest wheel of the four, and the memory and time of
# loading its models when a detector is first built, once per set of languages.


def detect(text: str, among: Collection[str]) -> list[tuple[str, float]]:
    """The languages of `among` (ISO 639-1 codes, as model directories name them) the text may be in,
    best first, each with LibreTranslate's confidence: a percentage. A code the detector has no model
    for is never answered. Raises ValueError when no language can be told: a text without letters, or
    one the detector cannot place among these languages."""
    if not any(c.isalpha() for c in text):
        raise ValueError(f"cannot detect the language of {_preview(text)}: it has no letters")
    known = sorted({code for code in among if _lingua(code) is not None})
    if not known:
        choice = f"no model for {', '.join(sorted(among))}" if among else "no languages to choose among"
        raise ValueError(f"cannot detect the language of {_preview(text)}: {choice}")
    if len(known) == 1:  # lingua needs two languages to choose between; one is the answer
        return [(known[0], 100.0)]
    scores = _detector(tuple(known)).compute_language_confidence_values(text)
    found = [
        (value.language.iso_code_639_1.name.lower(), 100 * value.value) for value in scores if value.value > 0
    ]
    if not found:
        raise ValueError(f"cannot detect the language of {_preview(text)} among {', '.join(known)}")
    return found


def language_name(code: str) -> str:
    """The English name of a language code ("de" -> "German"); a code no registry knows is its own name."""
    if not langcodes.tag_is_valid(code) or langcodes.Language.get(code).language is None:
        return code
    return langcodes.Language.get(code).display_name()


@functools.lru_cache(maxsize=16)
def _detector(codes: tuple[str, ...]) -> LanguageDetector:
    """A detector for these languages (sorted codes), built once, its models loaded at once so that the
    first text does not wait for them."""
    languages = [_lingua(code) for code in codes]
    return LanguageDetectorBuilder.from_languages(*languages).with_preloaded_language_models().build()


def _lingua(code: str) -> Language | None:
    """lingua's language of an ISO 639-1 code, None when it has none."""
    try:
        return Language.from_iso_code_639_1(IsoCode639_1.from_str(code))
    except ValueError:  # lingua's answer for a code it does not know
        return None


def _preview(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")
