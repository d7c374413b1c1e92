"""`ppsmoke.py --seed --serve --standby K`: K warm spares (node/standby.py), so that a lost stage is handed to a
node that has its slice loaded and its graphs captured, instead of to a process that must start, import, load
and capture first (issue 36).

The spares are started once the cluster has converged, so they take nothing from its boot, and a new one
whenever one ends, or takes a stage and the replays through it are over (stage 0 gossips its chain as settled,
Meta.settled): on a shared machine a spare's boot would slow those replays down.

Stage 0 is never handed to one (its streams end with it, and its replacement listens where the API was):
runner/keeper.py starts a process for it as without spares, and for any stage while no spare is ready. A spare that ends before it is ready is started again, up to
START_ATTEMPTS times in a row; then that place stays empty, which only makes failover slower."""
from __future__ import annotations

from typing import Awaitable, Callable

import trio

from .children import Child, StageExited, Standby
from .keeper import race

START_ATTEMPTS = 3
SETTLE_TIMEOUT_S = 120.0  # the most a new spare waits for the replays through the last taken one


class Standbys:
    """The ready spares. `start(place)` runs one until its process ends and reports it (with nursery.start)
    once ready; `run` keeps `count` of them; `take` hands one a stage."""

    def __init__(self, count: int, start: Callable, progress: Callable[[str], None],
                 settled: Callable[[Child], Awaitable[None]] | None = None):
        """`settled(child)`: until the cluster serves through the spare that became `child` with no replay
        left; the next spare starts only then (at most SETTLE_TIMEOUT_S later), since its boot would slow
        those replays down on a shared machine."""
        self.count, self._start, self._progress, self._settled = count, start, progress, settled
        self.ready: list[Standby] = []
        self._taken: dict[int, trio.Event] = {}  # id(standby) → set once it took a stage
        self._children: dict[int, Child] = {}  # id(standby) → the stage's node it became

    async def run(self) -> None:
        """Keep `count` spares until cancelled. Every spare's process is this nursery's, a taken one's too: it
        runs on as its stage's node."""
        async with trio.open_nursery() as nursery:
            for place in range(self.count):
                nursery.start_soon(self._keep, nursery, place)

    async def take(self, stage: int) -> Child | None:
        """A ready spare, now `stage`'s node (its Child once it listens), or None: stage 0, or none is ready.
        StageExited if the spare ends on the way (the keeper tries again)."""
        if stage == 0 or not self.ready:
            return None
        standby = self.ready.pop(0)
        try:
            self._children[id(standby)] = child = await standby.take(stage)
        finally:
            self._taken[id(standby)].set()
        return child

    async def _keep(self, nursery: trio.Nursery, place: int) -> None:
        failures = 0
        while failures < START_ATTEMPTS:
            started = trio.current_time()
            try:
                standby: Standby = await nursery.start(self._start, place)
            except StageExited as exc:
                failures += 1
                self._progress(f"standby {place}: {str(exc).splitlines()[0]}")
                continue
            failures = 0
            self._taken[id(standby)] = taken = trio.Event()
            self.ready.append(standby)
            self._progress(f"standby {place} ready in {trio.current_time() - started:.1f} s "
                           f"(pid {standby.process.pid}, log {standby.log_path.name})")
            await race(taken.wait, standby.exited.wait)
            if standby in self.ready:  # it ended while it waited, not while taking a stage
                self.ready.remove(standby)
                self._progress(f"standby {place} (pid {standby.process.pid}) exited with code "
                               f"{standby.process.returncode}; starting another")
            else:
                await taken.wait()  # it may have ended while taking its stage
                await self._after_take(standby)
            del self._taken[id(standby)]
        self._progress(f"standby {place}: {START_ATTEMPTS} spares in a row ended before they were ready; "
                       f"no more are started in its place")

    async def _after_take(self, standby: Standby) -> None:
        """Until the replays through the spare's stage are over (or it ended, or SETTLE_TIMEOUT_S passed)."""
        child = self._children.pop(id(standby), None)
        if child is not None and self._settled is not None:
            with trio.move_on_after(SETTLE_TIMEOUT_S):
                await race(lambda: self._settled(child), standby.exited.wait)
