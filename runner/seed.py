"""`ppsmoke.py --seed`: N local node processes (docs/design.md, Boot order), started one after another,
each non-first one with its predecessor as PEER_DIRECT; the runner is the gossip seed and pp-orchestrator. One nursery
owns everything, so any failure — a child exiting, a timeout, a dead stage, a signal — stops it all.
With --serve, once the cluster has converged a stage that dies is replaced instead (runner/keeper.py):
a new process for the same stage, its log beside the first one's; on a fixed port (stage 0 with --port)
only once the old process is stopped and the port is free (runner/ports.py)."""
from __future__ import annotations

import functools
import itertools
import re
import secrets
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import attrs
import trio

from node.config.network import LOOPBACK, SCHEME
from node.planning import gossiped_plan
from roles.topology import stage_name
from .orchestrator import Orchestrator, run_orchestrator
from worker.contract import Sampling

from .children import Child, child_env, log_tail, run_child, run_standby
from .common import RunFailed, RunResult, fail_on_signals, first_failure
from .keeper import keep_stages, race
from .phases import report_phases, split_line
from .ports import stop_and_free_port
from .standby import Standbys
from .session import Use, announce_entry, answer_once, serve


@attrs.frozen
class SeedOptions:
    num_stages: int
    model: str  # as the nodes will get it: a local path, tiny or stub (names are fetched beforehand)
    prompt: str
    max_tokens: int
    sampling: Sampling
    timeout_s: float
    converge_timeout_s: float
    base_env: dict[str, str] = attrs.field(repr=False)  # the runner's environment: it may hold secrets
    run_dir: Path | None = None
    grace_s: float = 5.0
    serve: bool = False  # keep the cluster up for the OpenAI API until stopped, instead of one prompt
    token: str | None = attrs.field(default=None, repr=False)  # the cluster token, the nodes' own; None: random
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)  # the clients' keys; none: one random, printed
    host: str | None = None  # the interface stage 0 (the API) listens on; None: 127.0.0.1, as the other stages
    port: int | None = None  # stage 0's port, so pp-entry's URL stays the same across runs; None: any
    model_name: str | None = None  # what the API calls the model (what the user named); None: `model`
    standby: int = 0  # --serve: warm spares that take a lost stage (runner/standby.py)


async def run_seed(opts: SeedOptions, progress: Callable[[str], None], *, on_text: Callable[[str], None] = lambda t: None,
                   announce: Callable[[str], None] = print) -> RunResult:
    """One prompt through a fresh local cluster (its text handed to `on_text` as it comes), or with
    `serve`, the cluster kept up until a signal (raises Stopped) or a failure (RunFailed)."""
    run_dir = opts.run_dir or Path(tempfile.mkdtemp(prefix="ppsmoke-"))
    token = opts.token or secrets.token_urlsafe(24)  # fresh per run: only this run's nodes can talk
    given = bool(opts.api_keys)
    opts = attrs.evolve(opts, api_keys=opts.api_keys or (secrets.token_urlsafe(24),))  # the clients' key(s)
    use = Use(opts.prompt, opts.max_tokens, opts.sampling, opts.timeout_s, opts.model_name or opts.model,
              api_key=opts.api_keys[0], key_given=given, serve=opts.serve, on_text=on_text, announce=announce)
    children: list[Child] = []
    started = time.monotonic()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(fail_on_signals, serving=opts.serve))
            orch = await nursery.start(functools.partial(run_orchestrator, token))
            progress(f"runner is the gossip seed at {orch.url}; logs in {run_dir}")
            await _start_children(nursery, opts, token, orch.url, run_dir, children, progress)
            converged = await _converge(orch, opts, children, started, progress)
            if opts.serve:
                standbys = Standbys(opts.standby, functools.partial(_start_standby, opts, token, orch.url, orch.swim, run_dir,
                                                                    itertools.count()), progress,
                                    settled=functools.partial(settled_through, orch.swim))
                nursery.start_soon(standbys.run)
                replace = functools.partial(_replace, nursery, opts, token, orch, run_dir, children, progress,
                                            standbys)
                holders = {c.stage: LocalHolder(c) for c in children}
                await serve(orch, use, keep=functools.partial(
                    keep_stages, orch.swim, holders, replace, ready_timeout_s=opts.converge_timeout_s,
                    progress=progress, on_replaced=functools.partial(announce_entry, use),
                    retire=functools.partial(_retire, opts, progress)))
            result = await answer_once(orch, use, converged=converged, started=started,
                                       num_stages=opts.num_stages, run_dir=run_dir)
            nursery.cancel_scope.cancel()  # done: stop every node
    except BaseExceptionGroup as group:
        failure = first_failure(group)
        if isinstance(failure, RunFailed):
            failure = RunFailed(f"{failure}\n{_tail_of(children, _stage_named(str(failure)))}")
        raise failure from None
    return result


