"""Test helper: `ppsmoke.py --seed --serve` as real processes, for tests that use the API as a client would;
stopped with Ctrl-C (SIGINT) at the end, every process it started checked gone."""
from __future__ import annotations

import contextlib
import signal
import uuid

import httpx
import openai

from test_smoke_seed import assert_all_gone, start, wait_for_line


class Served:
    def __init__(self, proc, base_url: str, api_key: str, stage_urls: list[str], mark: str, printed: str,
                 booted: str = ""):
        self.proc, self.base_url, self.api_key, self.stage_urls, self.mark = proc, base_url, api_key, stage_urls, mark
        self.printed = printed  # what ppsmoke printed on stdout until the cluster was ready
        self.booted = booted  # and on stderr (each stage's address and pid)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=120, **kw)

    def slots_in_use(self) -> list[int]:
        # every stage speaks TLS under a CA of the cluster's token, which this test does not know
        return [httpx.get(u + "/health", verify=False).json()["slots_in_use"] for u in self.stage_urls]


@contextlib.contextmanager
def serving(args: list[str], *, stages: int, env_extra: dict | None = None, ready_s: float = 240):
    """The cluster `args` describe (the built-in tiny model unless they name another), served until the block
    ends; yields a Served with the API's URL, the client key it printed and every stage's URL."""
    mark = uuid.uuid4().hex
    proc = start(["-n", str(stages), "--serve", *args], mark, env_extra=env_extra)
    try:
        out = wait_for_line(proc.stdout, "curl -N", ready_s)
        base_url = next(line.split("=", 1)[1].strip() for line in out if line.startswith("OPENAI_BASE_URL="))
        api_key = next(line.split("=", 1)[1].strip() for line in out if line.startswith("OPENAI_API_KEY="))
        err = wait_for_line(proc.stderr, "pp-entry is ready", 30)
        stage_urls = [line.split(" listening at ")[1].split()[0] for line in err if " listening at " in line]
        assert len(stage_urls) == stages
        yield Served(proc, base_url, api_key, stage_urls, mark, "".join(out), "".join(err))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        finally:
            proc.stdout.close()
            proc.stderr.close()
    assert_all_gone(mark)
