"""Many models in one `aiayn serve`, spoken to with LibreTranslate's own Python clients, unchanged
(libretranslatepy's LibreTranslateAPI, deep-translator's LibreTranslator) and with its API's JSON and form
bodies: the answers equal Translator.translate's of each model for the same sentences, a paragraph comes
back one translation a sentence in order, HTML with the same tree, a pair no model translates goes through
a pivot, the errors are LibreTranslate's shape, and a server capped below its models' size unloads the
least recently used and stays within its cap."""

import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from bs4 import BeautifulSoup
from conftest import MULTI30K, free_port, multi30k_lines, opus_mt_directory, run_cli
from fastapi.testclient import TestClient

from aiayn.checkpoint import Languages, ModelDir, save_languages, save_model
from aiayn.config import InferenceOptions, SearchConfig, ServeConfig, preset
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.serving.app import create_app
from aiayn.serving.server import read_models

libretranslatepy = pytest.importorskip("libretranslatepy")
deep_translator = pytest.importorskip("deep_translator")

SENTENCES = [
    "The small dogs see a red bird.",
    "A happy child found this key.",
    "My old horse likes the river.",
]
PAIRS = {"en-de": ("en", "de"), "de-en": ("de", "en"), "en-fr": ("en", "fr")}
GREEDY = SearchConfig(beam_size=1)


@pytest.fixture(scope="module")
def model_dirs(served_model, tmp_path_factory):
    """Three model directories of one trained model, each saying it translates another pair: en->de,
    de->en, en->fr (de->fr then goes through English)."""
    root = tmp_path_factory.mktemp("pairs")
    dirs = {}
    for name, (source, target) in PAIRS.items():
        directory = root / name
        shutil.copytree(
            served_model, directory, ignore=shutil.ignore_patterns("checkpoints", "data", "*.log")
        )
        save_languages(Languages((source,), (target,)), directory / "languages.json")
        dirs[name] = directory
    return dirs


@pytest.fixture(scope="module")
def translators(model_dirs):
    return {name: Translator.load(d, GREEDY, dtype="fp32", device="cpu") for name, d in model_dirs.items()}


def app_of(dirs, api_key=None, **limits):
    options = InferenceOptions(device="cpu", dtype="fp32", compile=False)
    config = ServeConfig(beam_size=1, **limits)
    return create_app(read_models(list(dirs), config, options), config, options=options, api_key=api_key)


@pytest.fixture(scope="module")
def client(model_dirs):
    with TestClient(app_of(model_dirs.values())) as c:
        yield c


@pytest.fixture(scope="module")
def live(model_dirs):
    """`aiayn serve` of the three directories, for the clients that open their own connections."""
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", *map(str, model_dirs.values()), "--port", str(port),
               "--dtype", "fp32", "--no-compile", "--threads", "1", "--beam-size", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url)
    yield url
    proc.terminate()
    proc.wait(30)


def wait_until_up(proc, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)


