"""pp-entry's chat page in real headless Chromium (Debian's chromium and chromium-driver, which install.sh
installs) against a real `ppsmoke.py --seed --serve` cluster on tiny: it takes the key, streams an answer,
shows every stage alive with its blocks, stops a long answer (freeing its slots), shows a stage killed
mid-answer lost and then replaced while the answer goes on; its screenshot is the README's (docs/chat-page.png, rewritten
with PP_UPDATE_SCREENSHOT=1)."""
import os
import shutil
import signal

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from test_chaos import Cluster, TOKEN
from test_smoke_seed import ROOT

N = 3
README_SCREENSHOT = ROOT / "docs" / "chat-page.png"  # rewritten only with PP_UPDATE_SCREENSHOT=1


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    yield driver
    driver.quit()


def wait(driver, condition, timeout_s=60):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: condition())


def stages(driver) -> list[tuple[str, str]]:
    """(state, blocks) of each stage box the page shows."""
    return [tuple(pair) for pair in driver.execute_script(  # in one call: the boxes are redrawn every second
        "return [...document.querySelectorAll('#stages .stage')]"
        ".map(b => [b.dataset.state, b.querySelector('.detail').dataset.blocks]);")]


def answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#messages .assistant")


def send(driver, text):
    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def test_the_chat_page_streams_an_answer_shows_the_pipeline_and_stops_a_long_answer(browser, tmp_path):
    cluster = Cluster(tmp_path, n=N)
    try:
        browser.get(cluster.base_url + "/")
        assert "pp" in browser.title
        assert "Enter the API key" in browser.find_element(By.ID, "banner").text  # nothing shown without it
        browser.find_element(By.ID, "key").send_keys(TOKEN)
        browser.find_element(By.ID, "save-key").click()
        wait(browser, lambda: [s for s, _ in stages(browser)] == ["alive"] * N)
        assert [b for _, b in stages(browser)] == ["0,3", "3,6", "6,8"]  # tiny's 8 blocks over 3 stages

        send(browser, "Say hello")
        wait(browser, lambda: answers(browser) and answers(browser)[-1].get_attribute("data-done") == "true")
        last = answers(browser)[-1]
        assert last.text and "error" not in last.get_attribute("class") and last.get_attribute("data-stopped") is None
        assert browser.find_element(By.ID, "ttft").text.endswith(" s")
        wait(browser, lambda: "ms/token" in browser.find_element(By.ID, "stages").text)  # the last answer's compute
        assert browser.execute_script("return localStorage.getItem('pp-api-key')") == TOKEN
        browser.refresh()  # the key is kept: the pipeline shows again without asking
        wait(browser, lambda: [s for s, _ in stages(browser)] == ["alive"] * N)

        send(browser, "Tell me a very long story")
        wait(browser, lambda: answers(browser) and len(answers(browser)[-1].text) > 5)  # the refresh began anew
        assert cluster.slots_in_use() == [1] * N
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda: answers(browser)[-1].get_attribute("data-stopped") == "true")
        assert cluster.wait_idle() == [0] * N  # stopping cancelled the request on every stage
        shot = README_SCREENSHOT if os.environ.get("PP_UPDATE_SCREENSHOT") == "1" else tmp_path / "chat-page.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        send(browser, "Another long story")  # and a stage killed mid-answer: shown lost, replaced, answer goes on
        wait(browser, lambda: len(answers(browser)) == 2 and len(answers(browser)[-1].text) > 5)
        _, pid = cluster.holders()[1]
        os.kill(pid, signal.SIGKILL)
        wait(browser, lambda: stages(browser)[1][0] in ("dead", "missing", "loading"), 30)
        wait(browser, lambda: [s for s, _ in stages(browser)] == ["alive"] * N, 90)
        resumed_from = len(answers(browser)[-1].text)
        wait(browser, lambda: len(answers(browser)[-1].text) > resumed_from + 5, 30)
        assert answers(browser)[-1].get_attribute("data-done") is None  # still streaming: not failed
        browser.find_element(By.ID, "stop").click()
        assert cluster.wait_idle() == [0] * N
        assert cluster.holders()[1][1] != pid
    finally:
        cluster.stop()
