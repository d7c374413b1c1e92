"""Which of a slice's `max_seqs` sequence slots (KV caches) each request holds, and the position it is at.

A request takes a slot with its step at position 0 and holds it until released. Its first step may instead
name a prefix-cache entry (StepItem.from_cache, worker/kept.py): it then starts at that position, in the
entry's very slot (`take`) or in a free slot the entry's rows are copied into. A slot is needed and none is
free: the least recently used entry gives up its own. Compute thread only, but for `len`.

A replay (issue 36): `restart` marks a request whose next item begins a new life. That life keeps the slot
and the KV it holds (`held`: the positions of the earlier life, the same tokens), and may start at any
position up to there; worker/stage.py then computes only what the slot lacks (worker/resume.py).
"""
from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from .contract import FromCache, Sampling, StepItem
from .errors import WorkerError
from .kept import KeptRows, KeptSlots
from .sampling import rng_for


@attrs.define
class Request:
    slot: int
    next_position: int
    sampling: Sampling
    rng: np.random.Generator
    rows: KeptRows = attrs.Factory(KeptRows)  # first and middle stages: the output rows passed on
    held: int = 0  # this life's first positions whose KV an earlier life left in the slot
    restarting: bool = False  # the next item begins a new life

    @property
    def valid(self) -> int:
        """Positions whose KV the slot holds: what this life computed, or an earlier one left."""
        return max(self.held, self.next_position)


class Slots:
    """`copy_rows(source, slot, n)` gives a slot another's first n KV rows (the slice's: True where it maps their
    very pages, worker/kv_pages.py, False where it copies them); `trim(slot)`
    gives back the memory of a slot's KV that no one will read: a released request's, and a slot's before a
    new request takes it (an entry evicted or forgotten), so a stage's KV memory follows what its slots hold.
    Rows that slots share are copied before one of them writes them, whatever brought it there (the slice's
    step does it: worker/kv_pages.py), so a taken entry needs nothing more here."""

    def __init__(self, *, stage: int, max_seqs: int, max_context: int, copy_rows: Callable[[int, int, int], bool],
                 trim: Callable[[int], None] = lambda slot: None):
        self.stage, self.max_seqs, self.max_context, self._copy_rows = stage, max_seqs, max_context, copy_rows
        self._trim = trim
        self.requests: dict[str, Request] = {}
        self.kept = KeptSlots(stage)
        self.rows_moved = {"shared": 0, "copied": 0}  # prefix-cache rows a start mapped, or copied

    def __len__(self) -> int:
        return len(self.requests)

    def positions(self) -> tuple[int, int]:
        """KV positions the slots hold: requests' (each what its slot holds) and prefix-cache entries'; any
        thread (tuple() copies a dict's values without letting another thread in)."""
        return sum(r.valid for r in tuple(self.requests.values())), self.kept.positions()

    def admit(self, item: StepItem, planned: dict[str, int], starting: dict[str, Request]) -> Request:
        """Check one step's place and return its request; a step at position 0 of an unknown one starts it
        (in `starting`, kept only once its batch has computed). `planned`: the next position per request,
        counting earlier items of the batch."""
        rid, position = item.request_id, item.position
        if position + item.rows > self.max_context:
            raise WorkerError(f"request {rid!r}: position {position} + {item.rows} tokens exceeds the "
                              f"context of {self.max_context}")
        req = self.requests.get(rid) or starting.get(rid)
        if req is not None and req.restarting:
            req = self._resume(req, item)
        if req is None:
            if position != 0 and not (item.from_cache and item.from_cache.entry):
                raise WorkerError(f"unknown request {rid!r} (never started here, or released)")
            req = starting[rid] = self._start(item, starting)
        expected = planned.get(rid, req.next_position)
        if position != expected:
            raise WorkerError(f"request {rid!r}: got position {position}, expected {expected}")
        planned[rid] = position + item.rows
        return req

    def known(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise WorkerError(f"unknown request {request_id!r} (never started here, or released)")
        return req

    def release(self, request_id: str, *, keep_as: str = "") -> None:
        """Free a request's slot, or (`keep_as`) keep its KV as the prefix-cache entry of that name; an unknown
        request is a no-op."""
        req = self.requests.pop(request_id, None)
        if req is not None and keep_as:
            self.kept.keep(keep_as, req.slot, req.next_position, req.rows.below(req.next_position))
        elif req is not None:
            self._trim(req.slot)

    def forget(self, entries) -> None:
        """Forget prefix-cache entries and give their slots' memory back (EndReason.DROPPED)."""
        for slot in self.kept.forget(entries):
            self._trim(slot)

    def restart(self, request_id: str) -> None:
        """The request's next item begins a new life, which keeps the slot and what it holds; an unknown
        request (never started here, or released) starts afresh."""
        req = self.requests.get(request_id)
        if req is not None:
            req.restarting = True

    def _resume(self, req: Request, item: StepItem) -> Request | None:
        """The new life's first item, in the slot of the earlier one; None where it starts past what the slot
        holds (the slot is freed: the item starts afresh). A prefix-cache entry the item names is not needed:
        one it was to take is given up, as stage 0 counts it taken."""
        rng = rng_for(item.sampling)  # a bad seed fails this request alone, before anything changes
        if item.position > req.valid:
            self.requests.pop(item.request_id)
            return None
        start = item.from_cache or FromCache()
        self.forget(start.drop)
        if start.take and start.entry:
            self.forget([start.entry])
        req.held, req.next_position, req.restarting = req.valid, item.position, False
        req.sampling, req.rng = item.sampling, rng
        return req

    def _start(self, item: StepItem, starting: dict[str, Request]) -> Request:
        """A request's slot: a free one, or its cached prefix's (taken, or copied into a free one)."""
        rng = rng_for(item.sampling)  # a bad seed fails this request alone, before any slot changes
        start = item.from_cache or FromCache()
        self.forget(start.drop)
        if not start.entry:
            return Request(self._free_slot(item, starting), 0, item.sampling, rng)
        source = self.kept.source(start.entry, item.position, item.request_id)
        rows = self.kept.rows(start.entry).below(item.position)
        if start.take:  # continued from item.position, in the entry's own slot
            return Request(self.kept.take(start.entry), item.position, item.sampling, rng, rows)
        slot = self._free_slot(item, starting, keep=start.entry)
        self.rows_moved["shared" if self._copy_rows(source, slot, item.position) else "copied"] += item.position
        return Request(slot, item.position, item.sampling, rng, rows)

    def _free_slot(self, item: StepItem, starting: dict[str, Request], keep: str = "") -> int:
        """A slot no request or entry holds; failing that, the least recently used entry's other than `keep`
        (entries stage 0 no longer counts, such as those of a chain before a stage was replaced)."""
        taken = {r.slot for r in (*self.requests.values(), *starting.values())} | self.kept.slots()
        free = next((s for s in range(self.max_seqs) if s not in taken), None)
        if free is None and (free := self.kept.evict(other_than=keep)) is None:
            raise WorkerError(f"request {item.request_id!r}: all {self.max_seqs} sequence slots of stage "
                              f"{self.stage} are taken")
        self._trim(free)  # what an evicted or forgotten entry left there
        return free
