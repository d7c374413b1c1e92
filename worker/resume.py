"""Which rows of a step item a stage must compute, and which it already has (issue 36: replay from kept KV).

A replay sends a request's prompt and the tokens generated so far down the chain again, from position 0. A
stage that survived holds the KV of the earlier life's positions (the same tokens, so the same values), and a
first or middle stage also holds the output rows it passed on then (worker/kept.py's KeptRows). For those it
computes nothing: the kept rows go on as they are, and only what the slot lacks is computed. A stage that
holds nothing (the replacement) computes every row, as before. The last stage always computes an item's
last row, whose logits it samples from.

Pure: positions in, pieces out. A piece is (start, stop, computed); the pieces cover the item's positions in
order.
"""
from __future__ import annotations

Piece = tuple[int, int, bool]


def pieces(position: int, rows: int, *, held: int, kept: tuple[int, int] | None, last_row: bool = True
           ) -> list[Piece]:
    """The item [position, position + rows) of a request whose slot holds the earlier life's first `held`
    positions. `kept`: the positions [first, end) whose output rows are kept (first and middle stages);
    None: the last stage, which needs no rows, only its KV, but computes the item's last row where its
    logits are wanted (`last_row`)."""
    stop = position + rows
    if kept is None:
        skip = min(held, stop - 1 if last_row else stop)
        if skip >= stop:
            return [(position, stop, False)]
        return [(position, skip, False), (skip, stop, True)] if skip > position else [(position, stop, True)]
    lo, hi = max(position, kept[0]), min(stop, kept[1], held)
    if lo >= hi:
        return [(position, stop, True)]
    out = [(position, lo, True)] if lo > position else []
    out.append((lo, hi, False))
    return out + ([(hi, stop, True)] if hi < stop else [])
