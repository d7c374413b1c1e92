"""KV caches whose slots share rows by mapping the same pages (issue 39: prefix rows shared, not copied), copy on
write for every slot that maps them (issue 54).

On the CPU every block's KV cache is one host array of `slots` regions, a region being `rows` positions of
`row_bytes` each, and the attention kernels read slot s's position l at s * rows + l. Here that array is a
shared mapping of a memory file (memfd) with more regions than slots, and each slot's positions map, run by
run, onto file regions at the same positions:

- A fresh slot maps all its positions onto a region of its own.
- A slot that starts from another's first p positions (a prefix-cache hit) maps [0, p) onto the file pages the
  other's [0, p) maps to, and [p, rows) onto its own region: the kernels read the very same bytes, nothing is
  copied.
- Before a step writes a slot's rows from position p on (`writable`, called for every segment of every step,
  whatever brought the slot there: a start, a taken entry, a replay), no page it is about to write may be one
  another slot maps. Where one is, the pages are copied first: the writer's positions from p's page on move to a
  fresh region, the rows of that page below p copied over (a page's worth at most); where too few free regions
  are left for that, each other slot's run over those pages moves to its own region's same positions, copied
  whole. Either way every slot reads what it would read from a private copy (tests/test_kv_pages.py checks
  that property over random interleavings of starts, shares, takes, replays and resets).
- A slot no one reads any more (reset) drops its runs. A region no run maps any more gives its pages back
  (fallocate PUNCH_HOLE); one still mapped by another slot's prefix keeps its rows up to the last one mapped.

A run boundary must fall on a page: position p's bytes start on one where p * row_bytes is a multiple of the
page size (16 positions of a float16 row of 384 values are 3 pages). `share` says False where it cannot map
(the caller copies instead). `runs`, `refs` (runs mapping each region) and `free` are the bookkeeping; every
change to the mappings goes through `files.map_file` and `files.punch`. Compute thread only.
"""
from __future__ import annotations

import collections
import math
import mmap

from .files import map_file, punch

SPARE = 3  # file regions per slot: its own, and room for regions other slots' prefixes keep alive


