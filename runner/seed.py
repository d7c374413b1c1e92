"""`ppsmoke.py --seed`: N local node processes (spec §4.1), started one after another, each non-first
one with its predecessor as PEER_DIRECT; the runner is the gossip seed and pp-orchestrator. One nursery
owns everything, so any failure — a child exiting, a timeout, a dead stage, a signal — stops it all."""
from __future__ import annotations

import functools
import secrets
import tempfile
import time
from pathlib import Path
from typing import Callable

import attrs
import trio

from node.orchestrator import Orchestrator, StageDied, run_orchestrator
from worker.sampling import Sampling

from .children import Child, child_env, log_tail, run_child
from .common import RunFailed, RunResult, fail_on_signals, first_failure, timings_of


@attrs.frozen
class SeedOptions:
    num_stages: int
    model: str  # as the nodes will get it: a local path, tiny or stub (names are fetched beforehand)
    prompt: str
    max_tokens: int
    sampling: Sampling
    timeout_s: float
    converge_timeout_s: float
    base_env: dict[str, str]
    run_dir: Path | None = None
    grace_s: float = 5.0


async def run_seed(opts: SeedOptions, progress: Callable[[str], None]) -> RunResult:
    run_dir = opts.run_dir or Path(tempfile.mkdtemp(prefix="ppsmoke-"))
    token = secrets.token_urlsafe(24)  # fresh per run: only this run's nodes can talk to each other
    children: list[Child] = []
    started = time.monotonic()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_on_signals)
            orch = await nursery.start(functools.partial(run_orchestrator, token))
            progress(f"runner is the gossip seed at {orch.url}; logs in {run_dir}")
            await _start_children(nursery, opts, token, orch.url, run_dir, children, progress)
            converged = await _converge(orch, opts, children, started, progress)
            response, submitted, answered = await _ask(orch, opts, children)
            nursery.cancel_scope.cancel()  # done: stop every node
    except BaseExceptionGroup as group:
        raise first_failure(group) from None
    if response.error:
        raise RunFailed(f"stage {response.failed_stage} failed: {response.error}\n"
                        f"{_tail_of(children, response.failed_stage)}")
    timings = timings_of(response, converged - started, answered - submitted, answered - started)
    return RunResult(response, opts.num_stages, timings, run_dir)


async def _start_children(nursery, opts, token, seed_url, run_dir, children, progress) -> None:
    prev = None
    for stage in range(opts.num_stages):
        env = child_env(opts.base_env, stage=stage, num_stages=opts.num_stages, token=token, model=opts.model,
                        seed=seed_url, peer=prev)
        child = await nursery.start(functools.partial(run_child, stage, env, run_dir / f"stage{stage}.log",
                                                      grace_s=opts.grace_s))
        children.append(child)
        progress(f"stage {stage}/{opts.num_stages - 1} listening at {child.url} (pid {child.process.pid})")
        prev = child.url


async def _converge(orch: Orchestrator, opts, children, started, progress) -> float:
    progress(f"waiting for {opts.num_stages} stages to load and join ...")
    with trio.move_on_after(opts.converge_timeout_s) as scope:
        await orch.converge(opts.num_stages)
    if scope.cancelled_caught:
        alive = {m.meta.stage for m in orch.swim.alive() if m.meta.stage is not None}
        missing = [c.stage for c in children if c.stage not in alive]
        tails = "\n".join(f"stage {s}:\n{_tail_of(children, s)}" for s in missing)
        raise RunFailed(f"the cluster did not converge within {opts.converge_timeout_s:.0f} s; "
                        f"stages not alive: {missing}\n{tails}")
    now = time.monotonic()
    progress(f"converged in {now - started:.1f} s; pp-entry is ready")
    return now


async def _ask(orch: Orchestrator, opts, children):
    submitted = time.monotonic()
    try:
        with trio.fail_after(opts.timeout_s):
            response = await orch.submit(opts.prompt, max_tokens=opts.max_tokens, sampling=opts.sampling)
    except StageDied as exc:
        raise RunFailed(f"{exc}\n{_tail_of(children, exc.member.meta.stage)}") from None
    except trio.TooSlowError:
        raise RunFailed(f"no response within {opts.timeout_s:.0f} s") from None
    return response, submitted, time.monotonic()


def _tail_of(children: list[Child], stage: int | None) -> str:
    child = next((c for c in children if c.stage == stage), None)
    return log_tail(child.log_path) if child else "    (no log)"
