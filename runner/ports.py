"""A replacement never races its predecessor for a port.

Stage 0 listens on --port when one is given, so that the API's address stays the same across replacements;
its replacement therefore needs the very port the old process holds. Gossip may declare that process dead
while it still runs (frozen, or too busy under a flood to answer probes), and a replacement started then
fails at once with "Address already in use"; a few such failures in a row end the run. So before starting a
replacement on a fixed port, the runner stops the old process (SIGTERM; SIGKILL if it is still there after
the grace period) and waits until the port can be bound, bounded: past the bound the run fails, naming the
port and what holds it.

A stage on a port of its own choosing (PP_PORT=0) needs none of this: its predecessor is left to step aside
by itself (runner/keeper.py). On vast.ai a replacement is another instance, at ports of its own.
"""
from __future__ import annotations

import enum
from typing import Callable

import trio

from node.transport.app import ListenError, check_listenable

from .common import RunFailed

# After SIGKILL the kernel frees a process's sockets as it reaps it; a port still taken this long after is
# held by someone else (a process the node forked, another program), and waiting longer would not help.
FREE_AFTER_KILL_S = 10.0
PROBE_EVERY_S = 0.05  # a port's release has no event to wait on; a process's exit has, and ends the wait at once


class PortHeld(RunFailed):
    """The port a replacement needs is still taken after the old process was stopped: no replacement can start."""


class Step(enum.Enum):
    START = "start"  # the old process is gone and its port is free: the replacement may start
    WAIT = "wait"
    KILL = "kill"  # the grace period after SIGTERM is over
    FAIL = "fail"  # still taken FREE_AFTER_KILL_S after SIGKILL


def next_step(*, exited: bool, port_free: bool, killed: bool, waited_s: float, grace_s: float,
              free_after_kill_s: float = FREE_AFTER_KILL_S) -> Step:
    """What to do about a predecessor `waited_s` after it was sent SIGTERM. A process that has exited is
    killed all the same at the end of the grace period (a no-op), so one bound covers a port held by another."""
    if exited and port_free:
        return Step.START
    if not killed:
        return Step.KILL if waited_s >= grace_s else Step.WAIT
    return Step.FAIL if waited_s >= grace_s + free_after_kill_s else Step.WAIT


def port_is_free(host: str, port: int) -> bool:
    """Whether a node could listen on (host, port) now: the bind probe ppnode itself makes before serving."""
    try:
        check_listenable(host, port)
    except ListenError:
        return False
    return True


async def stop_and_free_port(process: trio.Process, host: str, port: int, *, grace_s: float,
                             progress: Callable[[str], None],
                             free_after_kill_s: float = FREE_AFTER_KILL_S) -> float:
    """Stop `process` and wait until (host, port) can be bound; returns the seconds it took. Raises PortHeld
    naming the port when it is still taken `free_after_kill_s` after SIGKILL."""
    if process.returncode is None:
        process.terminate()
    started, killed = trio.current_time(), False
    while True:
        exited = process.returncode is not None
        step = next_step(exited=exited, port_free=port_is_free(host, port), killed=killed,
                         waited_s=trio.current_time() - started, grace_s=grace_s,
                         free_after_kill_s=free_after_kill_s)
        if step is Step.START:
            return trio.current_time() - started
        if step is Step.FAIL:
            holder = "another process" if exited else f"pid {process.pid}, still running after SIGKILL"
            raise PortHeld(f"port {host}:{port} is still taken ({holder}) "
                           f"{grace_s + free_after_kill_s:.0f} s after its old holder was stopped; "
                           f"no replacement can listen there")
        if step is Step.KILL:
            killed = True
            if not exited:
                progress(f"pid {process.pid} still holds {host}:{port} {grace_s:.0f} s after SIGTERM; SIGKILL")
                process.kill()
        if exited:
            await trio.sleep(PROBE_EVERY_S)
        else:
            with trio.move_on_after(PROBE_EVERY_S):
                await process.wait()
