"""Time one decode step of a stage slice in process: the fixed tinygrad cost per stage and per block.

  DEV=CPU python -m bench.step --model tiny --blocks 8 4 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from worker.models import open_model


def step_ms(model, blocks: int, steps: int) -> float:
    s = model.open_slice(range(blocks), embed=True, head=False)
    s.forward(s.embed([1, 2, 3]), 0)
    times = []
    for pos in range(3, 3 + steps):
        start = time.perf_counter()
        s.forward(s.embed([5]), pos)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[5:])  # the first steps compile and capture


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--blocks", nargs="+", type=int, default=[8, 4, 1])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    model = open_model(args.model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None)
    for blocks in args.blocks:
        print(f"{args.model}, {blocks} blocks: median {step_ms(model, blocks, args.steps):.2f} ms per decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
