"""What a node measures of itself before it is given blocks (issue 37): one block's step and the head's, and
the bytes it may hold. Runs on the compute thread; the planner (worker/plan.py) turns every stage's figures
into the split.

A Llama model's blocks all have one shape, so the model's last block stands for every block: the node opens a
slice of it and the head (the last stage of a split (n-1, 1)), captures the bucket of `rows` rows, and times
decode steps of `rows` rows: without logits (the block alone) and with every row's logits (block and head),
in alternating windows. The figure is a window's wall time over its steps, summed over the windows, not the
fastest step: a CPU quota (a cgroup's cfs_quota_us) lets a short burst run at full speed and then stalls the
process for the rest of its period, so only windows longer than that period see it.
"""
from __future__ import annotations

import time

import attrs
import numpy as np

from .batching import Segment
from .models import Model
from .plan import Calibration, ModelCost
from .slice import Slice

ROWS = 8  # decode rows a step: the many-streams case the default objective plans for
WINDOW_S = 0.15  # CFS periods (100 ms by default) a window: 0.45 s of each kind in all
WINDOWS = 3  # of each kind, alternating
POSITION = 32  # the context a timed decode step attends over


class Sizing:
    """What a node knows of itself once the slice it times is open: its Calibration without times (the bytes a
    block, the head and the embedding weigh, and the memory it may fill), and that slice, to time it next."""

    def __init__(self, calibration: Calibration, probe: Slice | None):
        self.calibration, self.probe = calibration, probe


def sizing(model: Model, max_seqs: int, memory_bytes: int | None, *, rows: int = ROWS) -> Sizing:
    """This node's sizes for `model` with `max_seqs` slots a stage (compute thread): it opens the model's last
    block and the head, so a broken file is found here, before the node waits for anyone."""
    rows = max(1, min(rows, max_seqs))
    last = model.total_blocks - 1
    both = model.open_slice(range(last, last + 1), embed=False, head=True, max_seqs=max_seqs)
    block = model.open_slice(range(last, last + 1), embed=False, head=False, max_seqs=1)
    cost = ModelCost(blocks=model.total_blocks, block_bytes=block.weight_bytes + both.kv_bytes,
                     embed_bytes=both.weight_bytes - block.weight_bytes,  # the table has the head's shape
                     head_bytes=both.weight_bytes - block.weight_bytes)
    return Sizing(Calibration(None, None, rows, memory_bytes, cost), both if model.computes else None)


def timed(sized: Sizing, *, window_s: float = WINDOW_S, windows: int = WINDOWS) -> Calibration:
    """`sized` with its times (compute thread): decode steps of its rows without and with every row's logits,
    in alternating windows. The stub computes nothing, so it reports no times: the planner then counts the
    nodes equal."""
    both, c = sized.probe, sized.calibration
    if both is None:
        return c
    both.warm_up(0, lazy=True, prompt_rows=c.rows)
    hidden = (np.random.default_rng(0).standard_normal((c.rows, both.hidden_dim)) * 0.1).astype(np.float32)
    segments = [Segment(slot, POSITION, 1) for slot in range(c.rows)]
    every_row = list(range(c.rows))
    plain, headed = [0.0, 0], [0.0, 0]  # seconds, steps
    for _ in range(windows):
        _window(lambda: both.forward_batch(hidden, segments, logit_rows=[]), window_s, plain)
        _window(lambda: both.forward_batch(hidden, segments, logit_rows=every_row), window_s, headed)
    block_s = plain[0] / plain[1]
    return attrs.evolve(c, block_s=block_s, head_s=max(0.0, headed[0] / headed[1] - block_s))


def calibrate(model: Model, max_seqs: int, memory_bytes: int | None, *, rows: int = ROWS,
              window_s: float = WINDOW_S, windows: int = WINDOWS) -> Calibration:
    """This node's figures for `model`, sized and timed at once."""
    return timed(sizing(model, max_seqs, memory_bytes, rows=rows), window_s=window_s, windows=windows)


def _window(step, seconds: float, tally: list) -> None:
    """Steps for at least `seconds` (and at least two), added to tally [seconds, steps]."""
    start, steps = time.perf_counter(), 0
    while steps < 2 or time.perf_counter() - start < seconds:
        step()
        steps += 1
    tally[0] += time.perf_counter() - start
    tally[1] += steps


def available_memory() -> int | None:
    """The host memory this node may fill: the kernel's MemAvailable (None where there is no /proc/meminfo).
    Nodes sharing one machine each see all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
