"""The text side of the LibreTranslate API, measured to choose its libraries: which sentence splitter
aiayn.serving.documents uses and which language detector aiayn.serving.languages uses.

Splitters (pysbd, sentence_splitter's Moses rules, blingfire, syntok), per language (en, de, fr):
- Multi30k: paragraphs of k consecutive validation lines (k uniform{2..6}, seeded) joined by one space,
  of the lines that end in . ! or ? (so that the gold boundaries are the line ends);
- hard: paragraphs written below (abbreviations, ordinals, decimals, quotes, ellipses) with their gold
  sentences.
A split is scored by its boundaries, counted in non-space characters from the paragraph's start (so a
splitter that moves spaces around is neither helped nor hurt): paragraphs split exactly right, boundary
precision, recall and F1, and gold sentences per second. Then robustness, which the joined text depends
on: over --fuzz random lines of tricky pieces (abbreviations, quotes, brackets, digits, odd spaces) in
each language, and the short strings in FOUND, how often a splitter raises or changes a character that
is not a space. The choice: among the splitters that never did, the best exact rate over the languages
and both sets, then the languages covered, then speed.

Detectors (langid, langdetect, lingua in its default and low-accuracy modes, lexilang), restricted to en,
de and fr: accuracy on every Multi30k validation line of the three languages, and on its first three
words (short texts); the time of a call; and, in a fresh process each, what loading costs: seconds and
resident memory to import, build and answer the first call. The choice: among the detectors that score every language (LibreTranslate's
/detect answers each with a confidence; lexilang names one), the best on short texts to the percent
(whole lines are near perfect for all), then on whole lines, then the time of a call.

    python benchmarks/bench_text.py [--seed 1] [--fuzz 10000] [--results docs/bench_text_cpu.json]

Skips (exit 0) when ../shared/data/multi30k is absent. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.metadata
import json
import random
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
LANGUAGES = ("en", "de", "fr")

# Paragraphs whose boundaries a careful reader agrees on, each a list of its gold sentences (joined by
# one space): the abbreviations, ordinals, decimals, quotes and ellipses that Multi30k's captions lack.
HARD = {
    "en": [
        ["Dr. Smith arrived at 10 a.m. on Monday.", "He brought apples, pears, etc. to the meeting.",
         "The room was 3.5 m wide."],
        ["Mr. and Mrs. Jones live on Baker St. in London.", "Their son works for Acme Inc. as an engineer.",
         "He earns about $4.5 million a year!"],
        ['"Where are you going?" asked Anna.', '"Home," he said.', "She waited... and then left."],
        ["The U.S. economy grew by 2.1% in 2019.", "Prof. Brown disagreed, e.g. on the figures.",
         "Was he right?", "Nobody knows."],
        ["I will be there at 5 p.m.", "Don't be late!"],
        ["See section 4.2 for details.", "It covers versions 1.0 to 2.5, i.e. all of them.",
         "Call me at 555-0123."],
        ["The meeting ended early...", "Everyone went home."],
        ['She said: "It is over."', "Then she left the room."],
        ["Gen. Patton led the Third Army in 1944.", "Vol. 2 of his diary was published later."],
        ["Read pp. 10-12 by Jan. 5.", "No. 7 is my favourite song."],
        ["Ms. Lee met Sen. Harris at the White House.", "They talked about the new law.", "It passed on Friday."],
        ["The shop opens on Feb. 1st at 9 a.m. sharp.", "Bring your receipt, your ID, etc.",
         "Returns end on March 3."],
        ['"Are you coming?" she asked.', '"Yes," he replied, "in a minute."', "Then he closed the door."],
        ["The fare is $2.50 per ride.", "A monthly pass costs 75.00 dollars.", "Children under 6 ride free."],
    ],
    "de": [
        ["Dr. Müller kam am 1. Mai nach Berlin.", "Er brachte z. B. Äpfel, Birnen usw. mit.",
         "Die Strecke war 3,5 km lang."],
        ["Das Treffen beginnt um 14 Uhr.", "Bitte seien Sie pünktlich!", "Gibt es Fragen?"],
        ["Herr Prof. Dr. Schmidt wohnt in der Goethestr. 12.", "Er ist 65 Jahre alt."],
        ["„Wohin gehst du?“, fragte Anna.", "„Nach Hause“, sagte er.", "Sie wartete... und ging dann."],
        ["Am 3. Oktober ist Feiertag.", "Die Geschäfte sind geschlossen, d. h. man kann nichts kaufen."],
        ["Das Buch kostet ca. 20 Euro.", "Es hat ca. 300 Seiten, u. a. viele Bilder."],
        ["Der 2. Weltkrieg endete 1945.", "Danach begann der Wiederaufbau."],
        ["Er sagte: „Es ist vorbei.“", "Dann verließ er den Raum."],
        ["Das Spiel endete 2:1.", "Die Fans jubelten... bis spät in die Nacht."],
        ["Die Firma Müller & Co. KG wurde 1990 gegründet.", "Sie hat heute 250 Mitarbeiter."],
        ["Lesen Sie bitte S. 10 bis 12.", "Nr. 7 ist mein Lieblingslied."],
        ["Frau Dr. Weber traf Bürgermeister Klein im Rathaus.", "Sie sprachen über das neue Gesetz.",
         "Es wurde am Freitag beschlossen."],
        ["Der Laden öffnet am 2. Januar um 9 Uhr.", "Bringen Sie bitte Kassenbon, Ausweis o. Ä. mit.",
         "Umtausch ist bis zum 15. Februar möglich."],
        ["„Kommst du mit?“, fragte sie.", "„Ja“, antwortete er, „gleich.“", "Dann schloss er die Tür."],
        ["Eine Fahrt kostet 2,50 €.", "Die Monatskarte kostet 75 Euro.", "Kinder unter 6 Jahren fahren gratis."],
    ],
    "fr": [
        ["M. Dupont est arrivé le 1er mai à Paris.", "Il a apporté des pommes, des poires, etc. pour le repas.",
         "La route faisait 3,5 km."],
        ["Mme Martin habite au 12, av. Victor Hugo.", "Elle a 65 ans."],
        ["« Où vas-tu ? » demanda Anna.", "« À la maison », répondit-il.", "Elle attendit... puis partit."],
        ["La réunion commence à 14 h.", "Soyez à l'heure !", "Des questions ?"],
        ["Le Dr Bernard a vu p. ex. trois patients.", "C'était le 3 oct. dernier."],
        ["Le livre coûte env. 20 euros.", "Il compte environ 300 pages, cf. la préface."],
        ["La Seconde Guerre mondiale s'est terminée en 1945.", "La reconstruction a ensuite commencé."],
        ["Il a dit : « C'est fini. »", "Puis il a quitté la pièce."],
        ["Le match s'est terminé 2 à 1.", "Les supporters ont fêté ça... jusque tard dans la nuit."],
        ["Voir le chap. 4 pour les détails.", "Le n° 7 est ma chanson préférée."],
        ["MM. Durand et Petit sont partis.", "Ils reviendront vers 18 h 30."],
        ["Mme Leroy a rencontré le sénateur Blanc à l'Élysée.", "Ils ont parlé de la nouvelle loi.",
         "Elle a été votée vendredi."],
        ["Le magasin ouvre le 2 janv. à 9 h.", "Apportez votre ticket, une pièce d'identité, etc.",
         "Les échanges sont possibles jusqu'au 15 février."],
        ["« Tu viens ? » demanda-t-elle.", "« Oui, répondit-il, tout de suite. »", "Puis il ferma la porte."],
        ["Un trajet coûte 2,50 €.", "L'abonnement mensuel coûte 75 euros.",
         "Les enfants de moins de 6 ans voyagent gratuitement."],
    ],
}  # fmt: skip


# The pieces of the robustness lines (a line has no line break: documents split lines first)
PIECES = tuple("abcABCxyzÄé .!?…\"'«»„“”()[]-–—:;,0123456789\t\u00a0\u3002&*%$•") + (
    "Dr.", "etc.", "z. B.", "3.5", "...", "  ", "e.g.", "U.S.", "Mr.", "1.", "www.x.com", "a@b.de", "(a)",
    "ii.", "Nr.", "St.", "M.", "p. ex.",
)  # fmt: skip
# Short strings on which a candidate raised or lost characters in a longer fuzzing run, reduced by hand to
# what still fails: a failure this rare may not come up in --fuzz lines.
FOUND = ("B.A B(a", "„[Nr.??", "9&”;aB%ii.z. B.Dr.?!")


# --- Splitters: each makes, for a language, a function from a paragraph to its sentences ---------------


def pysbd_splitter(language: str) -> Callable[[str], list[str]]:
    import pysbd

    segmenter = pysbd.Segmenter(language=language, clean=False)
    return segmenter.segment


def moses_splitter(language: str) -> Callable[[str], list[str]]:
    from sentence_splitter import SentenceSplitter

    return SentenceSplitter(language=language).split


def blingfire_splitter(language: str) -> Callable[[str], list[str]]:
    import blingfire  # one model for every language

    def split(text: str) -> list[str]:
        return [text[a:b] for a, b in blingfire.text_to_sentences_and_offsets(text)[1]]

    return split


def syntok_splitter(language: str) -> Callable[[str], list[str]]:
    from syntok import segmenter  # one set of rules, English, German and Spanish together

    def split(text: str) -> list[str]:
        return [
            text[sentence[0].offset : sentence[-1].offset + len(sentence[-1].value)]
            for paragraph in segmenter.analyze(text)
            for sentence in paragraph
        ]

    return split


# name -> (maker, package, the languages it has rules for; None: one model for all)
SPLITTERS = {
    "pysbd": (pysbd_splitter, "pysbd", "am ar bg da de el en es fa fr hi hy it ja kk mr my nl pl ru sk ur zh"),
    "sentence_splitter": (moses_splitter, "sentence-splitter",
                          "ca cs da de el en es fi fr hu is it lt lv nl no pl pt ro ru sk sl sv tr"),
    "blingfire": (blingfire_splitter, "blingfire", None),
    "syntok": (syntok_splitter, "syntok", "en de es"),
}  # fmt: skip


def boundaries(sentences: list[str]) -> tuple[int, set[int]]:
    """(non-space characters in all, the offsets in non-space characters where a sentence ends inside)."""
    ends, total = set(), 0
    for sentence in sentences:
        total += len(re.sub(r"\s", "", sentence))
        ends.add(total)
    return total, ends - {total}


def multi30k_paragraphs(language: str, seed: int) -> list[list[str]]:
    with gzip.open(MULTI30K / f"val.{language}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if re.search(r"[.!?]\s*$", line)]
    rng, paragraphs, i = random.Random(seed), [], 0
    while i < len(lines):
        k = rng.randint(2, 6)
        paragraphs.append(lines[i : i + k])
        i += k
    return paragraphs


def score_splitter(split: Callable[[str], list[str]], paragraphs: list[list[str]]) -> dict:
    exact = tp = fp = fn = lost = 0
    start = time.perf_counter()
    found = [split(" ".join(gold)) for gold in paragraphs]
    seconds = time.perf_counter() - start
    for gold, pieces in zip(paragraphs, found):
        (n_gold, want), (n_got, got) = boundaries(gold), boundaries(pieces)
        lost += n_gold != n_got  # a splitter that changed or dropped characters
        exact += want == got and n_gold == n_got
        tp, fp, fn = tp + len(want & got), fp + len(got - want), fn + len(want - got)
    precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    sentences = sum(map(len, paragraphs))
    return {
        "paragraphs": len(paragraphs),
        "sentences": sentences,
        "exact_pct": 100 * exact / len(paragraphs),
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / max(precision + recall, 1e-12),
        "sentences_per_s": sentences / seconds,
        "characters_changed": lost,
    }


def robustness(split: dict[str, Callable[[str], list[str]]], lines: int, seed: int) -> dict:
    """How often, per language, the splitter raised or changed a non-space character (its sentences'
    non-space characters are not the line's), over `lines` random lines and the strings of FOUND."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(lines)]
    raised = changed = 0
    examples = []
    for text in [*FOUND, *texts]:
        for language, cut in split.items():
            try:
                pieces = cut(text)
            except Exception as e:  # what a library raises on a bad line is what we measure
                raised += 1
                examples.append({"language": language, "text": text, "raised": repr(e)[:120]})
                continue
            if re.sub(r"\s", "", "".join(pieces)) != re.sub(r"\s", "", text):
                changed += 1
                examples.append({"language": language, "text": text, "sentences": pieces})
    return {"lines": len(texts) + len(FOUND), "raised": raised, "changed": changed, "examples": examples[:5]}


def splitters(seed: int, fuzz: int) -> dict:
    sets = {
        "multi30k": {lang: multi30k_paragraphs(lang, seed) for lang in LANGUAGES},
        "hard": HARD,
    }
    rows = []
    for name, (make, _, covered) in SPLITTERS.items():
        for language in LANGUAGES:
            start = time.perf_counter()
            split = make(language)
            split("Warm up. Twice.")
            built = time.perf_counter() - start
            supported = covered is None or language in covered.split()
            for data, paragraphs in sets.items():
                row = {"splitter": name, "language": language, "data": data, "supported": supported}
                rows.append({**row, "build_s": built, **score_splitter(split, paragraphs[language])})
                r = rows[-1]
                print(f"{name:18} {language} {data:8} exact {r['exact_pct']:5.1f}%  F1 {r['f1']:.3f}  "
                      f"P {r['precision']:.3f} R {r['recall']:.3f}  {r['sentences_per_s']:9.0f} sent/s"
                      + ("" if supported else "  (no rules for the language)"), flush=True)  # fmt: skip
    summary = {}
    for name, (make, package, covered) in SPLITTERS.items():
        mine = [r for r in rows if r["splitter"] == name]
        robust = robustness({language: make(language) for language in LANGUAGES}, fuzz, seed)
        summary[name] = {
            "version": importlib.metadata.version(package),
            "languages": "all (one model)" if covered is None else covered,
            "exact_pct_multi30k": mean(r["exact_pct"] for r in mine if r["data"] == "multi30k"),
            "exact_pct_hard": mean(r["exact_pct"] for r in mine if r["data"] == "hard"),
            "exact_pct": mean(r["exact_pct"] for r in mine),
            "f1": mean(r["f1"] for r in mine),
            "sentences_per_s": mean(r["sentences_per_s"] for r in mine if r["data"] == "multi30k"),
            "robustness": robust,
            "eligible": robust["raised"] == robust["changed"] == 0,
        }
    # a splitter that raises or changes characters cannot be joined back exactly; among the others the
    # exact rate over both sets and the three languages, then coverage, then speed
    coverage = {name: 1000 if c is None else len(c.split()) for name, (_, _, c) in SPLITTERS.items()}
    eligible = [name for name in summary if summary[name]["eligible"]]
    best = max(
        eligible,
        key=lambda n: (round(summary[n]["exact_pct"], 1), coverage[n], summary[n]["sentences_per_s"]),
    )
    return {"rows": rows, "summary": summary, "chosen": best}


# --- Detectors: each makes, for a set of languages, a function from a text to a code (None: no answer) ---


def langid_detector(languages: tuple[str, ...]) -> Callable[[str], str | None]:
    from langid.langid import LanguageIdentifier, model

    identifier = LanguageIdentifier.from_modelstring(model, norm_probs=True)
    identifier.set_languages(list(languages))
    return lambda text: identifier.classify(text)[0]


def langdetect_detector(languages: tuple[str, ...]) -> Callable[[str], str | None]:
    from langdetect import detector_factory
    from langdetect.lang_detect_exception import LangDetectException

    detector_factory.init_factory()  # the profiles of all its languages, once per process
    # its sampling is random otherwise: the same text, another answer
    detector_factory.DetectorFactory.seed = 0
    factory = detector_factory._factory

    def detect(text: str) -> str | None:
        detector = factory.create()
        detector.set_prior_map({language: 1.0 for language in languages})  # its own restriction
        detector.append(text)
        try:
            return detector.detect()
        except LangDetectException:
            return None

    return detect


def lingua_detector(languages: tuple[str, ...], low_accuracy: bool = False) -> Callable[[str], str | None]:
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    wanted = [Language.from_iso_code_639_1(IsoCode639_1.from_str(code)) for code in languages]
    builder = LanguageDetectorBuilder.from_languages(*wanted).with_preloaded_language_models()
    detector = (builder.with_low_accuracy_mode() if low_accuracy else builder).build()

    def detect(text: str) -> str | None:
        found = detector.detect_language_of(text)
        return None if found is None else found.iso_code_639_1.name.lower()

    return detect


def lexilang_detector(languages: tuple[str, ...]) -> Callable[[str], str | None]:
    from lexilang.detector import detect as lexilang_detect

    def detect(text: str) -> str | None:
        code, score = lexilang_detect(text, languages=list(languages))
        return code if score > 0 else None

    return detect


# name -> (maker, package, whether it scores every language it chooses among)
DETECTORS = {
    "langid": (langid_detector, "langid", True),
    "langdetect": (langdetect_detector, "langdetect", True),
    "lingua": (lingua_detector, "lingua-language-detector", True),
    "lingua low accuracy": (
        functools.partial(lingua_detector, low_accuracy=True),
        "lingua-language-detector",
        True,
    ),
    "lexilang": (lexilang_detector, "lexilang", False),
}

# a fresh process: import, build for (en, de, fr) and answer one call; seconds and the resident memory it added
LOAD = """
import json, sys, time
sys.path.insert(0, {folder!r})
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
before, start = rss(), time.perf_counter()
import bench_text
detect = bench_text.DETECTORS[{name!r}][0](("en", "de", "fr"))
built = time.perf_counter()
detect("Ein Mann schläft in einem grünen Raum auf einem Sofa.")
print(json.dumps({{"build_s": built - start, "first_call_s": time.perf_counter() - built, "rss_mb": rss() - before}}))
"""


def detectors() -> dict:
    texts = {}
    for language in LANGUAGES:
        with gzip.open(MULTI30K / f"val.{language}.gz", "rt", encoding="utf-8") as f:
            texts[language] = [line.strip() for line in f if line.strip()]
    rows = {}
    for name, (make, package, scores) in DETECTORS.items():
        code = LOAD.format(folder=str(Path(__file__).resolve().parent), name=name)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        load = json.loads(done.stdout.splitlines()[-1])
        detect = make(LANGUAGES)
        row = {"version": importlib.metadata.version(package), "scores_every_language": scores, **load}
        for kind, cut in (("full", lambda t: t), ("short", lambda t: " ".join(t.split()[:3]))):
            right = calls = 0
            start = time.perf_counter()
            for language, lines in texts.items():
                for line in lines:
                    right += detect(cut(line)) == language
                    calls += 1
            row[f"accuracy_{kind}_pct"] = 100 * right / calls
            row[f"ms_per_call_{kind}"] = 1000 * (time.perf_counter() - start) / calls
        row["texts"] = calls
        rows[name] = row
        print(f"{name:19} full {row['accuracy_full_pct']:5.1f}%  short {row['accuracy_short_pct']:5.1f}%  "
              f"{row['ms_per_call_full']:6.3f} ms/call  load {row['build_s']:5.2f} s + first call "
              f"{row['first_call_s']:5.2f} s, {row['rss_mb']:6.1f} MB", flush=True)  # fmt: skip
    best = max(
        (name for name, row in rows.items() if row["scores_every_language"]),
        key=lambda n: (round(rows[n]["accuracy_short_pct"]), round(rows[n]["accuracy_full_pct"]), -rows[n]["ms_per_call_full"]),
    )  # fmt: skip
    print(f"detector chosen: {best}")
    return {"rows": rows, "chosen": best}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="the paragraph lengths' seed")
    ap.add_argument("--fuzz", type=int, default=10000, help="random lines per language for robustness")
    ap.add_argument("--results", help="also write the summary to this JSON file (docs/bench_text_cpu.json)")
    args = ap.parse_args()
    if not all((MULTI30K / f"val.{language}.gz").is_file() for language in LANGUAGES):
        print(f"bench_text: skipped, it needs {MULTI30K}/val.{{en,de,fr}}.gz (the shared data)")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine, save_results

    print(f"machine: {machine()}", flush=True)
    split = splitters(args.seed, args.fuzz)
    for name, s in split["summary"].items():
        r = s["robustness"]
        print(f"{name:18} exact {s['exact_pct']:5.1f}% (multi30k {s['exact_pct_multi30k']:5.1f}%, hard "
              f"{s['exact_pct_hard']:5.1f}%)  F1 {s['f1']:.3f}  {s['sentences_per_s']:9.0f} sent/s  "
              f"raised {r['raised']}, changed characters {r['changed']} of {r['lines']} lines x 3")  # fmt: skip
    print(f"splitter chosen: {split['chosen']}")
    report = {
        "benchmark": "text",
        "machine": machine(),
        "command": shlex.join(["python", *sys.argv]),
        "splitters": split,
        "detectors": detectors(),
    }
    print(json.dumps(report))
    save_results(args.results, report)


if __name__ == "__main__":
    main()
