"""Stage 0's KV budget (issue 39): which prefix-cache entries to evict, and which running requests to preempt,
so that every stage's KV fits the chain's budget in positions (node/kv_memory.py). Pure: figures in, decision
out; roles/first.py applies it.

Every stage holds KV for the same positions: each running request's prompt and generated tokens so far (its
`next_position`), and each prefix-cache entry's. So stage 0 alone can count what every stage holds.

- A new request starts once its prompt fits, after evicting entries (least recently used first). It never
  preempts a running one: it waits at the door, first in, first out, behind any preempted request.
- A running request's next token needs one more position. Where none is free, entries are evicted first;
  failing that, the newest running request is preempted (vLLM's recompute preemption, newest = lowest
  priority), which may be the growing request itself. A preempted request's slot is freed on every stage, and
  it waits first in line; when its positions fit again, its prompt and generated tokens are prefilled as a
  replay's are (roles/first.py), and greedy decoding goes on with the same tokens.
- The budget is at least one whole context (node/kv_memory.py), so a request running alone always has room.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from .prefix_cache import PrefixCache


@attrs.frozen
class Room:
    evict: tuple[str, ...] = ()  # prefix-cache entries to forget
    preempt: tuple[str, ...] = ()  # running requests to preempt, in order


def make_room(need: int, *, budget: int | None, used: int, entries: Sequence[tuple[str, int]] = (),
              running: Sequence[tuple[str, int]] = (), grower: str = "") -> Room | None:
    """What frees `need` positions beside the `used` ones within `budget` (None: no budget, nothing to free).
    `entries`: evictable prefix-cache entries and their positions, the first to go first; `running`: requests
    that may be preempted and their positions, the first to go first. Preempting `grower` (the request whose
    next token needs the room) frees its need too. None: even all of that leaves too little room."""
    if budget is None:
        return Room()
    free, evict, preempt = budget - used, [], []
    for name, positions in entries:
        if free >= need:
            break
        evict.append(name)
        free += positions
    for rid, positions in running:
        if free >= need:
            break
        preempt.append(rid)
        if rid == grower:
            return Room(tuple(evict), tuple(preempt))
        free += positions
    return Room(tuple(evict), tuple(preempt)) if free >= need else None


class KvBook:
    """Stage 0's count of the KV positions every stage holds, against the chain's `budget` (None: none set,
    as before the chain is ready, or a node that sizes nothing): each running request's positions, given as
    `running` (request id -> positions, oldest first), and every prefix-cache entry's (`cache`). Event loop."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.budget: int | None = None
        self.preemptions = 0  # vLLM's num_preemptions

    def used(self, running: Mapping[str, int]) -> int:
        return sum(running.values()) + self.cache.positions()

    def room(self, running: Mapping[str, int], need: int, *, drop: tuple[str, ...] = (),
             keep: tuple[str, ...] = (), grower: str = "") -> Room | None:
        """What frees `need` positions (make_room): evicting entries but `keep` (those in `drop` go anyway),
        and, for a running request's next token (`grower`), preempting the newest requests."""
        used = self.used(running) - sum(self.cache.positions(name) for name in drop)
        if self.budget is None or used + need <= self.budget:
            return Room()  # the usual case, at every token: nothing to list
        newest = [(rid, running[rid]) for rid in reversed(running)] if grower else []
        return make_room(need, budget=self.budget, used=used, entries=self.cache.evictable((*drop, *keep)),
                         running=newest, grower=grower)

    def health(self, running: Mapping[str, int]) -> dict:
        return {"budget_positions": self.budget, "used_positions": self.used(running),
                "preemptions": self.preemptions}