def libre_error(response, status: int) -> str:
    """LibreTranslate's error shape: {"error": message}, with its status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and "Traceback" not in response.text
    return body["error"]


# --- LibreTranslate's own clients ----------------------------------------------------------------------


def test_libretranslatepy_translates_detects_and_lists_languages(live, translators):
    api = libretranslatepy.LibreTranslateAPI(live)
    for text, expected in zip(SENTENCES, translators["en-de"].translate(SENTENCES)):
        assert api.translate(text, "en", "de") == expected
    assert api.translate(SENTENCES[0], "auto", "fr") == translators["en-fr"].translate(SENTENCES[:1])[0]
    languages = {entry["code"]: entry for entry in api.languages()}
    assert set(languages) == {"de", "en", "fr"}
    assert languages["de"]["name"] == "German" and languages["en"]["targets"] == ["de", "fr"]
    assert languages["de"]["targets"] == ["en", "fr"]  # fr through English
    settings = json.load(urllib.request.urlopen(f"{live}/frontend/settings"))
    assert settings["charLimit"] == 5000 and settings["keyRequired"] is False
    assert settings["language"]["target"] == {"code": "en", "name": "English"}
    detected = api.detect("The small dogs see a red bird near the river.")
    assert detected[0]["language"] == "en" and 0 < detected[0]["confidence"] <= 100


def test_deep_translator_translates_a_text_and_a_list(live, translators):
    translator = deep_translator.LibreTranslator(
        source="en", target="de", api_key="any", custom_url=f"{live}/"
    )
    assert translator.translate(SENTENCES[0]) == translators["en-de"].translate(SENTENCES[:1])[0]
    assert translator.translate_batch(SENTENCES) == translators["en-de"].translate(SENTENCES)


def test_deep_translator_is_refused_a_wrong_key(model_dirs, translators):
    """With --api-key the key is LibreTranslate's api_key parameter: a wrong one is 403, which
    deep-translator raises as its AuthorizationException."""
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", str(model_dirs["en-de"]), "--port", str(port),
               "--dtype", "fp32", "--no-compile", "--threads", "1", "--beam-size", "1", "--api-key", "s3cret"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(proc, url)
        good = deep_translator.LibreTranslator(
            source="en", target="de", api_key="s3cret", custom_url=f"{url}/"
        )
        assert good.translate(SENTENCES[0]) == translators["en-de"].translate(SENTENCES[:1])[0]
        bad = deep_translator.LibreTranslator(source="en", target="de", api_key="wrong", custom_url=f"{url}/")
        with pytest.raises(deep_translator.exceptions.AuthorizationException):
            bad.translate(SENTENCES[0])
    finally:
        proc.terminate()
        proc.wait(30)


# --- The API's bodies ------------------------------------------------------------------------------------


def test_a_list_json_and_form_bodies_and_alternatives(client, translators):
    expected = translators["en-de"].translate(SENTENCES)
    body = client.post("/translate", json={"q": SENTENCES, "source": "en", "target": "de"}).json()
    assert body == {"translatedText": expected}
    form = client.post("/translate", data={"q": SENTENCES[1], "source": "en", "target": "de"})
    assert form.json() == {"translatedText": expected[1]}
    multipart = client.post("/translate", files={"q": (None, SENTENCES[2]), "source": (None, "en"),
                                                 "target": (None, "de")})  # fmt: skip
    assert multipart.json() == {"translatedText": expected[2]}
    query = client.post("/translate", params={"q": SENTENCES[0], "source": "en", "target": "de"})
    assert query.json() == {"translatedText": expected[0]}
    # alternatives: the 2nd and 3rd best of a beam of 3, without the first or repeats
    body = client.post(
        "/translate", json={"q": SENTENCES[0], "source": "en", "target": "de", "alternatives": 2}
    )
    n_best = translators["en-de"].translate_n_best(SENTENCES[:1], 3)[0]
    answer = body.json()
    assert answer["translatedText"] == n_best[0][0]
    assert answer["alternatives"] == [t for t, _ in n_best[1:] if t != n_best[0][0]]


def test_source_auto_detects_among_the_languages_served(client, translators):
    body = client.post("/translate", json={"q": SENTENCES[0], "source": "auto", "target": "de"}).json()
    assert body["translatedText"] == translators["en-de"].translate(SENTENCES[:1])[0]
    assert body["detectedLanguage"]["language"] == "en" and body["detectedLanguage"]["confidence"] > 0
    batch = client.post("/translate", json={"q": SENTENCES[:2], "source": "auto", "target": "de"}).json()
    assert [d["language"] for d in batch["detectedLanguage"]] == ["en", "en"]


def test_the_detector_is_built_at_start_once_for_every_language_served(model_dirs):
    """Before a first source=auto waits for it; one detector of all the languages, whatever the target."""
    from aiayn.serving import languages

    languages._detector.cache_clear()
    with TestClient(app_of(model_dirs.values())) as c:
        deadline = time.monotonic() + 30
        while languages._detector.cache_info().currsize == 0:
            assert time.monotonic() < deadline, "no detector was built at start"
            time.sleep(0.05)
        for target in ("de", "fr"):
            c.post("/translate", json={"q": SENTENCES[0], "source": "auto", "target": target})
        c.post("/detect", json={"q": SENTENCES[0]})
        assert languages._detector.cache_info().currsize == 1


def test_a_paragraph_is_translated_sentence_by_sentence_and_joined_in_order(client, translators):
    paragraph = f"{SENTENCES[0]}  {SENTENCES[1]}\n\n{SENTENCES[2]} "
    body = client.post("/translate", json={"q": paragraph, "source": "en", "target": "de"}).json()
    de = translators["en-de"].translate(SENTENCES)
    assert body["translatedText"] == f"{de[0]}  {de[1]}\n\n{de[2]} "
    assert int(client.post("/translate", json={"q": paragraph, "source": "en", "target": "de"})
               .headers["X-Batch-Size"]) == 3  # fmt: skip


def tree(markup: str) -> list:
    """An HTML document's tags, attributes and nesting, text left out."""

    def walk(node) -> list:
        return [
            (child.name, sorted(child.attrs.items()), walk(child)) for child in node.find_all(recursive=False)
        ]

    return walk(BeautifulSoup(markup, "html.parser"))


