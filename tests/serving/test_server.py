"""The HTTP API of `aiayn serve` with an in-process client and a tiny trained model: every endpoint,
every limit and error type, translations equal Translator.translate, attention invariants, batching
across requests, a client that goes away, and a shutdown with requests pending."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile

import httpx
import pytest
import torch
import uvicorn
from conftest import assert_one_line_error, free_port, run_cli
from fastapi.testclient import TestClient

import aiayn
from aiayn.config import SearchConfig, ServeConfig
from aiayn.inference.translate import Translator
from aiayn.model import attention_maps
from aiayn.serving.app import STATIC, create_app
from aiayn.serving.server import listen
from aiayn.serving.worker import Call
from aiayn.tokenizer import BOS_ID, EOS_ID

INPUTS = ["The small dogs see a red bird.", "A happy child found this key.", "My old horse likes the river."]


@pytest.fixture(scope="module")
def model_dir(served_model):
    return served_model


@pytest.fixture(scope="module")
def translator(model_dir):
    return Translator.load(model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu")


def client_for(translator, **limits) -> TestClient:
    options = {k: limits.pop(k) for k in ("api_key", "cors_origins", "compile_workers") if k in limits}
    return TestClient(create_app(translator, ServeConfig(**limits), **options))


@pytest.fixture(scope="module")
def client(translator):
    with client_for(translator) as c:
        yield c


def error_of(response, status: int, kind: str) -> str:
    """The one error shape: {"error": {"type", "message"}} with the status, never a traceback."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["type"] == kind, body
    assert "Traceback" not in response.text
    return body["error"]["message"]


# --- /translate ----------------------------------------------------------------------------------------


def test_translations_equal_the_translators(client, translator):
    response = client.post("/translate", json={"text": INPUTS})
    assert response.status_code == 200 and response.json() == {"translations": translator.translate(INPUTS)}
    assert int(response.headers["X-Batch-Size"]) >= 1
    assert client.post("/translate", json={"text": INPUTS[0]}).json()["translations"] == translator.translate(
        INPUTS[:1]
    )
    greedy = client.post("/translate", json={"text": INPUTS, "beam_size": 1}).json()["translations"]
    assert greedy == translator.translate(INPUTS, beam_size=1)
    # A text of several lines: each line translated, the lines kept.
    two = client.post("/translate", json={"text": f"{INPUTS[0]}\n{INPUTS[1]}"}).json()["translations"]
    assert two == ["\n".join(translator.translate(INPUTS[:2]))]
    assert client.post("/translate", json={"text": []}).json() == {"translations": []}


def test_n_best_lists(client, translator):
    body = client.post("/translate", json={"text": INPUTS[:2], "n_best": 3}).json()
    want = translator.translate_n_best(INPUTS[:2], 3)
    assert body["translations"] == [group[0][0] for group in want]
    for got, expected in zip(body["n_best"], want):
        assert [a["text"] for a in got] == [text for text, _ in expected]
        assert [a["score"] for a in got] == pytest.approx([score for _, score in expected])
        assert [a["score"] for a in got] == sorted((a["score"] for a in got), reverse=True)


@pytest.mark.parametrize(
    "body,status,kind",
    [
        ({"text": "a", "foo": 1}, 422, "invalid_request"),  # unknown fields refused
        ({"text": 3}, 422, "invalid_request"),
        ({}, 422, "invalid_request"),
        ({"text": "a", "beam_size": 0}, 422, "invalid_request"),
        ({"text": "a", "beam_size": 99}, 422, "invalid_request"),
        ({"text": "a", "n_best": 9}, 422, "invalid_request"),
        ({"text": ["a"] * 65}, 413, "too_many_texts"),
        ({"text": "x" * 5001}, 413, "too_long"),
        ({"text": "dog " * 300}, 413, "too_long"),  # characters within the limit, tokens not
    ],
)
def test_bad_requests_are_4xx_with_one_error_shape(client, body, status, kind):
    message = error_of(client.post("/translate", json=body), status, kind)
    assert message


def test_malformed_and_oversized_bodies(client, translator):
    error_of(
        client.post("/translate", content=b"{not json", headers={"Content-Type": "application/json"}),
        422,
        "invalid_request",
    )
    with client_for(translator, max_body_bytes=100) as small:
        error_of(small.post("/translate", json={"text": "x" * 200}), 413, "too_large")
    error_of(client.get("/nowhere"), 404, "not_found")
    error_of(client.get("/translate"), 405, "method_not_allowed")


