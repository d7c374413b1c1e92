"""Capturing a slice's step graphs, one bucket at a time. A node captures the smallest bucket at boot and
serves as soon as it is ready; the others are captured later, one between two steps, while the node has
nothing to compute (StageWorker.warm_more), or at once after the steps since the last capture held DEMAND_ROWS
rows a missing bucket would have served better (a stage under steady load is never idle): then the largest
such bucket, since a replay's or a long prompt's rows want the largest. Until a bucket is captured, steps are cut into the buckets
that are (worker/batching.py's split_rows prices only those), so a step never waits for a capture it does not
need. Each capture is timed, and its bucket priced by the median of a few replays."""
from __future__ import annotations

import contextlib
import time

import numpy as np
from tinygrad import Context

WARM_UP_TIMINGS = 3  # replays per bucket after its capture; the median prices the bucket
DEMAND_ROWS = 64  # rows of steps a missing bucket would have served before it is captured without waiting for idle


def wanted(rows: int, captured, buckets: tuple[int, ...]) -> bool:
    """Pure: whether a step of `rows` rows would be served by a bucket not captured yet (one no larger than
    it), so is cut into more calls than it needs."""
    return any(b <= rows and b not in captured for b in buckets)


def demanded(largest_rows: int, captured, buckets: tuple[int, ...]) -> int:
    """Pure: the bucket to capture for steps of up to `largest_rows` rows: the largest missing one that fits
    them, else the smallest missing one."""
    missing = [b for b in buckets if b not in captured]
    fits = [b for b in missing if b <= largest_rows]
    return fits[-1] if fits else missing[0]


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
