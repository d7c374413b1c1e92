"""--serve: keep every stage of the cluster staffed. When a stage's holder is gone — gossip declares its
member dead, or its process or instance ended — start a replacement for the same stage and wait until it
has joined, loaded its slice and is ready. Stage 0 holds its requests meanwhile (it admits none and
computes nothing while a stage is missing) and replays them through the new chain (roles/first.py).
Stage 0 itself is where clients connect: when it goes, their streams go with it; its replacement serves
new requests, and the other stages free the slots of the old entry's requests
(node/downstream.py, DownstreamStage.watch).

A holder that was only frozen is not killed here: once it wakes it learns it was declared dead and exits
by itself (node.main.step_aside_when_replaced); the run's teardown stops whatever is left. The exception is
whatever `retire` does first: a local stage on a fixed port is stopped, so that its replacement can listen
there (runner/ports.py). A retire that fails ends the run: no replacement could take the stage."""
from __future__ import annotations

from typing import Awaitable, Callable, Protocol, TypeVar

import trio

from node.membership.gossip import TERMINAL
from node.groups import unwrapped
from node.membership.swim import Swim

from .children import StageExited
from .common import RunFailed

T = TypeVar("T")
REPLACE_ATTEMPTS = 3  # a replacement that dies before it is ready is retried; then the run fails


class NotReady(RunFailed):
    """A replacement that ended, or was not ready in time; it is retired before the next try."""

    def __init__(self, holder: Holder, why: str):
        super().__init__(f"{holder.url} {why} before it was ready")
        self.holder = holder


class Holder(Protocol):
    """Whoever holds a stage now: a local process, a rented instance."""

    url: str

    async def ended(self) -> str: ...  # returns, saying why, once the process or instance is gone


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


async def declared_dead(swim: Swim, member_id: str) -> str:
    """Once gossip declares the member dead (or left). By id: a replacement may reuse the address."""
    member = await swim.wait_until(lambda s: (m := s.members().get(member_id)) is not None
                                   and m.state in TERMINAL and m)
    return f"was declared {member.state.value} by gossip"


def ready_member(swim: Swim, stage: int, url: str, *, retired: set[str] = frozenset()):
    """The member at `url` that holds `stage`, is alive and has loaded its slice, and is none of `retired`
    (the ones it replaces, which may have had the same address); else None."""
    return next((m for m in swim.members().values() if m.addr == url and m.meta.stage == stage and m.meta.ready
                 and m.state not in TERMINAL and m.id not in retired), None)


async def keep_stages(swim: Swim, holders: dict[int, Holder], replace: Callable[[int, int], Awaitable[Holder]], *,
                      ready_timeout_s: float, progress: Callable[[str], None],
                      on_replaced: Callable[[int, Holder], None] = lambda stage, holder: None,
                      retire: Callable[[Holder], Awaitable[None]] | None = None) -> None:
    """Replace each stage's holder whenever it is gone, until cancelled. `replace(stage, attempt)` starts a
    new holder; `retire(holder)` disposes of one that is gone (a rented instance is destroyed; a local
    process is left to exit by itself); `on_replaced` hears of each new one once it is ready. Raises
    RunFailed when a stage cannot be replaced in REPLACE_ATTEMPTS tries."""
    members = {stage: ready_member(swim, stage, holder.url) for stage, holder in holders.items()}
    missing = [stage for stage, member in members.items() if member is None]
    if missing:
        raise RunFailed(f"stages {missing} are not alive and ready in gossip")
    with unwrapped(RunFailed):
        async with trio.open_nursery() as nursery:
            for stage, holder in holders.items():
                nursery.start_soon(_keep, swim, stage, holder, members[stage].id, replace, ready_timeout_s,
                                   progress, on_replaced, retire)


async def _keep(swim, stage, holder, member_id, replace, ready_timeout_s, progress, on_replaced, retire) -> None:
    attempt, retired = 0, set()
    while True:
        why = await race(holder.ended, lambda: declared_dead(swim, member_id))
        lost_at = trio.current_time()
        swim.confirm_dead(member_id)  # its process or instance is gone: no view need wait out a suspicion
        retired.add(member_id)
        held = "requests in flight wait" if stage else "its requests in flight were lost with it"
        progress(f"stage {stage} at {holder.url} {why}; starting a replacement ({held})")
        if retire is not None:
            await retire(holder)
        for _ in range(REPLACE_ATTEMPTS):
            attempt += 1
            try:
                holder, member_id = await _start_ready(swim, stage, replace, attempt, ready_timeout_s, retired)
                break
            except (StageExited, RunFailed) as exc:
                progress(f"stage {stage}: replacement {attempt} failed: {str(exc).splitlines()[0]}")
                if isinstance(exc, NotReady) and retire is not None:
                    await retire(exc.holder)  # outside the try: a retire that fails ends the run
        else:
            raise RunFailed(f"stage {stage} could not be replaced: {REPLACE_ATTEMPTS} replacements in a row "
                            f"failed (see the logs above)")
        resumed = "requests in flight resume" if stage else "new requests are served"
        progress(f"stage {stage} replaced in {trio.current_time() - lost_at:.1f} s by {holder.url}; {resumed}")
        on_replaced(stage, holder)


async def _start_ready(swim, stage, replace, attempt, ready_timeout_s, retired) -> tuple[Holder, str]:
    """A new holder for the stage and its member id, once it is ready; NotReady if it ends first or takes too
    long."""
    holder = await replace(stage, attempt)

    async def ready():
        return await swim.wait_until(lambda s: ready_member(s, stage, holder.url, retired=retired))

    with trio.move_on_after(ready_timeout_s) as scope:
        outcome = await race(ready, holder.ended)
    if scope.cancelled_caught or isinstance(outcome, str):
        raise NotReady(holder, f"not ready within {ready_timeout_s:.0f} s" if scope.cancelled_caught else outcome)
    return holder, outcome.id
