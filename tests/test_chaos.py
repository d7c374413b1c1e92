"""Chaos (issue 14): a `ppsmoke.py --seed --serve` cluster of 4 stages on tiny with 8 concurrent streaming
clients, and one fault at a time. After each, every request completes with the text of an undisturbed run,
no stage holds a slot, and (at teardown) no process is left behind. Each test prints one `chaos:` line
with what it measured (run with -s to see them): requests completed and lost, the time from the fault to
the runner noticing, to the replacement being ready, and to the first token after the pause.

Poison requests (issue 23) are a row too: values that once ended the last stage's process, and then each
replacement's as stage 0 replayed them into it.

The default suite runs SIGKILL of a middle stage and the poison requests; the other faults are in the slow
tier."""
import concurrent.futures
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from cluster import api
from node.membership.gossip import SwimConfig
from node.membership.rules import suspicion_timeout_s
from test_smoke_seed import MARK, ROOT, assert_all_gone

N, CLIENTS, MAX_TOKENS = 4, 8, 64
API_KEY = "chaos-key"  # the clients', given in the environment (the cluster token is the runner's own)
PROMPTS = [f"Story number {i}:" for i in range(CLIENTS)]


class Cluster:
    """One `ppsmoke.py --seed --serve` run, on tiny unless `model` names another; its stderr goes to a file the
    test reads as it grows."""

    def __init__(self, tmp, env_extra=None, *, n=N, model="tiny", args=()):
        self.mark, self.err_path, self.model = uuid.uuid4().hex, tmp / "ppsmoke.err", model
        env = {**os.environ, MARK: self.mark, "DEV": "CPU", "PP_API_KEY": API_KEY, **(env_extra or {})}
        self.err_file = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "ppsmoke.py"), "--seed", "-n", str(n), "--model", model, "--serve",
             "--max-seqs", str(CLIENTS), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.err_file, text=True)
        self.seen: list[tuple[float, str]] = []  # (when the test read it, line) of ppsmoke's stderr
        self._lock = threading.Lock()  # the fault's thread reads lines too
        self.base_url = self._read_base_url()
        self.announced: list[str] = []  # ppsmoke's later stdout lines (it announces a replaced entry)
        threading.Thread(target=lambda: self.announced.extend(self.proc.stdout), daemon=True).start()
        self.wait_line("pp-entry is ready", 240)

    def _read_base_url(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("OPENAI_BASE_URL="):
                return line.split("=", 1)[1].strip().removesuffix("/v1")
        raise AssertionError(f"ppsmoke ended before serving:\n{self.err_path.read_text()}")


    def lines(self) -> list[str]:
        with self._lock:
            now = time.monotonic()
            lines = self.err_path.read_text().splitlines()
            self.seen += [(now, line) for line in lines[len(self.seen):]]
            return lines

    def paused_at(self, since: float) -> float | None:
        """When stage 0 first paused (gossip told it a stage was missing) after `since`, on this clock."""
        offset = time.time() - time.monotonic()
        entry_log = max((p for p in logs_of(self) if p.name.startswith("stage0")), key=lambda p: p.stat().st_mtime)
        for line in entry_log.read_text().splitlines():
            if '"event": "chain"' in line and '"members": null' in line:
                record = json.loads(line)
                at = datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp() - offset
                if at > since:
                    return at
        return None

    def wait_line(self, needle: str, timeout_s: float, *, after: int = 0) -> float:
        """Wait for a stderr line (past the first `after` lines) holding `needle`; when the test first read
        it (the line itself carries no time)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.lines()
            found = next((t for t, line in self.seen[after:] if needle in line), None)
            if found is not None:
                return found
            assert self.proc.poll() is None, f"ppsmoke exited:\n{self.err_path.read_text()}"
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not seen within {timeout_s} s:\n{self.err_path.read_text()}")

    def holders(self) -> dict[int, tuple[str, int]]:
        """Each stage's latest node: (url, pid)."""
        found = {}
        for line in self.lines():
            if " listening at " in line and "(pid " in line:
                stage = int(line.split("stage ", 1)[1].split("/")[0].split(":")[0])
                url = line.split(" listening at ")[1].split()[0]
                found[stage] = (url, int(line.rsplit("(pid ", 1)[1].rstrip(")")))
        return found

    def slots_in_use(self) -> list[int]:
        return [httpx.get(url + "/health", verify=False).json()["slots_in_use"]  # https://, under the cluster's CA
                for url, _ in sorted(self.holders().values())]

    def wait_idle(self, timeout_s: float = 20) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while any(slots := self.slots_in_use()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return slots

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(timeout=60) == 0, self.err_path.read_text()[-3000:]
        finally:
            self.proc.stdout.close()
            self.err_file.close()
        assert_all_gone(self.mark, timeout_s=20)


def stream(base_url: str, prompt: str, chunks: list, model: str = "tiny", **params) -> None:
    """One streaming completion (greedy unless `params` say); appends (arrival time, text or the error) to
    `chunks` as they come."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **params}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=180,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                text = data["choices"][0]["text"] if "choices" in data else {"error": data.get("error")}
                chunks.append((time.monotonic(), text))


def run_clients(cluster: Cluster, fault=None, *, after_chunks: int = 3) -> tuple[list[list], float | None]:
    """Every prompt streamed at once; `fault()` is called once each stream has `after_chunks` chunks.
    Returns each stream's chunks and when the fault struck. Meanwhile ppsmoke's lines are read as they come."""
    chunks = [[] for _ in PROMPTS]
    struck = None
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        futures = [pool.submit(stream, cluster.base_url, p, c, cluster.model) for p, c in zip(PROMPTS, chunks)]
        if fault is not None:
            while min(len(c) for c in chunks) < after_chunks and not all(f.done() for f in futures):
                time.sleep(0.01)
            struck = time.monotonic()
            pool.submit(fault)
        while not all(f.done() for f in futures):
            cluster.lines()
            time.sleep(0.05)
        errors = [f.exception() for f in futures]
    assert errors == [None] * len(PROMPTS), (errors, "\n".join(cluster.lines()[-40:]))
    return chunks, struck


def text_of(chunks: list) -> str:
    return "".join(t if isinstance(t, str) else json.dumps(t) for _, t in chunks)


def report(name: str, chunks: list, undisturbed: list[str], struck: float | None, noticed=None, ready=None,
           paused=None) -> None:
    """Assert every answer is the undisturbed one; print the figures. A stream's pause is its longest gap
    between chunks; it resumed at the end of that gap."""
    texts = [text_of(c) for c in chunks]
    completed = sum(t == u for t, u in zip(texts, undisturbed))
    gaps = [max(((b[0] - a[0], b[0]) for a, b in zip(c, c[1:])), default=(0.0, 0.0)) for c in chunks]
    line = (f"chaos: {name}: completed {completed}/{len(texts)}, lost {len(texts) - completed}; streams paused "
            f"{min(g for g, _ in gaps):.2f}-{max(g for g, _ in gaps):.2f} s")
    if struck is not None:
        fmt = lambda v: "-" if v is None else f"{v - struck:.1f} s"  # noqa: E731
        resumed = [end - struck for _, end in gaps]
        line += (f"; after the fault: runner noticed {fmt(noticed)}, gossip paused stage 0 {fmt(paused)}, "
                 f"replacement ready {fmt(ready)}, first token after the pause {min(resumed):.1f}-"
                 f"{max(resumed):.1f} s")
    print("\n" + line)
    assert texts == undisturbed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("chaos"))
    try:
        chunks, _ = run_clients(c)
        c.undisturbed = [text_of(ch) for ch in chunks]
        assert all(c.undisturbed) and not any('"error"' in t for t in c.undisturbed)
        yield c
    finally:
        c.stop()


def kill_and_replace(cluster: Cluster, stage: int, name: str) -> None:
    url, pid = cluster.holders()[stage]
    seen = len(cluster.lines())
    chunks, struck = run_clients(cluster, lambda: os.kill(pid, signal.SIGKILL))
    noticed = cluster.wait_line(f"stage {stage} at {url}", 5, after=seen)
    ready = cluster.wait_line(f"stage {stage} replaced in", 5, after=seen)
    report(name, chunks, cluster.undisturbed, struck, noticed, ready, cluster.paused_at(struck))
    assert cluster.holders()[stage][1] != pid
    assert cluster.wait_idle() == [0] * N


def test_sigkill_of_a_middle_stage_costs_a_pause_not_a_request(cluster):
    kill_and_replace(cluster, 2, "SIGKILL stage 2 (middle)")


@pytest.mark.slow
def test_sigkill_of_the_last_stage_costs_a_pause_not_a_request(cluster):
    kill_and_replace(cluster, N - 1, "SIGKILL stage 3 (last)")


@pytest.mark.slow
def test_sigkill_of_stage_0_ends_its_streams_with_an_error_and_its_replacement_serves(cluster):
    url, pid = cluster.holders()[0]
    seen = len(cluster.lines())
    chunks = [[] for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, cluster.base_url, p, c) for p, c in zip(PROMPTS, chunks)]
        while min(len(c) for c in chunks) < 3:
            time.sleep(0.01)
        struck = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        errors = [f.exception() for f in futures]
    assert all(isinstance(e, httpx.HTTPError) for e in errors), errors  # the clients' connections were there
    ready = cluster.wait_line("stage 0 replaced in", 60, after=seen)
    new_url = api(cluster.holders()[0][0])  # its API, as announced: plain http:// on the member's port
    deadline = time.monotonic() + 5
    while f"OPENAI_BASE_URL={new_url}/v1\n" not in cluster.announced and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"OPENAI_BASE_URL={new_url}/v1\n" in cluster.announced, cluster.announced
    cluster.base_url = new_url
    chunks, _ = run_clients(cluster)
    assert [text_of(c) for c in chunks] == cluster.undisturbed
    assert cluster.wait_idle() == [0] * N  # the old entry's requests hold no slot anywhere
    print(f"\nchaos: SIGKILL stage 0: {len(PROMPTS)}/{len(PROMPTS)} streams ended with an error (as they must); "
          f"replacement ready {ready - struck:.1f} s after the fault; the next {len(PROMPTS)} requests completed")


@pytest.mark.slow
def test_a_stage_frozen_for_less_than_the_suspicion_timeout_is_not_replaced(cluster):
    _, pid = cluster.holders()[1]
    seen = len(cluster.lines())
    freeze_s = suspicion_timeout_s(N + 1, SwimConfig()) / 2  # the runner is a member too

    def freeze():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.kill(pid, signal.SIGCONT)
    chunks, struck = run_clients(cluster, freeze)
    report(f"SIGSTOP stage 1 for {freeze_s:.1f} s", chunks, cluster.undisturbed, struck)
    assert not any("replacement" in line for line in cluster.lines()[seen:])
    assert cluster.holders()[1][1] == pid
    assert cluster.wait_idle() == [0] * N


@pytest.mark.slow
def test_a_stage_frozen_past_the_dead_timeout_is_replaced_and_exits_when_it_wakes(cluster):
    url, pid = cluster.holders()[2]
    seen = len(cluster.lines())
    marks = {}

    def freeze_until_replaced():
        os.kill(pid, signal.SIGSTOP)
        marks["noticed"] = cluster.wait_line(f"stage {2} at {url}", 60, after=seen)
        marks["ready"] = cluster.wait_line("stage 2 replaced in", 60, after=seen)
        os.kill(pid, signal.SIGCONT)
    chunks, struck = run_clients(cluster, freeze_until_replaced)
    report("SIGSTOP stage 2 until replaced, then SIGCONT", chunks, cluster.undisturbed, struck,
           marks["noticed"], marks["ready"], cluster.paused_at(struck))
    assert "declared dead" in cluster.lines()[seen]
    deadline = time.monotonic() + 20
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "the frozen stage went on serving after it woke"
    assert any('"event": "replaced"' in p.read_text() for p in logs_of(cluster) if p.name.startswith("stage2"))
    assert cluster.wait_idle() == [0] * N


def test_poison_requests_fail_alone_and_no_node_exits_or_keeps_a_slot(cluster):
    """A temperature so small that the probabilities were NaN (1e-310) and seeds numpy refuses passed the API's
    checks and ended the last stage's process. Now the first samples greedily (its answer is the temperature-0
    one) and the seeds are a 400 naming `seed`, while eight clients stream: their answers are unchanged, every
    node is the one it was, and no slot is left taken."""
    pids = {stage: pid for stage, (_, pid) in cluster.holders().items()}
    seen = len(cluster.lines())
    outcome = {}

    def poison():
        chunks = []
        stream(cluster.base_url, PROMPTS[0], chunks, cluster.model, temperature=1e-310)
        outcome["temperature 1e-310"] = text_of(chunks)
        for seed in (-1, 2 ** 64):
            body = {"model": cluster.model, "prompt": PROMPTS[1], "max_tokens": 4, "seed": seed}
            r = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"})
            outcome[f"seed {seed}"] = (r.status_code, r.json()["error"]["param"])
    chunks, _ = run_clients(cluster, poison)
    report("poison requests (temperature 1e-310; seeds -1, 2**64)", chunks, cluster.undisturbed, None)
    assert outcome == {"temperature 1e-310": cluster.undisturbed[0], "seed -1": (400, "seed"),
                       f"seed {2 ** 64}": (400, "seed")}
    assert {stage: pid for stage, (_, pid) in cluster.holders().items()} == pids
    assert not any("replaced in" in line for line in cluster.lines()[seen:])
    assert cluster.wait_idle() == [0] * N


def pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie its parent has not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_dropped_and_delayed_link_sends_cost_nothing(cluster, tmp_path):
    # 1% of link sends dropped (as a broken connection), 5% delayed by 50 ms, on every stage
    c = Cluster(tmp_path, {"PP_FAULTS": "drop=0.01,delay=0.05,delay_ms=50"})
    try:
        chunks, _ = run_clients(c)  # the faults strike all along
        report("1% of link sends dropped, 5% delayed 50 ms", chunks, cluster.undisturbed, None)
        assert c.wait_idle() == [0] * N
        dropped = sum(p.read_text().count("dropped by fault injection") for p in logs_of(c))
        assert dropped > 0, "no send was dropped: the test proved nothing"
    finally:
        c.stop()


def logs_of(c: Cluster) -> list[Path]:
    run_dir = next(line.split("logs in ", 1)[1].strip() for line in c.lines() if "logs in " in line)
    return sorted(Path(run_dir).glob("stage*.log"))
