"""The pictures of the `aiayn serve` page in docs/serving.md: the server as a subprocess, Debian's headless
Chromium through Selenium (as tests/serving/test_page.py drives it), two PNGs in docs/.

    python docs/screenshots.py MODEL_DIR "Ein Mann mit einem orangefarbenen Hut starrt auf etwas."
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

DOCS = Path(__file__).resolve().parent


def main(model: str, text: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "aiayn", "serve", model, "--port", str(port), "--no-compile"]
    server = subprocess.Popen(command)  # eager: the page is the picture, not minutes of compiling first
    url = f"http://127.0.0.1:{port}"
    options = Options()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,1000"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        browser.get(url)
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model-info").text)
        browser.find_element(By.ID, "source").send_keys(text)
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "td.cell"))
        Select(browser.find_element(By.ID, "layer")).select_by_index(1)
        cell = browser.find_element(By.CSS_SELECTOR, 'td.cell[data-query="1"][data-key="2"]')
        ActionChains(browser).move_to_element(cell).perform()
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "tooltip").text)
        browser.save_screenshot(str(DOCS / "serve_page.png"))
        Select(browser.find_element(By.ID, "kind")).select_by_value("encoder")
        Select(browser.find_element(By.ID, "head")).select_by_index(1)
        browser.find_element(By.ID, "source").clear()
        browser.find_element(By.ID, "source").send_keys("x" * 6000)
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)
        browser.save_screenshot(str(DOCS / "serve_error.png"))
    finally:
        browser.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main(*sys.argv[1:3])