async def _exit_of(child: Child) -> Child:
    await child.exited.wait()
    return child


def _stage_named(message: str) -> int | None:
    """The stage a failure message blames ("stage 2 ..."), to show the end of its log."""
    match = re.search(r"\bstage (\d+)", message)
    return int(match.group(1)) if match else None


@attrs.frozen
class LocalHolder:
    """A stage's node process, as runner/keeper.py sees it."""

    child: Child

    @property
    def url(self) -> str:
        return self.child.url

    async def ended(self) -> str:
        await self.child.exited.wait()
        return f"(pid {self.child.process.pid}) exited with code {self.child.process.returncode}"


def fixed_address(opts: SeedOptions, stage: int) -> tuple[str, int] | None:
    """Where a stage must listen, if it is not a port of its own choosing: stage 0 with --port."""
    if stage == 0 and opts.port is not None:
        return (opts.host or LOOPBACK, opts.port)
    return None


async def _retire(opts: SeedOptions, progress: Callable[[str], None], holder: LocalHolder) -> None:
    """Before a holder that is gone is replaced: on a fixed port, the old process is stopped and the port freed
    (runner/ports.py), so that the replacement never races it; on any other port it is left to step aside."""
    where = fixed_address(opts, holder.child.stage)
    if where is not None:
        took_s = await stop_and_free_port(holder.child.process, *where, grace_s=opts.grace_s, progress=progress)
        progress(f"stage {holder.child.stage}: pid {holder.child.process.pid} stopped and {where[0]}:{where[1]} "
                 f"free after {took_s:.1f} s")


async def _start_children(nursery, opts, token, seed_url, run_dir, children, progress) -> None:
    """Every stage at once, each on a port picked here, so that each can be handed its predecessor's address
    as PEER_DIRECT before that one listens (the spec's chain of direct peers; gossip's join retries until it
    answers). Started one after another, each waited for the one before to import and listen (issue 36)."""
    ports = [where[1] if (where := fixed_address(opts, stage)) else free_port() for stage in range(opts.num_stages)]
    started: list[Child | None] = [None] * opts.num_stages

    async def start(stage: int) -> None:
        peer = f"{SCHEME}://{LOOPBACK}:{ports[stage - 1]}" if stage > 0 else None
        started[stage] = child = await _start_child(nursery, opts, token, seed_url, stage, peer,
                                                    run_dir / f"stage{stage}.log", port=ports[stage])
        progress(f"stage {stage}/{opts.num_stages - 1} listening at {child.url} (pid {child.process.pid})")

    async with trio.open_nursery() as starting:
        for stage in range(opts.num_stages):
            starting.start_soon(start, stage)
    children.extend(started)


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now, for a stage to listen on in a moment."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


async def _start_child(nursery, opts, token, seed_url, stage, peer, log_path, *, port: int | None = None) -> Child:
    """One node process. Serving, its exit is the keeper's to handle, not a failure of the run."""
    env = node_env(opts, token, seed_url, stage, peer)
    if port is not None:
        env["PP_PORT"] = str(port)
    return await nursery.start(functools.partial(run_child, stage, env, log_path, grace_s=opts.grace_s,
                                                 supervised=opts.serve))


