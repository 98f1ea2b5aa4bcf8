"""The page of `aiayn serve` in a real browser: Debian's headless Chromium, driven by Selenium, against
the server started as a subprocess on a free loopback port. Translating by click and by Ctrl+Enter gives
Translator.translate's output; every kind, layer and head draws the cells /attention gives; the tooltip
names the tokens; the server's errors show; nothing is fetched from anywhere but 127.0.0.1; no console
errors. Without the browser the tests skip, except under CI=true, where they fail."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import free_port

from aiayn.config import SearchConfig
from aiayn.inference.translate import Translator

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true: the browser tests need Debian's chromium and chromium-driver", pytrace=False)
    pytest.skip(
        "no chromium/chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True
    )
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

TEXTS = [
    "That tall woman carried my old books behind the river yesterday.",
    "Some happy children found this green key.",
]


def start(models: list, *extra: str) -> tuple[subprocess.Popen, str]:
    """`aiayn serve MODELS` on a free loopback port, up and answering."""
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", *map(str, models), "--port", str(port), "--dtype", "fp32",
               "--no-compile"]  # the page is the point, not minutes of compiling before it is served  # fmt: skip
    proc = subprocess.Popen([*command, "--threads", "1", *extra], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(served_model):
    """`aiayn serve` on a free loopback port (at most 100 characters a text, to see an error)."""
    proc, url = start([served_model], "--max-chars", "100")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1200,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def translator(served_model):
    return Translator.load(served_model, SearchConfig(beam_size=4), dtype="fp32", device="cpu")


def translate_on_page(browser, text: str, key: str) -> str:
    """Type text, translate by click or Ctrl+Enter, wait for the translation and its heatmap."""
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys(text)
    browser.execute_script(
        "for (const id of ['latency', 'translation']) document.getElementById(id).textContent = ''"
    )
    browser.execute_script("document.getElementById('heatmap').textContent = ''")
    if key == "click":
        browser.find_element(By.ID, "translate").click()
    else:
        box.send_keys(Keys.CONTROL, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "latency").text)
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "td.cell"))
    return browser.find_element(By.ID, "translation").get_attribute("textContent")


def test_translate_by_click_and_by_ctrl_enter(server, browser, translator):
    browser.get(server)
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model-info").text)
    assert translate_on_page(browser, TEXTS[0], "click") == translator.translate(TEXTS[:1])[0]
    assert translate_on_page(browser, TEXTS[1], "ctrl+enter") == translator.translate(TEXTS[1:])[0]
    assert "ms, batch of" in browser.find_element(By.ID, "latency").text


def attention_of(server: str, text: str) -> dict:
    request = urllib.request.Request(
        f"{server}/attention", json.dumps({"text": text}).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def drawn(browser) -> list[list[float]]:
    """The heatmap's cells as the page drew them, in one call."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#heatmap tbody tr')).map("
        "tr => Array.from(tr.querySelectorAll('td.cell')).map(td => Number(td.dataset.weight)))"
    )


def test_every_kind_layer_and_head_draws_the_cells_of_attention(server, browser):
    translate_on_page(browser, TEXTS[1], "click")
    want = attention_of(server, TEXTS[1])
    for kind in ("encoder", "decoder", "cross"):
        Select(browser.find_element(By.ID, "kind")).select_by_value(kind)
        layers = want[kind]
        for layer in range(len(layers)):
            Select(browser.find_element(By.ID, "layer")).select_by_value(str(layer))
            for head in ["mean", *range(len(layers[layer]))]:
                Select(browser.find_element(By.ID, "head")).select_by_value(str(head))
                heads = layers[layer]
                if head == "mean":
                    expected = [[sum(h[i][j] for h in heads) / len(heads) for j in range(len(heads[0][0]))]
                                for i in range(len(heads[0]))]  # fmt: skip
                else:
                    expected = heads[head]
                got = drawn(browser)
                assert [len(row) for row in got] == [len(row) for row in expected], (kind, layer, head)
                for got_row, expected_row in zip(got, expected):
                    assert got_row == pytest.approx(expected_row, abs=1e-9), (kind, layer, head)


def test_the_tooltip_names_the_query_and_key_tokens(server, browser):
    translate_on_page(browser, TEXTS[0], "click")
    Select(browser.find_element(By.ID, "kind")).select_by_value("cross")
    want = attention_of(server, TEXTS[0])
    cell = browser.find_element(By.CSS_SELECTOR, 'td.cell[data-query="2"][data-key="1"]')
    ActionChains(browser).move_to_element(cell).perform()
    tip = WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "tooltip").text)
    query, key = want["target_tokens"][2], want["source_tokens"][1]
    assert tip.startswith(f"{query} \u2192 {key}: "), tip