def test_a_sentence_without_a_letter_comes_back_as_it_is(client, translators):
    body = client.post(
        "/translate", json={"q": f"{SENTENCES[0]} 42. \U0001f642", "source": "en", "target": "de"}
    )
    assert body.json() == {
        "translatedText": f"{translators['en-de'].translate(SENTENCES[:1])[0]} 42. \U0001f642"
    }


def test_the_same_language_and_text_already_in_the_target_come_back_as_they_are(client):
    """LibreTranslate translates a language into itself as the identity: given (de to de) or detected
    (English text, source auto, target en), the text comes back unchanged, with what was detected."""
    text = "Ein Hund rennt. Zwei Männer lachen."
    assert client.post("/translate", json={"q": text, "source": "de", "target": "de"}).json() == {
        "translatedText": text
    }
    body = client.post("/translate", json={"q": SENTENCES[0], "source": "auto", "target": "en"}).json()
    assert body["translatedText"] == SENTENCES[0] and body["detectedLanguage"]["language"] == "en"
    listed = client.post(
        "/translate", json={"q": SENTENCES[:2], "source": "EN", "target": "en", "alternatives": 2}
    ).json()
    assert listed == {"translatedText": SENTENCES[:2], "alternatives": [[], []]}


def test_text_without_a_letter_is_english_with_confidence_zero(client, translators):
    """source=auto on emoji or numbers: 200 with the text and {"language": "en", "confidence": 0}, as
    LibreTranslate; /detect says the same."""
    body = client.post("/translate", json={"q": "1234 !! \U0001f642", "source": "auto", "target": "de"})
    assert body.json() == {
        "translatedText": "1234 !! \U0001f642",
        "detectedLanguage": {"confidence": 0.0, "language": "en"},
    }
    assert client.post("/detect", data={"q": "\U0001f642 42"}).json() == [
        {"confidence": 0.0, "language": "en"}
    ]


def test_language_codes_in_any_case_and_with_a_region_or_script(client, translators):
    expected = translators["en-de"].translate(SENTENCES[:1])[0]
    for source, target in (("EN", "de"), ("en-US", "DE"), ("en_GB", "de-AT")):
        body = client.post("/translate", json={"q": SENTENCES[0], "source": source, "target": target})
        assert body.json() == {"translatedText": expected}, (source, target)
    assert (
        libre_error(client.post("/translate", json={"q": "a", "source": "XX", "target": "de"}), 400)
        == "xx is not supported"
    )


def test_detect_names_three_languages_at_most_in_whole_percentages_and_takes_a_list(client):
    """/detect as LibreTranslate's: at most three, whole-number confidences, a list of texts merged into
    one ranking, and no character limit (the body's limit holds)."""
    found = client.post("/detect", json={"q": SENTENCES[0]}).json()
    assert 1 <= len(found) <= 3 and found[0]["language"] == "en"
    assert all(f["confidence"] == round(f["confidence"]) and 0 <= f["confidence"] <= 100 for f in found)
    merged = client.post("/detect", json={"q": [SENTENCES[0], "Ein Hund rennt über die Wiese."]}).json()
    assert {f["language"] for f in merged} >= {"en", "de"} and len(merged) <= 3
    long = " ".join([SENTENCES[1]] * 200)  # over --max-chars (5,000)
    assert client.post("/detect", json={"q": long}).json()[0]["language"] == "en"