def test_a_full_queue_is_503_with_retry_after_at_once(translator):
    with client_for(translator, max_queue=2) as c:
        response = c.post("/translate", json={"text": INPUTS})  # 3 lines, room for 2
        error_of(response, 503, "overloaded")
        assert response.headers["Retry-After"] == "1"
        assert c.post("/translate", json={"text": INPUTS[:2]}).status_code == 200  # and nothing was queued


def block_worker(app, seconds: float) -> threading.Event:
    """Make the model worker busy for a while (a call of our own in its queue); set the event to free it."""
    release = threading.Event()

    class Fake:  # a Pending whose answer nobody awaits
        gone = False

        def settle(self, outcome):
            pass

    app.state.service.worker.submit([Call(lambda: release.wait(seconds), Fake())])
    return release


def test_a_request_past_its_deadline_is_dropped_with_503(translator):
    with client_for(translator, timeout_s=0.3) as c:
        release = block_worker(c.app, 5)
        started = time.monotonic()
        response = c.post("/translate", json={"text": INPUTS[0]})
        error_of(response, 503, "timeout")
        assert time.monotonic() - started < 3
        release.set()
        assert c.post("/translate", json={"text": INPUTS[0]}).status_code == 200  # the server goes on


# --- /attention --------------------------------------------------------------------------------------


def test_attention_rows_sum_to_one_with_the_shapes_of_the_tokens(client, translator):
    body = client.post("/attention", json={"text": INPUTS[1]}).json()
    src_ids = translator.tokenizer.encode_src([INPUTS[1]])[0]
    tokens = translator.translate_ids([src_ids], SearchConfig(beam_size=1))[0][0].tokens
    S, T = len(src_ids), len(tokens) + 1  # the decoder reads BOS and the output
    assert len(body["source_tokens"]) == S and len(body["target_tokens"]) == T
    assert body["translation"] == translator.translate(INPUTS[1:2], beam_size=1)[0]
    config = translator.model.config
    for kind, rows, cols, layers in (("encoder", S, S, config.n_encoder_layers), ("decoder", T, T, config.n_decoder_layers),
                                      ("cross", T, S, config.n_decoder_layers)):  # fmt: skip
        weights = torch.tensor(body[kind])
        assert weights.shape == (layers, config.n_heads, rows, cols)
        torch.testing.assert_close(
            weights.sum(-1), torch.ones(layers, config.n_heads, rows), atol=1e-5, rtol=0
        )
        if kind == "decoder":  # a position never attends to a later one
            assert weights.triu(1).abs().max() == 0
    maps = attention_maps(translator.model, torch.tensor([src_ids]), torch.tensor([[BOS_ID, *tokens]]))
    torch.testing.assert_close(torch.tensor(body["cross"]), torch.stack([m[0] for m in maps["cross"]]))


@pytest.mark.parametrize("text", ["", "   ", "two\nlines", "x" * 5001])
def test_attention_takes_one_sentence(client, text):
    response = client.post("/attention", json={"text": text})
    assert response.status_code in (400, 413) and response.json()["error"]["type"] in (
        "invalid_request",
        "too_long",
    )


# --- /health, /info, /metrics, the page, keys ------------------------------------------------------------


def test_health_info_metrics_and_the_page(client, model_dir):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["model"]["d_model"] == 64 and info["dtype"] == "fp32" and info["device"] == "cpu"
    assert info["limits"]["max_queue"] == 1024 and info["engine"] == "torch"
    # the package's own version, not the installer's record: a source checkout never installed has none
    assert info["version"] == aiayn.__version__
    assert str(model_dir) not in json.dumps(info) and "/" not in json.dumps(info["model"])  # no file paths
    client.post("/translate", json={"text": "a", "foo": 1})
    assert client.post("/translate", json={"text": "a"}).status_code == 200
    metrics = client.get("/metrics").text
    assert re.search(r'aiayn_requests_total\{code="200",endpoint="/translate"\} \d', metrics)
    assert re.search(r'aiayn_failures_total\{reason="invalid_request"\} \d', metrics)
    assert "aiayn_batch_lines_bucket" in metrics and "aiayn_queue_seconds_bucket" in metrics
    assert "testclient" not in metrics and "127.0.0.1" not in metrics  # no client addresses
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert page.headers["Content-Security-Policy"] == "default-src 'self'; frame-ancestors 'none'"
    assert page.headers["X-Frame-Options"] == "DENY" and page.headers["X-Content-Type-Options"] == "nosniff"
    assert client.get("/static/app.js").status_code == 200


