"""The README's screenshot of the chat page (docs/chat-page.png), on the default model: a real conversation.

Starts `ppsmoke.py --seed -n 3 --serve` (SmolLM2-135M-Instruct unless --model says), opens pp-entry's page
in headless Chromium (Debian's chromium and chromium-driver, and selenium from requirements-test.txt), asks
two turns at temperature 0, and saves the window. Every node is stopped at the end, on any path.

  .venv/bin/python -m tools.chat_screenshot [--out docs/chat-page.png] [--model smollm2:135m]
"""
from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
TURNS = ("Say hello", "What can you help me with?")


def start_cluster(model: str, token: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "ppsmoke.py"), "--seed", "-n", "3", "--model", model,
                             "--serve", "--token", token], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("OPENAI_BASE_URL="):
            return proc, line.split("=", 1)[1].strip().removesuffix("/v1")
    raise SystemExit(f"ppsmoke ended before serving (exit {proc.wait()})")


def browser() -> webdriver.Chrome:
    options = Options()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860",
                "--disable-background-networking"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def converse(driver, base_url: str, token: str) -> None:
    wait = WebDriverWait(driver, 600, poll_frequency=0.2)
    driver.get(base_url + "/")
    driver.find_element(By.ID, "key").send_keys(token)
    driver.find_element(By.ID, "save-key").click()
    wait.until(lambda d: d.execute_script(  # in one call: the boxes are redrawn every second
        "const s = [...document.querySelectorAll('#stages .stage')];"
        "return s.length > 0 && s.every(b => b.dataset.state === 'alive');"))
    driver.find_element(By.ID, "temperature").send_keys("0")
    driver.find_element(By.ID, "max-tokens").send_keys("80")
    for n, text in enumerate(TURNS, 1):
        driver.find_element(By.ID, "message").send_keys(text)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.execute_script(
            "const a = document.querySelectorAll('#messages .assistant');"
            f"return a.length === {n} && a[a.length - 1].dataset.done === 'true';"))
    wait.until(lambda d: "ms/token" in d.find_element(By.ID, "stages").text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.chat_screenshot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "chat-page.png")
    p.add_argument("--model", default="smollm2:135m")
    args = p.parse_args(argv)
    token = secrets.token_hex(16)
    proc, base_url = start_cluster(args.model, token)
    try:
        driver = browser()
        try:
            converse(driver, base_url, token)
            driver.save_screenshot(str(args.out))
        finally:
            driver.quit()
    finally:
        proc.send_signal(signal.SIGINT)  # ppsmoke stops every node it started
        proc.wait(timeout=60)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