def test_the_attention_downloads_as_the_json_of_attention(server, browser, tmp_path):
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    translate_on_page(browser, TEXTS[1], "click")
    browser.find_element(By.ID, "download").click()
    path = tmp_path / "attention.json"
    WebDriverWait(browser, 10).until(lambda _: path.exists() and path.stat().st_size > 0)
    assert json.loads(path.read_text()) == attention_of(server, TEXTS[1])


def submit_too_long(browser) -> str:
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys("x" * 101)
    browser.find_element(By.ID, "translate").click()
    return WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)


def test_the_servers_message_shows_on_the_page(server, browser):
    browser.get(server)
    translate_on_page(browser, TEXTS[0], "click")
    assert submit_too_long(browser) == "413 too_long: text 1 has 101 characters; the limit is 100"
    assert browser.find_element(By.ID, "translation").text == ""  # not the answer to the text before


def test_nothing_leaves_loopback_and_the_console_is_clean(server, browser):
    """Reads the logs of every test of the module so far (reading them empties them)."""
    browser.get(server)
    translate_on_page(browser, TEXTS[0], "click")
    submit_too_long(browser)
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    # chrome://, chrome-untrusted:// (the browser's own pages), data: and blob: never leave the process
    network = [u for u in urls if u.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp")]
    assert network and all(u.startswith(f"{server}/") for u in network), network
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # the 413 of the over-long input is the one expected (and shows the log is read at all)
    assert [e for e in severe if "413" in e["message"]], severe
    assert not [e for e in severe if "413" not in e["message"]], severe


def test_a_pair_chosen_on_the_page_is_translated_by_its_model(served_model, browser, tmp_path):
    """Two models (one trained model under two pairs; the en->fr one stops after 3 tokens, its
    search.json says so): the page lists the pairs, and each translates with the model chosen."""
    from aiayn.checkpoint import Languages, save_languages

    dirs = {}
    for name, limit in (("en-de", None), ("en-fr", 3)):
        directory = tmp_path / name
        shutil.copytree(served_model, directory, ignore=shutil.ignore_patterns("checkpoints", "data"))
        save_languages(Languages(("en",), (name[3:],)), directory / "languages.json")
        if limit is not None:
            (directory / "search.json").write_text(json.dumps({"max_len_a": 0.0, "max_len_b": limit}))
        dirs[name] = directory
    proc, url = start(dirs.values(), "--beam-size", "1")  # (this model's beams of 4 end at once: "")
    try:
        browser.get(url)
        pair = WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pair option"))
        assert [o.text for o in pair] == ["en \u2192 de (en-de)", "en \u2192 fr (en-fr)"]
        for name in ("en-fr", "en-de"):
            Select(browser.find_element(By.ID, "pair")).select_by_visible_text(
                f"en \u2192 {name[3:]} ({name})"
            )
            assert name in browser.find_element(By.ID, "model-info").text
            expected = Translator.load(dirs[name], dtype="fp32").translate(TEXTS[:1], beam_size=1)
            assert translate_on_page(browser, TEXTS[0], "click") == expected[0]
        assert (
            expected[0] != Translator.load(dirs["en-fr"], dtype="fp32").translate(TEXTS[:1], beam_size=1)[0]
        )
    finally:
        proc.terminate()
        proc.wait(30)


CROSS_ORIGIN_PAGE = """<!doctype html><html><body><pre id="out"></pre><script>
const server = new URLSearchParams(location.search).get("server");
async function ask(body) {
  const r = await fetch(server + "/translate", {method: "POST", headers: {"Content-Type": "application/json"},
                                                 body: JSON.stringify(body)});
  return {status: r.status, body: await r.json()};
}
(async () => {
  const out = document.getElementById("out");
  try {
    out.textContent = JSON.stringify([await ask({text: TEXT}), await ask({text: "x".repeat(101)})]);
  } catch (e) { out.textContent = "failed: " + e; }
})();
</script></body></html>"""


def test_a_page_of_another_origin_translates_through_cors(server, browser, translator):
    """As with LibreTranslate, a web page served from elsewhere (another port: another origin) posts JSON
    to the server, which needs a CORS preflight: the translation, and an error's body, reach its script."""
    import http.server
    import threading

    page = CROSS_ORIGIN_PAGE.replace("TEXT", json.dumps(TEXTS[0])).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{other.server_port}/?server={server}")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "out").text)
        text = browser.find_element(By.ID, "out").text
        assert not text.startswith("failed"), text
        answer, refused = json.loads(text)
        assert answer == {"status": 200, "body": {"translations": translator.translate(TEXTS[:1])}}
        assert refused["status"] == 413 and refused["body"]["error"]["type"] == "too_long"
    finally:
        other.shutdown()
