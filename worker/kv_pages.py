"""KV caches whose slots share rows by mapping the same pages (issue 39: prefix rows shared, not copied).

On the CPU every block's KV cache is one host array of `slots` regions, a region being `rows` positions of
`row_bytes` each, and the attention kernels read slot s's position l at s * rows + l. Here that array is a
shared mapping of a memory file (memfd) with more regions than slots, and each slot's positions map, run by
run, onto file regions at the same positions:

- A fresh slot maps all its positions onto a region of its own.
- A slot that starts from another's first p positions (a prefix-cache hit) maps [0, p) onto the file pages the
  other's [0, p) maps to, and [p, rows) onto its own region: the kernels read the very same bytes, nothing is
  copied. It never writes below p (its computed positions start there), so the shared pages stay as they are.
- A slot no one reads any more (reset) drops its runs. A region no run maps any more gives its pages back
  (fallocate PUNCH_HOLE); one still mapped by another slot's prefix keeps its rows up to the last one mapped.

A run boundary must fall on a page: position p's bytes start on one where p * row_bytes is a multiple of the
page size (16 positions of a float16 row of 384 values are 3 pages). `share` says False where it cannot map
(the caller copies instead). `runs` and `free` are the bookkeeping; every change to the mappings goes through
`files.map_file` and `files.punch`. Compute thread only.
"""
from __future__ import annotations

import mmap

from .files import map_file, punch

SPARE = 3  # file regions per slot: its own, and room for regions other slots' prefixes keep alive


class KvPages:
    def __init__(self, maps: list, slots: int, rows: int, row_bytes: list[int]):
        """`maps`: each cache's (host array, memfd) from files.shared_zeros, with `slots * SPARE` regions of file
        behind `slots` regions of array; `row_bytes`: each cache's bytes a position."""
        self.maps, self.slots, self.rows, self.row_bytes = maps, slots, rows, row_bytes
        self.runs: list[list[tuple[int, int, int]]] = [[(0, rows, s)] for s in range(slots)]  # (from, to, region)
        self.free = list(range(slots * SPARE - 1, slots - 1, -1))  # regions no run maps; popped from the end

    def aligned(self, position: int) -> bool:
        return all(position * b % mmap.PAGESIZE == 0 for b in self.row_bytes)

    def share(self, src: int, dst: int, positions: int) -> bool:
        """Map dst's first `positions` onto what src's map to; dst must be fresh (reset). False: cannot (a
        boundary off a page, or too few spare regions left to reset every slot): the caller copies."""
        if not self.aligned(positions) or len(self.free) < self.slots or len(self.runs[dst]) != 1:
            return False
        own = self.runs[dst][0][2]  # fresh: its pages were given back when it was reset
        shared = [(a, min(b, positions), g) for a, b, g in self.runs[src] if a < positions]
        for a, b, g in shared:
            self._map(dst, a, b, g)
        self.runs[dst] = [*shared, (positions, self.rows, own)]
        return True

    def own_from(self, slot: int, position: int) -> None:
        """The slot's positions from `position` on are to be written again (a taken entry continued by a new
        request): any of them mapped onto another slot's pages map the slot's own region instead, the rows of
        a page split at `position` copied over, so no write reaches rows that others read."""
        own = self.runs[slot][-1][2]  # the last run is always the slot's own region
        if all(g == own or b <= position for a, b, g in self.runs[slot]):
            return
        lo = next(p for p in range(position, -1, -1) if self.aligned(p))
        kept = [host[slot * self.rows + lo:slot * self.rows + position].copy() for host, _ in self.maps]
        dropped = {g for a, b, g in self.runs[slot] if g != own and b > lo}
        self.runs[slot] = [(a, min(b, lo), g) for a, b, g in self.runs[slot] if g != own and a < lo]
        self.runs[slot].append((lo, self.rows, own))
        self._map(slot, lo, self.rows, own)
        for (host, _), rows in zip(self.maps, kept):
            host[slot * self.rows + lo:slot * self.rows + position] = rows
        for g in dropped:
            self._trim_region(g)

    def reset(self, slot: int) -> None:
        """No one reads the slot's rows any more: its runs go, each region no run maps gives its pages back,
        and the slot maps a region of its own, all of it."""
        if self.runs[slot] == [(0, self.rows, slot)] and self._unshared(slot):
            self._punch(slot, 0)  # the usual case: its own region, no one else's rows in it
            return
        regions = {g for _, _, g in self.runs[slot]}
        self.runs[slot] = []
        for g in regions:
            self._trim_region(g)
        own = slot if slot not in self._mapped() and slot in self.free else self._take_free(slot)
        self._map(slot, 0, self.rows, own)
        self.runs[slot] = [(0, self.rows, own)]

    def _take_free(self, slot: int) -> int:
        if not self.free:
            raise RuntimeError(f"slot {slot}: no free KV region left ({self.slots * SPARE} in all)")
        return self.free.pop()

    def _mapped(self) -> set[int]:
        return {g for runs in self.runs for _, _, g in runs}

    def _unshared(self, g: int) -> bool:
        return sum(r == g for runs in self.runs for _, _, r in runs) == 1

    def _trim_region(self, g: int) -> None:
        """Give back region g's rows that no run maps: above the last mapped row (all of it if none)."""
        ends = [b for runs in self.runs for _, b, r in runs if r == g]
        self._punch(g, max(ends, default=0))
        if not ends and g not in self.free:
            self.free.append(g)

    def _punch(self, g: int, keep: int) -> None:
        """Region g's pages from row `keep` on go back to the system."""
        if keep >= self.rows:
            return
        for (_, fd), row_bytes in zip(self.maps, self.row_bytes):
            lo = -(-(g * self.rows + keep) * row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            punch(fd, lo, (g + 1) * self.rows * row_bytes - lo)

    def _map(self, slot: int, a: int, b: int, g: int) -> None:
        if g in self.free:
            self.free.remove(g)
        for (host, fd), row_bytes in zip(self.maps, self.row_bytes):
            map_file(host, (slot * self.rows + a) * row_bytes, (b - a) * row_bytes, fd,
                     (g * self.rows + a) * row_bytes)