def test_every_error_on_libretranslates_routes_is_its_shape(model_dirs):
    """{"error": "a string"}, which LibreTranslate's page shows, for the errors of the server's edge too:
    a key in a wrong Authorization header, a body over the limit, a route's wrong method, a form's
    /translate; aiayn's own requests keep aiayn's shape."""
    with TestClient(app_of(model_dirs.values(), api_key="k", max_body_bytes=2000)) as c:
        wrong = {"Authorization": "Bearer nope"}
        assert "API key" in libre_error(c.post("/detect", data={"q": "a"}, headers=wrong), 401)
        assert libre_error(c.post("/translate", data={"q": "x" * 3000, "source": "en", "target": "de",
                                                      "api_key": "k"}), 413)  # fmt: skip
        libre_error(c.get("/detect"), 405)
        libre_error(c.get("/translate?q=a&source=en&target=de", headers=wrong), 401)
        own = c.post("/translate", json={"text": "a"}, headers=wrong)
        assert own.status_code == 401 and own.json()["error"]["type"] == "unauthorized"
        assert c.get("/no-such-page").json()["error"]["type"] == "not_found"


def test_a_sentence_over_the_models_limit_is_translated_in_pieces(client, translators):
    """A sentence of 400 tokens (--max-tokens 256) is cut where clauses end, each piece translated, and
    the pieces' translations joined; LibreTranslate's clients are not refused it. aiayn's own API still
    says 413 for a line over the limit."""
    from aiayn.serving.documents import pieces

    translator = translators["en-de"]
    sentence = ", ".join(["the small dogs see a red bird"] * 57) + "."  # 400 tokens and more
    tokens = lambda text: len(translator.tokenizer.encode_src([text])[0]) - 1  # noqa: E731
    assert tokens(sentence) > 400
    cut = pieces(sentence, tokens, 256)
    assert len(cut) > 1 and all(tokens(p) <= 256 for p, _ in cut)
    expected = "".join(t + after for t, (_, after) in zip(translator.translate([p for p, _ in cut]), cut))
    body = client.post("/translate", json={"q": sentence, "source": "en", "target": "de"})
    assert body.json() == {"translatedText": expected}
    own = client.post("/translate", json={"text": sentence, "model": "en-de"})
    assert own.status_code == 413 and own.json()["error"]["type"] == "too_long"


def test_a_chinese_paragraph_is_split_into_its_sentences(model_dirs, translators, tmp_path):
    """A model of Chinese (the test's model under a Chinese label: what is checked is the splitting):
    a paragraph of 600 characters and more, its sentences ended by 。！？ with no space, is translated a
    sentence at a time and joined without spaces, as the paragraph was written."""
    directory = shutil.copytree(model_dirs["en-de"], tmp_path / "zh-de")
    save_languages(Languages(("zh",), ("de",)), directory / "languages.json")
    sentences = ["我喜欢这只小狗。", "你今天去公园了吗？", "他们在河边快乐地跑步！"] * 25
    paragraph = "".join(sentences)
    assert len(paragraph) >= 600
    translator = translators["en-de"]
    with TestClient(app_of([directory])) as c:
        answer = c.post("/translate", json={"q": paragraph, "source": "zh", "target": "de"})
        assert answer.json() == {"translatedText": "".join(translator.translate(sentences))}
        assert int(answer.headers["X-Batch-Size"]) > 1


