"""One matrix × rows kernel in isolation, tinygrad's own form against the hand-written CPU one
(worker/compute/cpu_matvec.py), and what a mixed step of prompt and decode rows costs through a slice.

  DEV=CPU python -m bench.kernels --kinds f32 q8_0 q4_1 --rows 1 8 16           # one 1536x576 matvec
  DEV=CPU python -m bench.kernels --mixed --blocks 10 --rows 1 2 4 16           # rows at 300 cached positions

The matvec runs over `--weights` different matrices of the shape in one captured graph, so that they do not
fit in the cache (48 × 1536 × 576 f32 is 170 MB): ms per matvec, and weights (times rows) per second.
`--mixed`: one decode row of one slot and the rest prompt rows of another at position 300, through
`--blocks` blocks of the default model; best of 3.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tinygrad import Tensor, TinyJit

from worker.batching import DEFAULT_MAX_SEQS, Segment
from worker.compute import cpu_matvec, cpu_threads
from worker.compute.linear import DeviceWeight, plain
from worker.models import open_model
from worker.weights.fetch import DEFAULT_MODEL


def _weight(kind: str, out: int, inp: int, rng) -> tuple[np.ndarray, ...]:
    """A weight's parts as the file holds them (worker/weights/packed.py)."""
    nb = inp // 32
    if kind == "f32":
        return (rng.standard_normal((out, inp), dtype=np.float32),)
    if kind == "q8_0":
        return rng.integers(-127, 127, (out, nb, 32), dtype=np.int8), rng.random((out, nb, 1)).astype(np.float16)
    return rng.integers(0, 255, (out, nb, 16), dtype=np.uint8), rng.random((out, nb, 2)).astype(np.float16)


def matvec_ms(kind: str, form: str, rows: int, out: int, inp: int, weights: int, threads: int = 1) -> float:
    rng = np.random.default_rng(0)
    mats = [_weight(kind, out, inp, rng) for _ in range(weights)]
    if form == "hand":
        parts = [tuple(Tensor(p).realize() for p in cpu_matvec.device_parts(kind, m)) for m in mats]
        pool = cpu_threads.shared(threads)
        one = lambda x, p: cpu_matvec.matvec(x, kind, p, (out, inp), pool)  # noqa: E731
    else:
        parts = [DeviceWeight(kind, tuple(Tensor(p).realize() for p in m), (out, inp)) for m in mats]
        one = lambda x, w: plain(x, w).contiguous()  # noqa: E731
    step = TinyJit(lambda x: Tensor.stack(*[one(x, p) for p in parts]).sum(0).realize())
    x = Tensor(rng.standard_normal((rows, inp), dtype=np.float32)).realize()
    for _ in range(3):
        step(x)
    times = []
    for _ in range(20):
        started = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times) / weights


def mixed_ms(blocks: int, rows: list[int]) -> dict[int, float]:
    model = open_model(DEFAULT_MODEL, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None)
    s = model.open_slice(range(blocks), embed=True, head=False, max_seqs=DEFAULT_MAX_SEQS)
    s.warm_up(0)
    h = s.embed(list(range(1, 520)))
    s.forward_batch(h[:300], [Segment(0, 0, 300)])
    s.forward_batch(h[:20], [Segment(1, 0, 20)])
    out = {}
    for n in rows:
        best = float("inf")
        for rep in range(3):
            pos = 300 + 16 * rep
            hidden = np.concatenate([h[20:21], h[pos:pos + n - 1]])
            segments = [Segment(1, 20 + rep, 1)] + ([Segment(0, pos, n - 1)] if n > 1 else [])
            started = time.perf_counter()
            s.forward_batch(hidden, segments)
            best = min(best, time.perf_counter() - started)
        out[n] = 1000 * best
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["f32", "q8_0", "q4_1"], choices=["f32", "q8_0", "q4_1"])
    p.add_argument("--forms", nargs="+", default=["tinygrad", "hand"], choices=["tinygrad", "hand"])
    p.add_argument("--rows", nargs="+", type=int, default=[1])
    p.add_argument("--shape", nargs=2, type=int, default=[1536, 576], metavar=("OUT", "IN"))
    p.add_argument("--weights", type=int, default=48)
    p.add_argument("--threads", nargs="+", type=int, default=[1], help="the hand form's thread counts")
    p.add_argument("--mixed", action="store_true", help="instead: mixed steps through --blocks blocks")
    p.add_argument("--blocks", type=int, default=10)
    args = p.parse_args(argv)
    if args.mixed:
        for n, ms in mixed_ms(args.blocks, args.rows).items():
            print(f"{args.blocks} blocks, {n} rows (1 decode, {n - 1} prompt at 300): {ms:.1f} ms")
        return 0
    out, inp = args.shape
    for kind in args.kinds:
        for form in args.forms:
            for rows in args.rows:
                for threads in args.threads if form == "hand" else [1]:
                    ms = matvec_ms(kind, form, rows, out, inp, args.weights, threads)
                    print(f"{kind} {form} {out}x{inp}, {rows} rows, {threads} thread(s): {ms:.3f} ms per matvec, "
                          f"{rows * out * inp / ms / 1e6:.2f} G row-weights/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
