"""Turns at the node's request-preparation threads (parsing, schema compiling, rendering, tokenizing), shared
fairly among client keys: each key's waiters queue on their own, and a freed thread goes to the next key in turn,
so one key's burst of costly requests delays another key's cheap one by at most one turn per key ahead of it,
not by the whole burst (round 3's finding 7: a bystander's 4-token chat waited 3.0-3.8 s behind 16 threads of
128-tool requests, first come first served).

`Turns` is the decision, pure and table-tested (tests/test_fair_turns.py); `FairLimiter` is the trio glue.
"""
from __future__ import annotations

import collections
from contextlib import asynccontextmanager
from typing import Generic, Hashable, TypeVar

import trio

W = TypeVar("W")


class Turns(Generic[W]):
    """Waiters queued per key; `next` serves the keys round robin, each key's own in arrival order."""

    def __init__(self):
        self._queues: collections.OrderedDict[Hashable, collections.deque[W]] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._queues)

    def add(self, key: Hashable, waiter: W) -> None:
        self._queues.setdefault(key, collections.deque()).append(waiter)

    def next(self) -> W:
        """The oldest waiter of the key whose turn it is; that key goes to the back of the round."""
        key, queue = next(iter(self._queues.items()))
        waiter = queue.popleft()
        if queue:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]
        return waiter

    def remove(self, key: Hashable, waiter: W) -> bool:
        """Take a waiter out of line (it was cancelled); False where it is no longer queued."""
        queue = self._queues.get(key)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._queues[key]
        return True


class FairLimiter:
    """`slots` holders at a time; the others wait their key's turn (Turns). A freed slot passes straight to the
    waiter whose turn it is, so no newcomer can take it in between."""

    def __init__(self, slots: int):
        self.free, self._turns = slots, Turns[trio.Event]()

    @asynccontextmanager
    async def hold(self, key: Hashable):
        if self.free and not self._turns:
            self.free -= 1
        else:
            event = trio.Event()
            self._turns.add(key, event)
            try:
                await event.wait()
            except BaseException:
                if not self._turns.remove(key, event):  # the slot was handed over as we were cancelled
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        if self._turns:
            self._turns.next().set()  # the slot passes on, still held
        else:
            self.free += 1
