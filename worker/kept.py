"""The prefix-cache entries a worker keeps (roles/prefix.py decides which, stage 0 tells every stage): named
sequence slots, each holding the KV of a finished request's first `length` positions, least recently used
first. A request starts from one by taking its slot, or by having its rows copied into a free slot; where
no slot is free, the least recently used entry gives up its own (entries stage 0 no longer counts, such as
those of a chain before a stage was replaced).

Beside its KV, a first or middle stage keeps the output rows it passed on (`KeptRows`), for a request and for
an entry alike: a replay of the request serves them again rather than computing them (worker/slots.py)."""
from __future__ import annotations

import collections
from collections.abc import Iterable

import attrs
import numpy as np

from .errors import PrefixMissing


class KeptRows:
    """The output rows of positions [first, end), as the arrays the steps made (never written after). Rows
    are added in runs; a run that does not touch the ones held starts them over."""

    def __init__(self, first: int = 0, chunks: tuple[np.ndarray, ...] = ()):
        self.first, self._chunks = first, list(chunks)
        self.end = first + sum(len(c) for c in chunks)

    def add(self, position: int, rows: np.ndarray) -> None:
        if self._chunks and position == self.end:
            self._chunks.append(rows)
            self.end += len(rows)
        elif self._chunks and position + len(rows) == self.first:
            self._chunks.insert(0, rows)
            self.first = position
        else:
            self.first, self.end, self._chunks = position, position + len(rows), [rows]

    def span(self, lo: int, hi: int) -> np.ndarray:
        """The rows of positions [lo, hi), which must lie inside [first, end)."""
        if not self.first <= lo < hi <= self.end:
            raise ValueError(f"rows [{lo}, {hi}) are not all kept: [{self.first}, {self.end}) are")
        out, at = [], self.first
        for chunk in self._chunks:
            a, b = max(lo, at), min(hi, at + len(chunk))
            if a < b:
                out.append(chunk[a - at:b - at])
            at += len(chunk)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def below(self, position: int) -> KeptRows:
        """The rows of the positions below `position` (the same arrays)."""
        if min(position, self.end) <= self.first:
            return KeptRows()
        return KeptRows(self.first, (self.span(self.first, min(position, self.end)),))


@attrs.frozen
class _Kept:
    slot: int
    length: int  # positions whose KV the slot holds
    rows: KeptRows = attrs.Factory(KeptRows)


class KeptSlots:
    """Compute thread only, but for `len` and `positions`."""

    def __init__(self, stage: int):
        self.stage = stage  # named in a PrefixMissing
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def positions(self) -> int:
        """Positions the entries hold, in all; any thread."""
        return sum(k.length for k in tuple(self._kept.values()))

    def lengths(self) -> dict[str, int]:
        return {name: k.length for name, k in self._kept.items()}

    def slots(self) -> set[int]:
        return {k.slot for k in self._kept.values()}

    def keep(self, name: str, slot: int, length: int, rows: KeptRows | None = None) -> None:
        """Keep `slot` under `name`, replacing any entry of the name; `rows`: the output rows kept with it."""
        self._kept.pop(name, None)
        self._kept[name] = _Kept(slot, length, rows if rows is not None else KeptRows())

    def forget(self, names: Iterable[str]) -> list[int]:
        """Forget these entries (unknown ones are no-ops); returns the slots they held."""
        return [kept.slot for name in names if (kept := self._kept.pop(name, None)) is not None]

    def rows(self, name: str) -> KeptRows:
        return self._kept[name].rows

    def source(self, name: str, position: int, request_id: str) -> int:
        """The slot of the entry a request starts from at `position`, now the most recently used; raises
        PrefixMissing where the entry is not held here or holds fewer positions."""
        kept = self._kept.get(name)
        if kept is None or kept.length < position:
            held = "not held" if kept is None else f"holds {kept.length} positions, not {position}"
            raise PrefixMissing(f"request {request_id!r}: prefix-cache entry {name!r} is {held} at stage {self.stage}")
        self._kept.move_to_end(name)
        return kept.slot

    def take(self, name: str) -> int:
        """The entry's slot, no longer an entry: a request holds it now."""
        return self._kept.pop(name).slot

    def evict(self, *, other_than: str) -> int | None:
        """Give up the least recently used entry other than `other_than`, for its slot; None: no such entry."""
        victim = next((name for name in self._kept if name != other_than), None)
        return None if victim is None else self._kept.pop(victim).slot