def test_the_page_needs_nothing_from_outside_and_runs_no_inline_script():
    for path in STATIC.iterdir():
        text = path.read_text()
        urls = [u for u in re.findall(r"https?://[^\s\"')]+", text) if u != "http://www.w3.org/2000/svg"]
        assert not urls, (path.name, urls)
        if path.suffix == ".html":  # scripts only from files, no handler attributes (CSP would block them)
            assert "<script>" not in text and not re.search(r"\son[a-z]+\s*=", text)
        if path.suffix == ".js":
            assert "innerHTML" not in text and "eval(" not in text  # text goes in with textContent


def test_an_api_key_guards_the_api_but_not_the_page_or_health(translator):
    with client_for(translator, api_key="s3cret") as c:
        for path in ("/info", "/metrics"):
            error_of(c.get(path), 401, "unauthorized")
            error_of(c.get(path, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        response = c.post("/translate", json={"text": "a"})
        error_of(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200


def test_cors_allows_every_origin_unless_narrowed(translator):
    """As LibreTranslate: every origin on every route, a preflight answered, the errors too (a page
    elsewhere reads them); --cors-origin narrows it to the origins named."""
    origin = {"Origin": "http://elsewhere.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}  # fmt: skip
    with client_for(translator) as c:
        assert c.get("/health", headers=origin).headers["access-control-allow-origin"] == "*"
        answer = c.options("/translate", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        assert "POST" in answer.headers["access-control-allow-methods"]
        refused = c.post("/translate", json={"nope": 1}, headers=origin)
        assert refused.status_code == 422 and refused.headers["access-control-allow-origin"] == "*"
    with client_for(translator, cors_origins=("http://elsewhere.example",)) as c:
        assert (
            c.get("/health", headers=origin).headers["access-control-allow-origin"]
            == "http://elsewhere.example"
        )
        other = {"Origin": "http://other.example"}
        assert "access-control-allow-origin" not in c.get("/health", headers=other).headers


# --- Batching across requests ----------------------------------------------------------------------------


def concurrent(c, bodies: list[dict]) -> list:
    out = [None] * len(bodies)

    def send(i: int) -> None:
        out[i] = c.post("/translate", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_lines_of_concurrent_requests_share_a_batch_and_the_header_says_so(translator):
    with client_for(translator, batch_wait_ms=300) as c:
        release = block_worker(c.app, 5)  # the requests queue up behind it, then go as one batch
        threading.Timer(0.5, release.set).start()
        responses = concurrent(c, [{"text": [text]} for text in INPUTS])
        assert [r.json()["translations"] for r in responses] == [translator.translate([t]) for t in INPUTS]
        assert max(int(r.headers["X-Batch-Size"]) for r in responses) == 3
    with client_for(translator, batch_wait_ms=300, max_batch_requests=1) as c:  # no batching across requests
        release = block_worker(c.app, 5)
        threading.Timer(0.5, release.set).start()
        responses = concurrent(c, [{"text": [text]} for text in INPUTS])
        assert [int(r.headers["X-Batch-Size"]) for r in responses] == [1, 1, 1]


def test_a_compiled_server_answers_at_once_and_moves_to_its_graphs_as_they_come(
    model_dir, translator, monkeypatch
):
    """`aiayn serve` (compiled decoding, the default): /health says ok and translations come at once, decoded
    eagerly, while worker processes compile the graphs in the background (here those of one sentence of
    beam 4, batch_sentences=1: every graph costs the suite seconds); /info and /metrics say how far they
    are; once they are in, the same requests decode through the graphs, never eagerly again, with the same
    translations. Each graph is compiled once, by one of the two workers."""
    compiled = Translator.load(model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu", compile=True)
    with client_for(compiled, batch_sentences=1, timeout_s=300) as c:
        assert c.get("/health").json() == {"status": "ok"}  # at once: nothing can be compiled yet
        progress = c.get("/info").json()["compiled"]
        assert progress["state"] == "compiling" and progress["ready"] == [], progress
        responses = concurrent(c, [{"text": [text]} for text in INPUTS])
        assert [r.json()["translations"] for r in responses] == [translator.translate([t]) for t in INPUTS]
        deadline = time.monotonic() + 300
        while (progress := c.get("/info").json()["compiled"])["state"] == "compiling":
            assert time.monotonic() < deadline, "the graphs took over 5 minutes"
            time.sleep(0.2)
        assert progress["state"] == "done" and progress["ready"] == ["one"], progress
        # the memory and step of one sentence, and beam search's own work
        assert progress["graphs_done"] == progress["graphs_total"] == 3
        assert all(graph["seconds"] > 0 for graph in progress["graphs"])
        metrics = c.get("/metrics").text
        assert 'aiayn_compile_graphs{model="model",state="done"} 3.0' in metrics
        assert 'aiayn_compiled_batches{batches="one",model="model"} 1.0' in metrics
        monkeypatch.setattr(compiled, "eager", None)  # a batch falling back to eager now stops the worker
        responses = concurrent(c, [{"text": [text]} for text in INPUTS])
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert [r.json()["translations"] for r in responses] == [translator.translate([t]) for t in INPUTS]
    decoder = compiled.compiled
    assert decoder.compile_seconds == 0.0 and len(decoder._packages) == 3  # adopted, none compiled here
    assert sorted(graph["worker"] for graph in progress["graphs"]) in ([0, 0, 1], [0, 1, 1])


def test_a_sentences_answer_does_not_depend_on_what_shares_its_batch_in_the_default_format(
    model_dir, translator
):
    """A server in the number format a user gets with no flags (fp32 on every CPU class): each sentence is
    translated the same alone and among other lines in one batch, while the batches decode eagerly and
    once they decode through the compiled graphs of one sentence and of a few, the same as `aiayn
    translate` (fp32, eager) translates it alone."""
    compiled = Translator.load(model_dir, SearchConfig(beam_size=4), device="cpu", compile=True)
    lines = [*INPUTS, "The red bird sees my happy child.", "A key likes the old river."]
    alone = [translator.translate([line]) for line in lines]

    def answers(c) -> None:
        for i, line in enumerate(lines):
            batch = [line, *lines[:i], *lines[i + 1 :]][:4]
            response = c.post("/translate", json={"text": batch})
            assert response.headers["X-Batch-Size"] == str(len(batch))
            assert response.json()["translations"][:1] == alone[i], line
            assert c.post("/translate", json={"text": [line]}).json()["translations"] == alone[i], line

    with client_for(compiled, batch_sentences=4, timeout_s=300) as c:
        answers(c)  # (eagerly: no graph is in yet)
        deadline = time.monotonic() + 300
        while (progress := c.get("/info").json()["compiled"])["state"] == "compiling":
            assert time.monotonic() < deadline, "the graphs took over 5 minutes"
            time.sleep(0.2)
        assert progress["state"] == "done" and set(progress["ready"]) == {"one", "few"}, progress
        answers(c)
    assert len(compiled.compiled._packages) == progress["graphs_total"]  # the graphs did translate


def test_a_server_can_hold_readiness_until_its_graphs_are_in(model_dir, translator):
    """--ready-when-compiled (for a deployment behind a readiness probe): /health answers 503 "starting"
    until the graphs are in, while /translate answers anyway. (The graphs are those the test above made:
    the store is the test run's, so the worker loads them; one worker, a process start fewer.)"""
    compiled = Translator.load(model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu", compile=True)
    for plan in compiled.compiled.store.glob("plan-*.json"):  # (else it loads them itself, at once: below)
        plan.unlink()
    with client_for(
        compiled, batch_sentences=1, timeout_s=300, ready_when_compiled=True, compile_workers=1
    ) as c:
        first = c.get("/health")
        assert error_of(first, 503, "starting") and first.headers["Retry-After"]
        response = c.post("/translate", json={"text": INPUTS[:1]})
        assert response.json()["translations"] == translator.translate(INPUTS[:1])
        deadline = time.monotonic() + 300
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the graphs took over 5 minutes"
            time.sleep(0.2)
        assert c.get("/info").json()["compiled"]["state"] == "done"


def test_a_later_start_loads_the_graphs_an_earlier_one_stored_without_a_worker(
    model_dir, translator, monkeypatch
):
    """A start on a store that holds an earlier start's plan (the warm-up's graphs, which the workers
    wrote beside them) and every graph of it: no worker process starts; this process adopts the
    packages, the class opens, and the translations are eager's."""
    from aiayn.inference import warmup

    compiled = Translator.load(model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu", compile=True)
    if not list(compiled.compiled.store.glob("plan-*.json")):  # the tests above, one by one
        with client_for(compiled, batch_sentences=1, timeout_s=300, compile_workers=1) as c:
            while c.get("/info").json()["compiled"]["state"] == "compiling":
                time.sleep(0.2)
        compiled = Translator.load(
            model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu", compile=True
        )

    def no_worker(*args, **kwargs):
        raise AssertionError(f"a worker process was started: {args}")

    monkeypatch.setattr(warmup.subprocess, "Popen", no_worker)
    with client_for(compiled, batch_sentences=1, timeout_s=300) as c:
        deadline = time.monotonic() + 60
        while (progress := c.get("/info").json()["compiled"])["state"] == "compiling":
            assert time.monotonic() < deadline, progress
            time.sleep(0.05)
        assert progress["state"] == "done" and progress["ready"] == ["one"], progress
        assert progress["graphs_done"] == progress["graphs_total"] == 3
        monkeypatch.setattr(compiled, "eager", None)  # a batch falling back to eager now stops the worker
        responses = concurrent(c, [{"text": [text]} for text in INPUTS])
        assert [r.json()["translations"] for r in responses] == [translator.translate([t]) for t in INPUTS]
    assert compiled.compiled.compile_seconds == 0.0 and len(compiled.compiled._packages) == 3


def test_a_worker_that_fails_is_said_and_the_server_goes_on_eagerly(model_dir):
    """A compile worker that ends in an error (here: its model, loaded from the directory, is not the
    server's, whose weights changed after loading) turns the compile's state to "failed" with the worker's
    own last line in /info, and the server goes on answering, eagerly, with its model's translations."""
    compiled = Translator.load(model_dir, SearchConfig(beam_size=4), dtype="fp32", device="cpu", compile=True)
    with torch.no_grad():
        compiled.model.tgt_embed.tokens.weight[EOS_ID] *= 2
    eager = Translator(compiled.model, compiled.tokenizer, SearchConfig(beam_size=4), "fp32")
    with client_for(compiled, batch_sentences=1, timeout_s=300, compile_workers=1) as c:
        deadline = time.monotonic() + 120
        while (progress := c.get("/info").json()["compiled"])["state"] == "compiling":
            assert time.monotonic() < deadline, progress
            time.sleep(0.2)
        assert progress["state"] == "failed" and progress["ready"] == [], progress
        assert "worker" in progress["error"] and "another fingerprint" in progress["error"], progress
        response = c.post("/translate", json={"text": INPUTS})
        assert response.json()["translations"] == eager.translate(INPUTS)
        assert c.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("flags", "compile"),
    [([], True), (["--no-compile"], False), (["--engine", "ctranslate2"], False), (["--compile"], True)],
)
def test_serve_compiles_in_the_background_unless_told_not_to_or_ctranslate2_translates(
    model_dir, monkeypatch, flags, compile
):
    """`aiayn serve` compiles (or loads from the store) by default, in the background as above; --no-compile
    decodes eagerly only; CTranslate2's engine has no compiled path, so by default it gets none (the
    Translator it keeps for attention stays eager)."""
    given = []
    monkeypatch.setattr(
        "aiayn.serving.server.serve", lambda model, config, options, **kw: given.append(options)
    )
    code, _, stderr = run_cli(["serve", model_dir, *flags])
    assert code == 0 and "Traceback" not in stderr, stderr
    [options] = given
    assert options.compile is compile and options.engine == (
        "ctranslate2" if "--engine" in flags else "torch"
    )


def test_a_server_that_would_compile_into_a_store_it_cannot_write_says_so_before_serving(
    model_dir, tmp_path, monkeypatch
):
    """A store that cannot be written (here under a file; a read-only home directory, say), and none of the
    model's graphs in it: one line before the server starts, not a worker that stops once the port is open."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("AIAYN_COMPILE_STORE", str(blocker / "store"))
    code, _, stderr = run_cli(["serve", model_dir, "--port", free_port()])
    assert_one_line_error(code, stderr, str(blocker / "store"), "--no-compile", "AIAYN_COMPILE_STORE")


# --- A real server: a client that goes away, a shutdown with requests pending ---------------------------


@contextlib.contextmanager
def running(app):
    """app in a uvicorn server in a thread on a free loopback port: (port, server)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield port, server
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def live(translator):
    """A uvicorn server of the translator: (app, port, server)."""
    app = create_app(translator, ServeConfig(batch_wait_ms=1))
    with running(app) as (port, server):
        yield app, port, server


def post_urllib(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as answer:
        return answer.code, json.loads(answer.read())


def post_requests(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    requests = pytest.importorskip("requests")
    response = requests.post(url, data=body, headers=headers, timeout=60)
    return response.status_code, response.json()


def post_httpx(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    response = httpx.post(url, content=body, headers=headers, timeout=60)
    return response.status_code, response.json()


def post_httpx_chunked(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    """The body streamed without a declared length (Transfer-Encoding: chunked)."""
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    response = httpx.post(url, content=chunks, headers=headers, timeout=60)
    return response.status_code, response.json()


@pytest.mark.parametrize("post", [post_urllib, post_requests, post_httpx, post_httpx_chunked])
@pytest.mark.parametrize(
    ("path", "key", "size", "status", "kind"),
    [
        ("/translate", "KEY", 8 << 20, 413, "too_large"),  # too large: answered before a byte more is read
        ("/translate", "KEY", 3000, 413, "too_large"),
        ("/translate", "WRONG", 8 << 20, 401, "unauthorized"),  # refused before the body is read
        ("/health", "KEY", 8 << 20, 405, "method_not_allowed"),  # (nor are these read)
        ("/nowhere", "KEY", 8 << 20, 404, "not_found"),
    ],
)
def test_an_early_answer_reaches_a_client_still_sending_its_body(
    translator, post, path, key, size, status, kind
):
    """urllib and requests send the whole body without waiting for 100-continue (httpx too, with a
    declared length or streaming it): a server that answered and closed with the body unread reset the
    connection, and the client saw "connection reset by peer" instead of the answer. The server reads
    the rest of the body first (within bounds), so every client gets the JSON error."""
    app = create_app(translator, ServeConfig(max_body_bytes=2048), api_key="KEY")
    body = json.dumps({"text": "x" * size}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    with running(app) as (port, _):
        code, answer = post(f"http://127.0.0.1:{port}{path}", body, headers)
        assert (code, answer["error"]["type"]) == (status, kind)
        # the server goes on answering
        ok = urllib.request.Request(f"http://127.0.0.1:{port}/health")
        assert json.loads(urllib.request.urlopen(ok, timeout=60).read()) == {"status": "ok"}


def raw_post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return s


def test_a_client_that_goes_away_is_not_translated(live):
    app, port, _ = live
    worker = app.state.service.worker
    release = block_worker(app, 10)
    s = raw_post(port, {"text": INPUTS})
    time.sleep(0.3)  # queued behind the blocked worker
    s.close()  # the client goes
    time.sleep(0.3)  # the server notices (it polls every 50 ms)
    before = app.state.service.metrics.failures.labels("disconnected")._value.get()
    release.set()
    deadline = time.monotonic() + 10
    while app.state.service.metrics.failures.labels("disconnected")._value.get() < before + 3:
        assert time.monotonic() < deadline, "the lines of the client that went were not dropped"
        time.sleep(0.05)
    assert worker.alive and worker.waiting == 0


def test_a_shutdown_answers_the_requests_it_holds(live):
    app, port, server = live
    release = block_worker(app, 10)
    sockets = [raw_post(port, {"text": [text]}) for text in INPUTS]
    time.sleep(0.3)
    server.should_exit = True  # like SIGTERM: no new connections; those in flight are answered
    release.set()
    for s in sockets:
        s.settimeout(30)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            assert chunk, "the connection closed without an answer"
            reply += chunk
        assert reply.split(b" ")[1] in (b"200", b"503"), reply[:200]
        s.close()


# the bug kills the worker thread; its traceback goes to the server log, not to the client
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_bug_is_a_500_in_the_error_shape_and_a_dead_worker_a_503(translator, monkeypatch):
    with TestClient(create_app(translator), raise_server_exceptions=False) as c:
        monkeypatch.setattr(translator.tokenizer, "encode_src", lambda texts: 1 / 0)
        error_of(c.post("/translate", json={"text": "a"}), 500, "internal")
        monkeypatch.undo()
        worker = c.app.state.service.worker
        monkeypatch.setattr(worker, "translate_batch", lambda batch: 1 / 0)  # a bug inside the worker
        error_of(c.post("/translate", json={"text": "a"}), 503, "unavailable")  # answered, not left waiting
        assert not worker.alive
        error_of(c.get("/health"), 503, "unavailable")
        error_of(c.post("/translate", json={"text": "a"}), 503, "unavailable")


def test_the_ctranslate2_engine_translates_and_attention_stays_with_torch(model_dir, translator, tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.interop.ctranslate2 import CTranslate2Translator, export_ctranslate2

    export_ctranslate2(model_dir, tmp_path / "ct2")
    engine = CTranslate2Translator(tmp_path / "ct2", SearchConfig(beam_size=1), threads=1)
    with TestClient(
        create_app(translator, ServeConfig(beam_size=1), engine=engine, engine_name="ctranslate2")
    ) as c:
        assert c.get("/info").json()["engine"] == "ctranslate2"
        body = c.post("/translate", json={"text": INPUTS}).json()
        assert body["translations"] == translator.translate(INPUTS, beam_size=1)  # greedy: the same tokens
        assert c.post("/attention", json={"text": INPUTS[0]}).status_code == 200
        error_of(
            c.post("/translate", json={"text": INPUTS, "beam_size": 4}), 422, "invalid_request"
        )  # gnmt beams


def test_a_port_in_use_is_a_clear_error_before_the_model_loads(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "aiayn", "serve", str(model_dir), "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"aiayn: error: cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "Traceback" not in run.stderr


def test_connections_to_the_servers_socket_send_without_nagle_delay():
    """asyncio sets TCP_NODELAY on an accepted connection only when the listening socket names
    IPPROTO_TCP; without it a response waits about 40 ms for the client's delayed ACK."""

    async def accepted_socket() -> socket.socket:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket"))

        server = await loop.create_server(Accept, sock=listen("127.0.0.1", 0))
        async with server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
            sock = await asyncio.wait_for(accepted, 10)
            nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()
        return nodelay

    assert asyncio.run(accepted_socket())


def test_a_stop_during_the_background_compile_ends_server_and_workers_promptly(model_dir, tmp_path):
    """SIGTERM to `aiayn serve` while its workers compile: the server and the workers (and their compilers)
    end within seconds, and the store holds only whole packages, none half written. Ctrl-C is SIGINT to the
    terminal's process group, which the workers are outside of: the server ends them the same way."""
    store = tmp_path / "store"
    env = {**os.environ, "AIAYN_COMPILE_STORE": str(store)}
    command = [sys.executable, "-m", "aiayn", "serve", str(model_dir), "--port", str(free_port()),
               "--batch-sentences", "1", "--dtype", "fp32"]  # fmt: skip
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    console = []
    try:
        for line in server.stderr:  # the workers have made their plan: they are compiling
            console.append(line)
            if "graphs to compile" in line:
                break
        workers = [
            pid for pid, parent, cmdline in processes() if parent == server.pid and "warmup" in cmdline
        ]
        assert workers, console
        time.sleep(1.0)  # into the compile of a graph
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        ended = time.monotonic() - start
    finally:
        server.kill()
    console += server.stderr.readlines()
    assert ended < 10, (ended, console)
    assert not [pid for pid, _, _ in processes() if pid in workers], "a worker outlived the server"
    text = "".join(console)
    assert "Traceback" not in text and "AUTOTUNE" not in text, text
    for path in store.iterdir() if store.exists() else []:
        assert path.suffix == ".pt2", f"not a package: {path.name}"
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None


def processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of this machine's running processes (a zombie has ended: not one).
    Other tests run beside this one and start workers of their own: the parent tells whose a worker is."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state, parent = f.read().rsplit(b")", 1)[1].split()[:2]
                if state == b"Z":
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(
                        (int(entry), int(parent), f.read().replace(b"\0", b" ").decode(errors="replace"))
                    )
    return found
