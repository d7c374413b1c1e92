"""--serve: keep every stage of the cluster staffed. When a stage's holder is gone — gossip declares its
member dead, or its process or instance ended — start a replacement for the same stage and wait until it
has joined, loaded its slice and is ready. Stage 0 holds its requests meanwhile (it admits none and
computes nothing while a stage is missing) and replays them through the new chain (roles/first.py).

A holder that was only frozen is not killed here: once it wakes it learns it was declared dead and exits
by itself (node.main.step_aside_when_replaced); the run's teardown stops whatever is left."""
from __future__ import annotations

import time
from typing import Awaitable, Callable, Protocol, TypeVar

import trio

from node.gossip import TERMINAL
from node.swim import Swim

from .children import StageExited
from .common import RunFailed

T = TypeVar("T")
REPLACE_ATTEMPTS = 3  # a replacement that dies before it is ready is retried; then the run fails


class Holder(Protocol):
    """Whoever holds a stage now: a local process, a rented instance."""

    url: str

    async def gone(self) -> str: ...  # returns, saying why, once the holder will serve no more


async def race(*fns: Callable[[], Awaitable[T]]) -> T:
    """The result of whichever of `fns` returns first; the others are cancelled."""
    result: list[T] = []
    async with trio.open_nursery() as nursery:
        async def one(fn):
            result.append(await fn())
            nursery.cancel_scope.cancel()
        for fn in fns:
            nursery.start_soon(one, fn)
    return result[0]


async def declared_dead(swim: Swim, url: str) -> str:
    """Once gossip declares the member at `url` dead (or left)."""
    member = await swim.wait_until(lambda s: next(
        (m for m in s.members().values() if m.addr == url and m.state in TERMINAL), None))
    return f"was declared {member.state.value} by gossip"


def ready_at(swim: Swim, stage: int, url: str) -> bool:
    """Whether the member at `url` is alive, holds `stage` and has loaded its slice."""
    return any(m.addr == url and m.meta.stage == stage and m.meta.ready and m.state not in TERMINAL
               for m in swim.members().values())


async def keep_stages(swim: Swim, holders: dict[int, Holder], replace: Callable[[int, int], Awaitable[Holder]], *,
                      ready_timeout_s: float, progress: Callable[[str], None]) -> None:
    """Replace each stage's holder whenever it is gone, until cancelled. `replace(stage, attempt)` starts a
    new holder. Raises RunFailed when a stage cannot be replaced in REPLACE_ATTEMPTS tries."""
    async with trio.open_nursery() as nursery:
        for stage, holder in holders.items():
            nursery.start_soon(_keep, swim, stage, holder, replace, ready_timeout_s, progress)


async def _keep(swim, stage, holder, replace, ready_timeout_s, progress) -> None:
    attempt = 0
    while True:
        why = await holder.gone()
        lost_at = time.monotonic()
        progress(f"stage {stage} at {holder.url} {why}; starting a replacement (requests in flight wait)")
        for _ in range(REPLACE_ATTEMPTS):
            attempt += 1
            try:
                holder = await _start_ready(swim, stage, replace, attempt, ready_timeout_s)
                break
            except (StageExited, RunFailed) as exc:
                progress(f"stage {stage}: replacement {attempt} failed: {str(exc).splitlines()[0]}")
        else:
            raise RunFailed(f"stage {stage} could not be replaced: {REPLACE_ATTEMPTS} replacements in a row "
                            f"failed (see the logs above)")
        progress(f"stage {stage} replaced in {time.monotonic() - lost_at:.1f} s by {holder.url}; "
                 f"requests in flight resume")


async def _start_ready(swim, stage, replace, attempt, ready_timeout_s) -> Holder:
    """A new holder for the stage, once it is ready; RunFailed if it is gone first or takes too long."""
    holder = await replace(stage, attempt)

    async def ready() -> str:
        await swim.wait_until(lambda s: ready_at(s, stage, holder.url))
        return ""

    with trio.move_on_after(ready_timeout_s) as scope:
        why = await race(ready, holder.gone)
    if scope.cancelled_caught:
        raise RunFailed(f"not ready within {ready_timeout_s:.0f} s")
    if why:
        raise RunFailed(f"{holder.url} {why} before it was ready")
    return holder