def node_env(opts: SeedOptions, token: str, seed_url: str, stage: int, peer: str | None) -> dict[str, str]:
    """A stage's environment. Stage 0 listens where --host and --port say (the API's address); the others on
    127.0.0.1 and any free port, which only the cluster dials."""
    env = child_env(opts.base_env, stage=stage, num_stages=opts.num_stages, token=token, model=opts.model,
                    seed=seed_url, peer=peer, api_keys=opts.api_keys)
    if (where := fixed_address(opts, stage)) is not None:
        env["PP_PORT"] = str(where[1])
    if stage == 0 and opts.host is not None:
        env["PP_BIND"] = opts.host  # a wildcard is advertised to the cluster as 127.0.0.1 (node/config/network.py)
    env["PP_MODEL_NAME"] = opts.model_name or opts.model
    return env


async def _replace(nursery, opts, token, orch, run_dir, children, progress, standbys, stage, attempt) -> LocalHolder:
    """A warm spare takes the stage where one is ready (not stage 0); else a new process starts for it."""
    child = await standbys.take(stage)
    if child is not None:
        progress(f"stage {stage}: standby {child.log_path.stem} took it, listening at {child.url} "
                 f"(pid {child.process.pid})")
    else:
        child = await _start_child(nursery, opts, token, orch.url, stage, None,
                                   run_dir / f"stage{stage}.r{attempt}.log")
        progress(f"stage {stage}: replacement listening at {child.url} (pid {child.process.pid})")
    children.append(child)
    return LocalHolder(child)


async def settled_through(swim, child: Child) -> None:
    """Until stage 0 gossips its chain as settled (Meta.settled) with the member at the child's address in it."""
    def through(s) -> bool:
        entry, member = s.resolve(stage_name(0)), next((m for m in s.alive() if m.addr == child.url), None)
        return entry is not None and member is not None and member.id in entry.meta.settled
    await swim.wait_until(through)


async def swim_split(swim, num_stages: int) -> tuple[int, ...]:
    """The split the cluster's stages gossip (each gossips the one it loaded)."""
    return await swim.wait_until(lambda s: gossiped_plan(s.members().values(), s.me.id, num_stages))


async def _start_standby(opts, token, seed_url, swim, run_dir, numbers, place, task_status=trio.TASK_STATUS_IGNORED):
    """One spare, for Standbys: a node with every stage's environment but a stage of its own."""
    env = node_env(opts, token, seed_url, 1, None)
    del env["STAGE"]
    # a spare loads every stage's range of the split the cluster runs (planned at its boot: it is in gossip)
    env["PP_LAYER_PARTITION"] = ",".join(map(str, await swim_split(swim, opts.num_stages)))
    await run_standby(env, run_dir / f"standby{next(numbers)}.log", grace_s=opts.grace_s, task_status=task_status)


async def _converge(orch: Orchestrator, opts, children, started, progress) -> float:
    progress(f"waiting for {opts.num_stages} stages to load and join ...")

    async def converged():
        await orch.converge(opts.num_stages)

    async def exited():  # serving, children that exit do not raise: one that does before converging fails the run
        return await race(*[functools.partial(_exit_of, c) for c in children])

    died = None
    with trio.move_on_after(opts.converge_timeout_s) as scope:
        async with trio.open_nursery() as watching:
            watching.start_soon(report_phases, orch.swim, opts.num_stages, progress, started)
            died = await race(converged, exited)
            watching.cancel_scope.cancel()
    if died is not None:
        raise RunFailed(f"stage {died.stage} exited with code {died.process.returncode} before the cluster "
                        f"converged")
    if scope.cancelled_caught:
        alive = {m.meta.stage for m in orch.swim.alive() if m.meta.stage is not None}
        missing = [c.stage for c in children if c.stage not in alive]
        tails = "\n".join(f"stage {s}:\n{_tail_of(children, s)}" for s in missing)
        raise RunFailed(f"the cluster did not converge within {opts.converge_timeout_s:.0f} s; "
                        f"stages not alive: {missing}\n{tails}")
    now = time.monotonic()
    progress(f"converged in {now - started:.1f} s; pp-entry is ready")
    line = split_line(orch.swim.members().values(), opts.num_stages)
    if line:
        progress(line)
    return now


def _tail_of(children: list[Child], stage: int | None) -> str:
    child = next((c for c in reversed(children) if c.stage == stage), None)  # the latest holder
    return log_tail(child.log_path) if child else "    (no log)"
