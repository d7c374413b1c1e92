"""The CPU device's wait in one process: tinygrad's own (a Python loop holding the GIL) against pp's
(worker/compute/device_wait.py: 20 µs sleeps, the GIL released), on one slice, in alternating rounds of
decode steps. Per round: median ms a step, and the process's CPU time over wall time while the round ran.

  DEV=CPU python -m bench.wait --model $SMOLLM2_GGUF --blocks 15 --rounds 4 --steps 300

A lone process has nothing else that wants the GIL, so this shows only what the polls cost; what the released
GIL is worth shows in a pipeline (bench.pipeline, docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tinygrad.runtime.ops_cpu import CPUDevice
from tinygrad.runtime.support.hcq2 import HCQ2Compiled

from worker.batching import Segment
from worker.compute import device_wait
from worker.models import open_model
from worker.weights.fetch import DEFAULT_MODEL

WAITS = {"tinygrad's": HCQ2Compiled._wait_signal, "pp's": device_wait.wait_signal}


def one_round(s, hidden, start: int, steps: int) -> tuple[float, float]:
    """(median ms a step, CPU seconds over wall seconds) of `steps` decode steps from position `start`."""
    times, cpu0, wall0 = [], os.times(), time.perf_counter()
    for pos in range(start, start + steps):
        began = time.perf_counter()
        s.forward_batch(hidden, [Segment(0, pos, 1)])
        times.append(time.perf_counter() - began)
    cpu1, wall = os.times(), time.perf_counter() - wall0
    return 1000 * statistics.median(times), (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wait", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--rounds", type=int, default=4, help="rounds of each wait, alternating")
    p.add_argument("--steps", type=int, default=300, help="decode steps a round")
    args = p.parse_args(argv)
    model = open_model(args.model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None, progress=False,
                       precision="auto", tuned=False)
    s = model.open_slice(range(args.blocks), embed=True, head=False, max_seqs=1)
    s.warm_up(0)
    hidden, pos = s.embed([5]), 0
    s.forward_batch(hidden, [Segment(0, pos, 1)])
    pos += 1
    command = "python -m bench.wait " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command}`\n\n| round | wait | median ms a step | CPU / wall |\n|---|---|---|---|")
    for r in range(args.rounds):
        for name, wait in WAITS.items():
            CPUDevice._wait_signal = wait
            ms, cpu = one_round(s, hidden, pos, args.steps)
            pos += args.steps
            print(f"| {r + 1} | {name} | {ms:.2f} | {cpu:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