def test_html_keeps_its_tree_and_translates_its_text(client, translators):
    page = (
        '<div class="doc"><p id="a">The small dogs see a <b>red <i>bird</i></b>.</p>'
        '<p>A happy child &amp; <a href="/x?y=1&amp;z=2">this key</a>.</p><script>var x = "a b";</script></div>'
    )
    body = client.post("/translate", json={"q": page, "source": "en", "target": "de", "format": "html"})
    assert body.status_code == 200, body.text
    out = body.json()["translatedText"]
    assert tree(out) == tree(page)
    soup = BeautifulSoup(out, "html.parser")
    assert soup.find("script").string == 'var x = "a b";'  # not text to translate
    assert soup.find("i").string.strip() == translators["en-de"].translate(["bird"])[0].strip()


def test_a_pair_without_a_model_goes_through_a_pivot(client, translators):
    body = client.post("/translate", json={"q": SENTENCES, "source": "de", "target": "fr"}).json()
    via = translators["en-fr"].translate(translators["de-en"].translate(SENTENCES))
    assert body == {"translatedText": via, "pivot": "en"}


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"source": "en", "target": "de"}, "missing q parameter"),
        ({"q": "a", "target": "de"}, "missing source parameter"),
        ({"q": "a", "source": "en", "target": "xx"}, "xx is not supported"),
        (
            {"q": "a", "source": "fr", "target": "de"},
            "German (de) is not available as a target language from French",
        ),
        ({"q": "a", "source": "en", "target": "de", "format": "pdf"}, "pdf format is not supported"),
        ({"q": 5, "source": "en", "target": "de"}, "q must be"),
        (
            {"q": "a", "source": "en", "target": "de", "alternatives": "two"},
            "alternatives parameter is not a number",
        ),
        ({"q": "<p><b>x</p></b>", "source": "en", "target": "de", "format": "html"}, "malformed HTML"),
        ({"q": "x" * 5001, "source": "en", "target": "de"}, "exceeds text limit (5000)"),
    ],
)
def test_bad_requests_are_libretranslates_400(client, body, needle):
    assert needle in libre_error(client.post("/translate", json=body), 400)
    assert (
        client.post("/translate", json={"q": "A red bird.", "source": "en", "target": "de"}).status_code
        == 200
    )


def test_a_clients_requests_a_minute_are_limited_as_libretranslates(model_dirs):
    """--req-limit 3: a list of two texts costs two, so the next two-text request is refused with 429 in
    LibreTranslate's words, and aiayn's own requests count against the same minute."""
    with TestClient(app_of(model_dirs.values(), req_limit=3)) as c:
        ok = c.post("/translate", json={"q": SENTENCES[:2], "source": "en", "target": "de"})
        assert ok.status_code == 200
        assert libre_error(
            c.post("/translate", json={"q": SENTENCES[:2], "source": "en", "target": "de"}), 429
        ) == ("Slowdown: 3 per 1 minute")
        assert c.post("/detect", data={"q": "A red bird."}).status_code == 200  # the third
        refused = c.post("/translate", json={"text": "A red bird.", "model": "en-de"})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limited"
        assert refused.headers["Retry-After"] == "60"


def test_own_requests_name_their_model_or_languages(client, translators):
    body = client.post("/translate", json={"text": SENTENCES, "source": "en", "target": "fr"}).json()
    assert body == {"translations": translators["en-fr"].translate(SENTENCES)}
    assert client.post("/translate", json={"text": SENTENCES, "model": "de-en"}).json() == {
        "translations": translators["de-en"].translate(SENTENCES)
    }
    assert client.post("/translate", json={"text": "a"}).status_code == 422  # which of three?
    info = client.get("/info").json()
    assert [(m["name"], m["languages"]) for m in info["models"]] == [
        (name, {"source": [s], "target": [t]}) for name, (s, t) in PAIRS.items()
    ]
    assert (
        client.post("/attention", json={"text": SENTENCES[0], "source": "de", "target": "en"}).status_code
        == 200
    )


