"""Capturing a slice's step graphs, one bucket at a time. A node captures at boot the smallest bucket and the one
a prompt chunk fills (`boot_buckets`: decode rows and a chunked prefill's rows, a replay's included), and
serves as soon as they are ready; the others are captured later, one between two steps, while the node has
nothing to compute (StageWorker.warm_more), or at once after the steps since the last capture held DEMAND_ROWS
rows that a missing bucket would have served, and what those steps lost without it outweighs a capture
(`lost`: ski rental, priced by the buckets already timed; a stage under steady load is never idle).

A step is cut into the buckets captured (worker/batching.py's split_rows prices only those), so it never
waits for a capture it does not need. A missing bucket serves a step where it is part of the step's rows cut
the plain way, largest buckets first (`missing_for`: 12 rows are 8 + 4): a bucket the step's rows could only
pad up to would not serve it better. Each capture is timed, and its bucket priced by the median of a few
replays."""
from __future__ import annotations

import contextlib
import time

import numpy as np
from tinygrad import Context

from ..batching import split_rows

WARM_UP_TIMINGS = 3  # replays per bucket after its capture; the median prices the bucket
DEMAND_ROWS = 64  # rows of steps a missing bucket would have served before it is captured without waiting for idle


def boot_buckets(buckets: tuple[int, ...], prompt_rows: int | None) -> tuple[int, ...]:
    """Pure: the buckets a node captures before it serves: the smallest, and the smallest that holds one
    prompt chunk of `prompt_rows` (None: no cap, so the largest)."""
    rows = buckets[-1] if prompt_rows is None else min(prompt_rows, buckets[-1])
    return tuple(dict.fromkeys((buckets[0], next(b for b in buckets if b >= rows))))


def missing_for(rows: int, captured, buckets: tuple[int, ...]) -> int | None:
    """Pure: the largest bucket, not captured yet, of a step of `rows` rows cut the plain way (largest buckets
    first); None where every bucket of that cut is captured."""
    cut, left = [], rows
    while left > 0:
        b = max((b for b in buckets if b <= left), default=buckets[0])
        cut.append(b)
        left -= b
    return max((b for b in cut if b not in captured), default=None)


def estimated(cost: dict[int, float], bucket: int) -> float | None:
    """Pure: a bucket's call time on the least-squares line through the timed buckets' (rows, seconds): a
    call costs a fixed part and a part per row. None with fewer than two timed."""
    if len(cost) < 2:
        return None
    xs, ys = np.array(list(cost), dtype=float), np.array(list(cost.values()))
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(float(intercept + slope * bucket), min(ys))


def cut_cost(rows: int, cost: dict[int, float]) -> float:
    """Pure: the time of a step of `rows` rows cut into the buckets priced in `cost`, at the least cost."""
    buckets = sorted(cost)
    return sum(cost[next(b for b in buckets if b >= n)] for n in split_rows(rows, cost))


def lost(rows: int, cost: dict[int, float], buckets: tuple[int, ...]) -> tuple[int, float | None] | None:
    """Pure: the missing bucket a step of `rows` rows wants (missing_for) and the seconds its cut loses
    without it (None: not enough buckets timed to say); None where it wants none."""
    want = missing_for(rows, cost, buckets)
    if want is None:
        return None
    guess = estimated(cost, want)
    if guess is None:
        return want, None
    return want, max(0.0, cut_cost(rows, cost) - cut_cost(rows, {**cost, want: guess}))


def demanded(want: int, captured, buckets: tuple[int, ...]) -> int:
    """Pure: the bucket to capture: `want`, the largest the steps since the last capture lacked, where it is
    missing (0: none), else the smallest missing one."""
    missing = [b for b in buckets if b not in captured]
    return want if want in missing else missing[0]


class Demand:
    """Since the last capture: rows of steps a bucket not captured yet would have served, the largest such
    bucket, and the seconds those steps lost without it (None: the timed buckets cannot price it); and each
    capture's seconds, what one more is likely to cost. A stage's compute thread only."""

    def __init__(self):
        self.rows, self.most, self.lost = 0, 0, 0.0
        self.capture_s: list[float] = []

    def count(self, rows: int, cost: dict[int, float], buckets: tuple[int, ...]) -> None:
        found = lost(rows, cost, buckets)
        if found is not None:
            want, seconds = found
            self.rows, self.most = self.rows + rows, max(self.most, want)
            self.lost = self.lost + seconds if seconds is not None and self.lost is not None else None

    @property
    def pressing(self) -> bool:
        """DEMAND_ROWS rows were cut short for want of a bucket, and they lost more time than a capture costs
        (where it can be priced): capture now rather than at an idle moment, which steady load never has."""
        if self.rows < DEMAND_ROWS:
            return False
        return self.lost is None or not self.capture_s or self.lost >= sorted(self.capture_s)[len(self.capture_s) // 2]

    def captured(self, seconds: float) -> None:
        self.rows, self.most, self.lost = 0, 0, 0.0
        self.capture_s.append(seconds)


def capture(model, bucket: int, beam: int) -> tuple[float, float]:
    """Capture `bucket`'s step graph of StageModel `model` (and its head's, on the last stage) with calls that
    write only the scratch slot. Returns the capture's seconds and one call's (the median of the replays)."""
    zeros = np.zeros((bucket, model.config.dim), dtype=np.float32)
    args = (zeros, np.full(bucket, model.scratch_slot), np.arange(bucket) % model.config.max_context)
    started = time.perf_counter()
    with _beam(beam):
        model.run_graph(*args, bucket=bucket)  # the first call captures the graph
    took = time.perf_counter() - started
    times = []
    for _ in range(WARM_UP_TIMINGS):
        started = time.perf_counter()
        model.run_graph(*args, bucket=bucket)
        times.append(time.perf_counter() - started)
    if model.head is not None:
        started = time.perf_counter()
        with _beam(beam):
            model.head_call(bucket, zeros)
        took += time.perf_counter() - started
    return took, sorted(times)[len(times) // 2]


def _beam(beam: int):
    """tinygrad's kernel search while a graph is captured, or its own BEAM setting."""
    return Context(BEAM=beam) if beam else contextlib.nullcontext()
