"""The two forms of worker/compute/linear.py's matmul, each forced on every weight of a slice: one decode step of
one row, with the kernels searched (BEAM) as the graph is captured. What linear() picks between them was
decided from this.

  DEV=CPU python -m bench.matmul_form /tmp/bench-q8_0.gguf --blocks 1 --head
  DEV=CPU python -m bench.matmul_form /tmp/bench-f32.gguf --blocks 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tinygrad import Context

from worker.compute import linear, model as model_module
from worker.batching import Segment
from worker.models import open_model
from worker.weights.contract import PRECISIONS


def step_ms(spec: str, precision: str, blocks: int, head: bool, form, beam: int, steps: int) -> float:
    model = open_model(spec, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None, precision=precision,
                       tuned=True)
    s = model.open_slice(range(blocks), embed=True, head=head, max_seqs=1)
    model_module.linear = lambda x, w, searched: form(x, w)  # every weight of the graph in this form
    with Context(BEAM=beam):  # the graph is captured, and its kernels searched, on this first call
        s.forward_batch(s.embed([5]), [Segment(0, 0, 1)])
    times = []
    for pos in range(1, steps + 1):
        started = time.perf_counter()
        s.forward_batch(s.embed([5]), [Segment(0, pos, 1)])
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[5:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.matmul_form", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--head", action="store_true", help="the slice also runs the final norm and the head")
    p.add_argument("--precision", choices=PRECISIONS, default="file")
    p.add_argument("--beam", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    for name, form in (("plain", linear.plain), ("split", linear.split)):
        ms = step_ms(args.model, args.precision, args.blocks, args.head, form, args.beam, args.steps)
        print(f"{args.model} ({args.precision}), {args.blocks} blocks{' + head' if args.head else ''}, "
              f"{name}: median {ms:.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