def test_a_model_that_fails_to_load_is_refused_and_the_others_serve(model_dirs, tmp_path):
    broken = tmp_path / "en-it"
    shutil.copytree(model_dirs["en-de"], broken)
    save_languages(Languages(("en",), ("it",)), broken / "languages.json")
    (broken / "model.safetensors").write_bytes(b"not weights")
    with TestClient(app_of([broken, model_dirs["en-de"]])) as c:
        error = libre_error(
            c.post("/translate", json={"q": "A red bird.", "source": "en", "target": "it"}), 503
        )
        assert "en-it" in error and "model.safetensors" in error
        assert (
            c.post("/translate", json={"q": "A red bird.", "source": "en", "target": "de"}).status_code == 200
        )
        assert [m["state"] for m in c.get("/info").json()["models"]] == ["failed", "loaded"]


def test_a_model_that_waits_for_room_past_the_timeout_gets_a_503_to_retry(model_dirs):
    """A cap of one model: the next model's first request waits for the one in memory to become idle, and
    past --timeout-s is a 503 with Retry-After; once it is idle, it is unloaded and the next one loads."""
    size = (model_dirs["en-de"] / "model.safetensors").stat().st_size
    assert 3 * size > 1 << 20 >= 2 * size  # one fits (twice its weights while it loads), two do not
    with TestClient(app_of(model_dirs.values(), max_memory_mb=1, timeout_s=1.0)) as c:
        assert (
            c.post("/translate", json={"q": "A red bird.", "source": "en", "target": "de"}).status_code == 200
        )
        held = c.app.state.service.models.by_name["en-de"]
        held.busy += 1  # as a request in flight holds it
        refused = c.post("/translate", json={"q": "A red bird.", "source": "en", "target": "fr"})
        assert libre_error(refused, 503).startswith("model en-fr waits for memory")
        assert refused.headers["Retry-After"] == "1"
        held.busy -= 1
        assert (
            c.post("/translate", json={"q": "A red bird.", "source": "en", "target": "fr"}).status_code == 200
        )
        states = {m["name"]: m["state"] for m in c.get("/info").json()["models"]}
        assert states == {"en-de": "unloaded", "de-en": "unloaded", "en-fr": "loaded"}


# --- Worker fairness ---------------------------------------------------------------------------------


def test_models_take_turns_in_the_worker(client, model_dirs):
    """Two models' requests queued behind a busy worker: their batches alternate (each model's lines in
    one batch), rather than one model's requests all going first."""
    from aiayn.serving.worker import Call, Line, Pending, Worker

    order = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def translate_ids(self, ids, search):
            order.append(self.name)
            return [[] for _ in ids]

    metrics = client.app.state.service.metrics
    worker = Worker(ServeConfig(batch_sentences=1, batch_wait_ms=0), metrics, None)

    class Nobody(Pending):  # a request whose answer nobody awaits
        def __init__(self):
            self.lines, self.deadline, self.gone, self.results, self.batch_size = (
                1,
                time.monotonic() + 60,
                False,
                {},
                0,
            )

        def settle(self, outcome):
            pass

    a, b = Fake("a"), Fake("b")
    jobs = [Line([5, 2], GREEDY, Nobody(), 0, time.monotonic(), m) for m in (a, a, a, b, b, b)]
    worker.submit(jobs)
    worker.submit([Call(lambda: None, Nobody())])
    worker.start()
    worker.stop(10)
    assert order == ["a", "b", "a", "b", "a", "b"]


# --- Many models, little memory -------------------------------------------------------------------------

SIZE = 4  # models of about 38 MiB each (d_model 256, 4+4 layers, 8,000 tokens a side): above the noise


@pytest.fixture(scope="module")
def big_models(served_model, tmp_path_factory):
    """Four untrained models of about 38 MiB, each of its own pair, sharing the served model's tokenizer
    (random weights: their outputs run to the length limit, which short inputs keep short)."""
    root = tmp_path_factory.mktemp("big")
    tokenizer = ModelDir.read(served_model).tokenizer
    config = preset("small", vocab_size=tokenizer.src_vocab_size, n_encoder_layers=4, n_decoder_layers=4)
    dirs = []
    for k, target in enumerate(("de", "fr", "es", "it")):
        torch.manual_seed(k)
        model = Transformer(config)
        directory = root / f"en-{target}"
        save_model(directory, model, tokenizer, SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=4),
                   Languages(("en",), (target,)))  # fmt: skip
        dirs.append(directory)
    return dirs


