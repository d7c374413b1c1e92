"""A real local cluster for benchmarks: ppnode.py processes and the runner's orchestrator, started as
`ppsmoke.py --seed` starts them, inside the caller's nursery; or `ppsmoke.py --seed --serve` itself, as a
child process, for benchmarks that need the runner's replacement of a stage that dies."""
from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from node.config.cores import available_cores, fair_share
from runner.orchestrator import Orchestrator, run_orchestrator
from runner.children import child_env, run_child, terminate_then_kill


def http(**kw) -> httpx.AsyncClient:
    """A client for a bench's own calls to the stages (/health, /metrics, the API with a key), https:// or
    http://. The stages show certificates of their cluster's CA; a bench reading figures on loopback does not check
    them (a served cluster's token is the runner's). What only members may call needs member_http."""
    return httpx.AsyncClient(verify=False, **kw)


def member_http(orch: Orchestrator, **kw) -> httpx.AsyncClient:
    """A client with the runner's member certificate: /v1/hops and the cluster's other routes."""
    return httpx.AsyncClient(verify=orch.tls.client_context(), **kw)


async def start_local_cluster(nursery: trio.Nursery, model: str, n: int, *, extra_env: dict[str, str] | None = None,
                              token: str | None = None, api_keys: tuple[str, ...] = (),
                              wrappers: dict[int, tuple[str, ...]] | None = None) -> tuple[Orchestrator, list[str]]:
    """Start n stages of `model` and wait until pp-entry resolves; returns the orchestrator and stage URLs.
    `api_keys`: the clients' keys (none: the OpenAI API answers 401). `wrappers`: a command that execs a stage's
    node, by stage (run_child). Cancel the nursery to stop everything."""
    token, run_dir = token or secrets.token_urlsafe(16), Path(tempfile.mkdtemp(prefix="bench-"))
    # as ppsmoke --seed: the stages share this machine's cores, unless the caller says otherwise
    extra_env = {"PP_THREADS": str(fair_share(available_cores(), n)), **(extra_env or {})}
    orch = await nursery.start(functools.partial(run_orchestrator, token))
    urls, prev = [], None
    for stage in range(n):
        env = child_env({**os.environ, **(extra_env or {})}, stage=stage, num_stages=n, token=token, model=model,
                        seed=orch.url, peer=prev, api_keys=api_keys)
        child = await nursery.start(functools.partial(run_child, stage, env, run_dir / f"stage{stage}.log",
                                                      wrapper=(wrappers or {}).get(stage, ())))
        urls.append(prev := child.url)
    await orch.converge(n)
    return orch, urls


# -- `ppsmoke.py --seed --serve`: the runner that replaces a stage that dies ---------------------------------

PPSMOKE = Path(__file__).resolve().parent.parent / "ppsmoke.py"


def stage_holders(lines: list[str]) -> dict[int, tuple[str, int]]:
    """Each stage's latest node, (url, pid), from the runner's lines: `stage 1/2 listening at URL (pid P)` at
    boot, `stage 1: replacement listening at URL (pid P)` after a loss."""
    found = {}
    for line in lines:
        if " listening at " in line and "(pid " in line:
            stage = int(line.split("stage ", 1)[1].split("/")[0].split(":")[0])
            url = line.split(" listening at ")[1].split()[0]
            found[stage] = (url, int(line.rsplit("(pid ", 1)[1].rstrip(")")))
    return found


class ServedRun:
    """One `ppsmoke.py --seed --serve` process (what tests/test_chaos.py drives, here under trio): its stderr's
    lines as they come, each with when it was read on this process's monotonic clock."""

    def __init__(self, process: trio.Process):
        self.process, self.lines = process, []  # lines: (read at, text)
        self._grew, self._ended = trio.Event(), False

    async def read_lines(self) -> None:
        buffer = b""
        async for chunk in self.process.stderr:
            *whole, buffer = (buffer + chunk).split(b"\n")
            self.lines += [(time.monotonic(), line.decode(errors="replace")) for line in whole]
            self._grew.set()
            self._grew = trio.Event()
        self._ended = True
        self._grew.set()

    def holders(self) -> dict[int, tuple[str, int]]:
        return stage_holders([text for _, text in self.lines])

    async def wait_line(self, needle: str, timeout_s: float, *, after: int = 0) -> tuple[float, str]:
        """The first line past the first `after` that holds `needle`: (when it was read, its text)."""
        with trio.move_on_after(timeout_s):
            while True:
                found = next(((t, text) for t, text in self.lines[after:] if needle in text), None)
                if found is not None:
                    return found
                if self._ended:
                    break
                await self._grew.wait()
        tail = "\n".join(text for _, text in self.lines[-40:])
        raise RuntimeError(f"ppsmoke: {needle!r} not seen within {timeout_s} s (ended: {self._ended}):\n{tail}")


async def start_served_cluster(nursery: trio.Nursery, model: str, n: int, *, api_key: str,
                               extra_env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                               ready_s: float = 300) -> ServedRun:
    """`ppsmoke.py --seed -n n --model model --serve` in `nursery`, the clients' key given in its environment;
    returns once pp-entry is ready. Cancel the nursery to stop it (SIGTERM, as Ctrl-C: every node stops)."""
    env = {**os.environ, **(extra_env or {}), "PP_API_KEY": api_key}
    command = [sys.executable, str(PPSMOKE), "--seed", "-n", str(n), "--model", model, "--serve", *args]
    process = await nursery.start(functools.partial(
        trio.run_process, command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False,
        deliver_cancel=terminate_then_kill(30.0)))
    run = ServedRun(process)
    nursery.start_soon(run.read_lines)
    await run.wait_line("pp-entry is ready", ready_s)
    return run
