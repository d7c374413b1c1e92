"""Where a decode token's time goes on the CPU pool: the jobs' own work, the caller's waits at their joins,
the helpers' sleeps, tinygrad's other kernels, and the Python around the graphs (issue 38).

The pool's C (worker/compute/cpu_threads.py) is rebuilt with counters added, as its own library (its source
differs, so its cache file does too); then the whole model decodes one stream, greedily, and the figures are
per token, over `--tokens` tokens after a warm-up.

  DEV=CPU python -m bench.joins --threads 1 2 --tokens 60

- work ms: the caller's chunks (or whole jobs on one thread), and the helpers' chunks;
- wait ms: the caller, its chunks done, waiting for chunks still running elsewhere; joins over 50 µs;
- helper sleeps: a helper falling asleep (nothing started on the device for SPIN_NS);
- device ms: the device's worker loop running commands (every kernel of the step and head graphs);
- python ms: the token's wall time less the device's (submits, synchronizations, input preparation).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from worker.weights.fetch import DEFAULT_MODEL

COUNTERS = ("jobs", "solo_ns", "own_ns", "wait_ns", "joins_over_50us", "helper_ns", "helper_sleeps", "device_ns",
            "commands")
# (where, what is added there): each anchor must be in the pool's C exactly once
PROBES = (
    ("static inline void relax", "long pp_st[16];\nvoid pp_stats(long* o) { for (int i = 0; i < 16; i++) "
     "{ o[i] = pp_st[i]; pp_st[i] = 0; } }\nstatic inline void relax"),
    ("void pp_run(struct pp_pool* p, const struct pp_job* j) {",
     "void pp_run(struct pp_pool* p, const struct pp_job* j) {\n  long t0 = now_ns(); pp_st[0]++;"),
    ("    j->fn(j, 0, j->items);\n    return;", "    j->fn(j, 0, j->items);\n    pp_st[1] += now_ns() - t0; return;"),
    ("  run_chunks(p);\n  wait_done(p, chunks);",
     "  run_chunks(p);\n  long t1 = now_ns(); wait_done(p, chunks); long t2 = now_ns();\n"
     "  pp_st[2] += t1 - t0; pp_st[3] += t2 - t1; pp_st[4] += t2 - t1 > 50000;"),
    ("    if (run_chunks(p))", "    long h0 = now_ns(); int ran = run_chunks(p); pp_st[5] += now_ns() - h0;\n    if (ran)"),
    ("    __atomic_add_fetch(&pulse.sleepers, 1, __ATOMIC_SEQ_CST);",
     "    __atomic_add_fetch(&pulse.sleepers, 1, __ATOMIC_SEQ_CST); pp_st[6]++;"),
    ("    ((pp_command)e[0])(%(args)s);",
     "    long w0 = now_ns(); ((pp_command)e[0])(%(args)s); pp_st[7] += now_ns() - w0; pp_st[8]++;"),
)


def instrument() -> None:
    """Before the library is first built: the pool's C with the counters."""
    from worker.compute import cpu_threads
    source = cpu_threads.POOL_C
    for anchor, probe in PROBES:
        if source.count(anchor) != 1:
            raise SystemExit(f"bench.joins: the pool's C changed; update its probe at {anchor!r}")
        source = source.replace(anchor, probe)
    cpu_threads.POOL_C = source


def measure(model_name: str, threads: int, tokens: int) -> dict:
    from worker.compute import cpu_threads
    from worker.config import DEFAULT_CONTEXT
    from worker.models import open_model
    model = open_model(model_name, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None, precision="auto",
                       tuned=False, max_context=DEFAULT_CONTEXT, threads=threads)
    full = model.open_slice(range(model.total_blocks), embed=True, head=True)
    full.warm_up(0)
    ids = model.tokenizer().encode_chat("Say hello")
    token, pos = int(np.argmax(full.forward(full.embed(ids), 0))), len(ids)
    counters = (ctypes.c_long * 16)()
    cpu_threads.library().pp_stats(counters)  # from here on
    walls = []
    for _ in range(tokens):
        start = time.perf_counter()
        token = int(np.argmax(full.forward(full.embed([token]), pos)))
        pos += 1
        walls.append(time.perf_counter() - start)
    cpu_threads.library().pp_stats(counters)
    per = {name: counters[i] / tokens for i, name in enumerate(COUNTERS)}
    ms = {name.replace("_ns", "_ms"): value / 1e6 for name, value in per.items() if name.endswith("_ns")}
    return {"threads": threads, "ms_per_token": 1000 * statistics.mean(walls), **ms,
            **{k: v for k, v in per.items() if not k.endswith("_ns")},
            "python_ms": 1000 * statistics.mean(walls) - ms["device_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=60)
    args = p.parse_args()
    instrument()
    rows = [measure(args.model, t, args.tokens) for t in args.threads]
    print("| per token | " + " | ".join(f"{r['threads']} thread(s)" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in rows[0]:
        if key != "threads":
            print(f"| {key} | " + " | ".join(f"{r[key]:.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