class KvPages:
    def __init__(self, maps: list, slots: int, rows: int, row_bytes: list[int], spare: int = SPARE):
        """`maps`: each cache's (host array, memfd) from files.shared_zeros, with `slots * spare` regions of file
        behind `slots` regions of array; `row_bytes`: each cache's bytes a position."""
        self.maps, self.slots, self.rows, self.row_bytes = maps, slots, rows, row_bytes
        self.runs: list[list[tuple[int, int, int]]] = [[(0, rows, s)] for s in range(slots)]  # (from, to, region)
        self.refs = collections.Counter(range(slots))  # region -> runs that map it
        self.free = list(range(slots * spare - 1, slots - 1, -1))  # regions no run maps; popped from the end
        # positions a page boundary recurs at in every cache
        self.step = math.lcm(*(mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, b) for b in row_bytes))

    def aligned(self, position: int) -> bool:
        return position % self.step == 0

    def share(self, src: int, dst: int, positions: int) -> bool:
        """Map dst's first `positions` onto what src's map to; dst must be fresh (reset). False: cannot (a
        boundary off a page, or too few spare regions left to reset every slot): the caller copies."""
        if not self.aligned(positions) or len(self.free) < self.slots or len(self.runs[dst]) != 1:
            return False
        own = self.runs[dst][0][2]  # fresh: its pages were given back when it was reset
        shared = [(a, min(b, positions), g) for a, b, g in self.runs[src] if a < positions]
        for a, b, g in shared:
            self._map(dst, a, b, g)
        self._set_runs(dst, [*shared, (positions, self.rows, own)])
        return True

    def writable(self, slot: int, position: int) -> None:
        """The slot's rows from `position` on are about to be written: none of their pages may stay mapped by
        another slot (copy on write, see the module's docstring)."""
        lo = position // self.step * self.step  # the page `position` is on
        if all(self.refs[g] == 1 for _, b, g in self.runs[slot] if b > lo):
            return  # the usual case: no region it maps at or above lo is mapped twice
        readers = self._readers(slot, lo)
        if not readers:
            return
        own = self.runs[slot][-1][2]  # the last run is always the slot's own region
        readers = [r for r in readers if r[3] == own]  # those who started from this slot
        if readers and len(self.free) > self.slots:  # a region to spare beyond what resets may need
            own = self._take_free(slot)
        else:
            for other, a, b, g in readers:  # each onto its own region, where no one maps those rows
                self._unshare(other, max(a, lo), b, g)
        self._move(slot, lo, position, own)

    def _readers(self, slot: int, lo: int) -> list[tuple[int, int, int, int]]:
        """(other slot, from, to, region) of each run of another slot over a page the slot maps at or above lo:
        runs map positions to the same rows, so pages overlap where positions do."""
        mine = [(max(a, lo), b, g) for a, b, g in self.runs[slot] if b > lo]
        return [(other, a2, b2, g2) for other, runs in enumerate(self.runs) if other != slot
                for a2, b2, g2 in runs if any(g == g2 and max(a, a2) < min(b, b2) for a, b, g in mine)]

    def _move(self, slot: int, lo: int, position: int, region: int) -> None:
        """Map the slot's positions from lo on onto `region` (its own, whose rows from lo on no one else maps, or
        a fresh one), its rows lo .. position - 1 copied over; the rest are about to be written."""
        kept = [host[slot * self.rows + lo:slot * self.rows + position].copy() for host, _ in self.maps]
        dropped = {g for _, b, g in self.runs[slot] if b > lo} - {region}
        self._set_runs(slot, [(a, min(b, lo), g) for a, b, g in self.runs[slot] if a < lo] + [(lo, self.rows, region)])
        self._map(slot, lo, self.rows, region)
        for (host, _), rows in zip(self.maps, kept):
            host[slot * self.rows + lo:slot * self.rows + position] = rows
        for g in dropped:
            self._trim_region(g)

    def _unshare(self, slot: int, a: int, b: int, g: int) -> None:
        """The slot's positions a .. b - 1, mapped onto region g, move onto its own region's same rows, copied.
        Those rows are below its own run's start, where no one maps its own region."""
        own = self.runs[slot][-1][2]
        kept = [host[slot * self.rows + a:slot * self.rows + b].copy() for host, _ in self.maps]
        runs = []
        for x, y, r in self.runs[slot]:
            if r != g or y <= a or x >= b:
                runs.append((x, y, r))
                continue
            runs += [(x, a, g)] * (x < a) + [(max(x, a), min(y, b), own)] + [(b, y, g)] * (b < y)
        self._set_runs(slot, runs)
        self._map(slot, a, b, own)
        for (host, _), rows in zip(self.maps, kept):
            host[slot * self.rows + a:slot * self.rows + b] = rows
        self._trim_region(g)

    def reset(self, slot: int) -> None:
        """No one reads the slot's rows any more: its runs go, each region no run maps gives its pages back,
        and the slot maps a region of its own, all of it."""
        if self.runs[slot] == [(0, self.rows, slot)] and self.refs[slot] == 1:
            self._punch(slot, 0)  # the usual case: its own region, no one else's rows in it
            return
        regions = {g for _, _, g in self.runs[slot]}
        self._set_runs(slot, [])
        for g in regions:
            self._trim_region(g)
        own = slot if self.refs[slot] == 0 and slot in self.free else self._take_free(slot)
        self._map(slot, 0, self.rows, own)
        self._set_runs(slot, [(0, self.rows, own)])

    def _set_runs(self, slot: int, runs: list[tuple[int, int, int]]) -> None:
        """The slot's runs, neighbours on one region merged, and each region's count of runs that map it."""
        merged: list[tuple[int, int, int]] = []
        for a, b, g in runs:
            if merged and merged[-1][1] == a and merged[-1][2] == g:
                a = merged.pop()[0]
            merged.append((a, b, g))
        self.refs.subtract(g for _, _, g in self.runs[slot])
        self.refs.update(g for _, _, g in merged)
        self.runs[slot] = merged

    def _take_free(self, slot: int) -> int:
        if not self.free:
            raise RuntimeError(f"slot {slot}: no free KV region left ({len(self.refs)} in use)")
        return self.free.pop()

    def _trim_region(self, g: int) -> None:
        """Give back region g's rows that no run maps: above the last mapped row (all of it if none)."""
        ends = [b for runs in self.runs for _, b, r in runs if r == g]
        self._punch(g, max(ends, default=0))
        if not ends and g not in self.free:
            self.free.append(g)
            del self.refs[g]

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
