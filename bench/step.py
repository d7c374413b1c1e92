"""Time one decode step of a stage slice in process: the fixed tinygrad cost per stage and per block, and
what a batched step of B rows costs against one row.

  DEV=CPU python -m bench.step --model tiny --blocks 8 4 1
  DEV=CPU python -m bench.step --model small --blocks 3 --batch 1 4 8 16 32
  DEV=CPU python -m bench.step --model small --blocks 3 --beam 2     # kernel search at warm-up
  DEV=CPU python -m bench.step --model tiny --blocks 2 --steps 200 --profile
  DEV=CPU python -m bench.step --blocks 30 --head --prefill 512      # a 512-token prompt, tokens/s
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from worker.batching import DEFAULT_MAX_SEQS, Segment
from worker.weights.fetch import DEFAULT_MODEL
from worker.models import open_model
from worker.weights.contract import PRECISIONS


def step_ms(model, blocks: int, steps: int, batch: int, beam: int = 0, profile: bool = False) -> tuple[float, float]:
    """Median ms of a step of `batch` decode rows, each its own sequence, after the graphs are captured;
    and the seconds the capture (with kernel search, if `beam`) took."""
    s = model.open_slice(range(blocks), embed=True, head=False, max_seqs=max(batch, 1))
    started = time.perf_counter()
    s.warm_up(beam)
    warm_s = time.perf_counter() - started
    prompt = s.embed([1, 2, 3])
    for slot in range(batch):
        s.forward_batch(prompt, [Segment(slot, 0, 3)])
    rows = np.concatenate([s.embed([5])] * batch)
    times = []
    for pos in range(3, 3 + steps):
        start = time.perf_counter()
        s.forward_batch(rows, [Segment(slot, pos, 1) for slot in range(batch)])
        times.append(time.perf_counter() - start)
    if profile:  # where a step's time goes in Python: tinygrad's calls per kernel, per step
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [s.forward_batch(rows, [Segment(slot, pos, 1) for slot in range(batch)])
                                  for pos in range(3 + steps, 3 + 2 * steps)])
        print(f"cProfile of {steps} more steps:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(15)
    return 1000 * statistics.median(times[5:]), warm_s


def prefill_tokens_per_s(model, blocks: int, tokens: int, head: bool, repeats: int = 3) -> float:
    """A `tokens`-long prompt through one slice of `blocks` blocks (with the head: the whole model in one
    process), as a node prefills it: one segment, cut into the buckets a node captures by default (up to
    default_max_batch(DEFAULT_MAX_SEQS) rows a call). Best of `repeats`."""
    s = model.open_slice(range(blocks), embed=True, head=head, max_seqs=DEFAULT_MAX_SEQS)
    s.warm_up(0)
    hidden = s.embed([(7 * i) % 1000 + 1 for i in range(tokens)])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        s.forward_batch(hidden, [Segment(0, 0, tokens)])
        best = min(best, time.perf_counter() - start)
    return tokens / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--blocks", nargs="+", type=int, default=[8, 4, 1])
    p.add_argument("--batch", nargs="+", type=int, default=[1], help="rows per step (default 1)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prefill", type=int, help="instead: time a prompt of this many tokens (tokens/s)")
    p.add_argument("--head", action="store_true", help="with --prefill: include the final norm and head")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of as many more steps")
    p.add_argument("--beam", type=int, default=0, help="kernel search width at warm-up (tinygrad BEAM; 0 = off)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="which weights keep the file's precision (weights.contract.narrow_kinds)")
    p.add_argument("--threads", nargs="+", type=int, default=[1], help="cores a step runs on (ppnode --threads)")
    p.add_argument("--kv-cache-dtype", nargs="+", choices=("float16", "float32"), default=["float16"],
                   help="what the KV caches hold (ppnode --kv-cache-dtype; default float16, a node's)")
    args = p.parse_args(argv)
    for kv in args.kv_cache_dtype:
        for threads in args.threads:
            model = open_model(args.model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None,
                               precision=args.precision, tuned=args.beam > 0, threads=threads, kv_dtype=kv)
            print(f"KV caches: {kv}")
            _run(model, args, threads)
    return 0


def _run(model, args, threads: int) -> None:
    if args.prefill:
        for blocks in args.blocks:
            rate = prefill_tokens_per_s(model, blocks, args.prefill, args.head)
            print(f"{args.model} ({args.precision}), {blocks} blocks{' + head' if args.head else ''}, {threads} thread(s): "
                  f"prefill of {args.prefill} tokens at {rate:.1f} tokens/s")
        return
    for blocks in args.blocks:
        for batch in args.batch:
            ms, warm_s = step_ms(model, blocks, args.steps, batch, args.beam, args.profile)
            print(f"{args.model} ({args.precision}), {blocks} blocks, {batch} rows, beam {args.beam}, {threads} thread(s): "
                  f"median {ms:.2f} ms per step, {ms / batch:.2f} ms per row; warm-up {warm_s:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
