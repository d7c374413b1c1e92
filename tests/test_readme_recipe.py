"""Slow tier: the README's recipe for serving across your own machines, run as written. Its three shell blocks
(machine A, machine B, a client) are taken from between the README's recipe markers and run with bash, two
shells standing in for two machines; only the ports are swapped for free ones. Then the README's claim about
a lost stage: stage 1 killed with SIGKILL and started again with the same command serves the same greedy
answer."""
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from test_smoke_seed import MARK, assert_all_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- recipe: two machines", "<!-- end recipe -->"


def recipe_blocks(readme: str) -> list[str]:
    """The ```sh blocks between the recipe's markers, in order."""
    part = readme[readme.index(START):readme.index(END)]
    return re.findall(r"```sh\n(.*?)```", part, flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_recipe_has_a_block_for_each_machine_and_the_client():
    a, b, client = recipe_blocks((ROOT / "README.md").read_text())
    assert "STAGE=0" in a and "ppnode.py" in a and "STAGE=1" in b and "SEED_ADDR" in b and "curl" in client


def _wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url}/health never answered 200")


def _greedy(url: str) -> str:
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 12,
            "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-mine"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_two_shells_serve_an_openai_client_as_the_readme_says_and_a_restarted_stage_rejoins(tmp_path):
    ports = {"8000": str(free_port()), "8001": str(free_port())}
    a, b, client = (re.sub(r"\b(8000|8001)\b", lambda m: ports[m.group(1)], block)
                    for block in recipe_blocks((ROOT / "README.md").read_text()))
    mark = uuid.uuid4().hex
    env = {**os.environ, "DEV": "CPU", MARK: mark}
    logs = []

    def shell(script: str, name: str) -> subprocess.Popen:
        logs.append(open(tmp_path / f"{name}.log", "w"))
        return subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, start_new_session=True,
                                stdout=logs[-1], stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports['8000']}"
    shells = [shell(a, "a"), shell(b, "b")]
    try:
        _wait_healthy(url)
        stage1 = f"127.0.0.1:{ports['8001']}"  # the nodes speak TLS to each other: B answers nothing in plain HTTP
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{stage1}/health", timeout=5)
        assert httpx.get(f"https://{stage1}/health", timeout=5, verify=False).status_code == 200  # no identity needed
        out = subprocess.run(["bash", "-c", client], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        status, answer = out.stdout.split("\n", 1)
        assert status == "200" and json.loads(answer)["choices"][0]["message"]["content"], out
        before = _greedy(url)
        os.killpg(shells[1].pid, signal.SIGKILL)  # machine B dies
        shells[1].wait(timeout=30)
        shells[1] = shell(b, "b2")  # and is started again with the same command
        _wait_healthy(url)
        assert _greedy(url) == before
    finally:
        for s in shells:
            try:
                os.killpg(s.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for s in shells:
            s.wait(timeout=30)
        for log in logs:
            log.close()
    assert_all_gone(mark, timeout_s=30)