def resident(pid: int, field: str = "VmHWM") -> int:
    """A process's peak (VmHWM) or current (VmRSS) resident memory, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(field)


OVERHEAD = 40 << 20  # beyond the cap: a batch's activations, allocator slack; measured under 20 MiB


def test_a_server_capped_below_its_models_evicts_and_stays_within_the_cap(big_models):
    sizes = [(d / "model.safetensors").stat().st_size for d in big_models]
    cap_mb = (3 * max(sizes) + (1 << 20)) >> 20  # one loads beside one loaded (twice its size a moment)
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", *map(str, big_models), "--port", str(port), "--dtype",
               "fp32", "--no-compile", "--threads", "1", "--beam-size", "1", "--max-memory-mb", str(cap_mb)]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(proc, url)
        api = libretranslatepy.LibreTranslateAPI(url)
        api.translate("A red bird.", "en", "de")  # the process's first translation: what every one needs
        base = resident(proc.pid, "VmRSS") - sizes[0]
        for _ in range(3):  # a round robin: every request loads its model, unloading another
            for target in ("de", "fr", "es", "it"):
                assert isinstance(api.translate("A red bird.", "en", target), str)
        peak = resident(proc.pid)
        info = json.load(urllib.request.urlopen(f"{url}/info"))
        assert sum(m["state"] == "loaded" for m in info["models"]) <= 2
        metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
        assert 'aiayn_model_evictions_total{model="en-de"}' in metrics
        print(
            f"peak {peak >> 20} MiB = base {base >> 20} + cap {cap_mb} + {(peak - base - (cap_mb << 20)) >> 20}"
        )
        assert peak <= base + (cap_mb << 20) + OVERHEAD, (peak >> 20, base >> 20, cap_mb)
        assert peak < base + sum(sizes)  # (what four models would hold)
    finally:
        proc.terminate()
        proc.wait(30)


# --- An imported multilingual OPUS-MT model ---------------------------------------------------------------


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="needs ../shared/data/multi30k (an OPUS-MT-shaped model)")
def test_an_imported_multilingual_model_serves_each_target_by_its_tag(tmp_path, model_dirs):
    pytest.importorskip("transformers")
    source = opus_mt_directory(tmp_path / "opus-mt-en-ROMANCE", shared=True, activation="swish",
                               dtype=torch.float32)  # fmt: skip
    code, _, err = run_cli(["import", source, "--out", tmp_path / "en-mul"])
    assert code == 0, err
    imported = ModelDir.read(tmp_path / "en-mul")
    assert imported.languages is not None and set(imported.languages.target) == {"de", "fr"}
    texts = multi30k_lines("val.en.gz", 2)
    translator = Translator.load(imported, GREEDY, dtype="fp32", device="cpu")
    with TestClient(app_of([tmp_path / "en-mul"])) as c:  # by name, a tag it has or one it has not
        named = c.post("/translate", json={"text": texts, "model": "en-mul", "target": "fr"}).json()
        assert named == {"translations": translator.translate([f">>fr<< {t}" for t in texts])}
        wrong = c.post("/translate", json={"text": texts, "model": "en-mul", "target": "it"})
        assert wrong.status_code == 422 and "does not write it" in wrong.json()["error"]["message"]
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", str(tmp_path / "en-mul"), str(model_dirs["de-en"]),
               "--port", str(port), "--dtype", "fp32", "--no-compile", "--threads", "1", "--beam-size", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(proc, url)
        api = libretranslatepy.LibreTranslateAPI(url)
        for target in ("de", "fr"):
            tag = imported.languages.tags[target]
            expected = translator.translate([f"{tag} {t}" for t in texts])
            assert [api.translate(t, "en", target) for t in texts] == expected
        languages = {entry["code"]: entry["targets"] for entry in api.languages()}
        assert languages["en"] == ["de", "fr"] and languages["de"] == ["en", "fr"]  # de->fr through English
    finally:
        proc.terminate()
        proc.wait(30)
