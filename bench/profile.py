"""Where a cluster's time goes: `py-spy record` on every stage of a real local cluster at once, while requests
decode through it, then each stage's threads and hottest frames, from py-spy's own samples.

  pip install py-spy   # not a dependency of pp: a profiler, for this script only
  DEV=CPU python -m bench.profile --model tiny --stages 5 --seconds 12
  DEV=CPU python -m bench.profile --model $SMOLLM2_GGUF --stages 2 --seconds 15 --concurrency 8

Per stage: each thread's share of the samples (MainThread: the event loop; compute: the stage's compute
thread; the unnamed Thread-N: tinygrad's CPU worker, in native code), then the frames where samples landed
("self") and the frames on the stack ("inclusive"). py-spy samples wall time of threads it sees running or
waiting for the GIL; a thread blocked in a system call that releases the GIL counts as idle and is left out.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import start_local_cluster


async def record(model: str, n: int, seconds: float, concurrency: int, max_tokens: int, out: Path,
                 rate: int) -> float | None:
    """Start the cluster, warm it up, record every stage for `seconds` under load; the median ms/token then."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    async with trio.open_nursery() as nursery:
        orch, _ = await start_local_cluster(nursery, model, n)
        await orch.submit("Say hello", max_tokens=max_tokens)
        pids = [line.split()[0] for line in subprocess.run(["pgrep", "-af", "ppnode.py"], capture_output=True,
                                                               text=True).stdout.splitlines()]
        spies = [subprocess.Popen([spy, "record", "-p", pid, "-d", str(int(seconds)), "-r", str(rate), "--threads",
                                   "--nonblocking", "-f", "raw", "-o", str(out / f"stage{i}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, pid in enumerate(pids)]
        decode_ms: list[float] = []

        async def one() -> None:
            r = await orch.submit("Say hello", max_tokens=max_tokens)
            decode_ms.append(1000 * r.decode_s / max(1, len(r.token_ids) - 1))
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            async with trio.open_nursery() as batch:
                for _ in range(concurrency):
                    batch.start_soon(one)
        for s in spies:
            await trio.to_thread.run_sync(s.wait)
        nursery.cancel_scope.cancel()
    decode_ms.sort()
    return decode_ms[len(decode_ms) // 2] if decode_ms else None


def _frame(text: str) -> str:
    return re.sub(r"\s*\(/\S*?/(site-packages|lib/python3\.\d+)/", " (", re.sub(r"\(/\S*?/main/", "(", text))


def summarize(path: Path, top: int) -> str:
    """One stage's samples: per thread, then the hottest frames (self and inclusive) of the two Python threads."""
    threads, own, inclusive = collections.Counter(), collections.Counter(), collections.Counter()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        name, n = re.sub(r"thread \(\d+\): ", "", frames[0]), int(count)
        threads[name] += n
        own[(name, _frame(frames[-1]))] += n
        for f in dict.fromkeys(_frame(f) for f in frames[1:]):
            inclusive[(name, f)] += n
    total = sum(threads.values()) or 1
    out = [f"### {path.stem}", "", "| thread | samples | share |", "|---|---|---|"]
    out += [f"| {t} | {n} | {100 * n / total:.0f}% |" for t, n in threads.most_common()]
    for title, counter in (("self", own), ("inclusive", inclusive)):
        out += ["", f"| thread | frame ({title}) | share of the thread |", "|---|---|---|"]
        for (t, f), n in counter.most_common(top):
            out.append(f"| {t} | `{f}` | {100 * n / threads[t]:.0f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--seconds", type=float, default=12)
    p.add_argument("--concurrency", type=int, default=1, help="requests decoding at once")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rate", type=int, default=250, help="py-spy's samples per second")
    p.add_argument("--top", type=int, default=12, help="frames listed per table")
    p.add_argument("--out", type=Path, help="keep py-spy's raw samples here (default: a temporary folder)")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pp-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    ms = trio.run(record, args.model, args.stages, args.seconds, args.concurrency, args.max_tokens, out, args.rate)
    command = "python -m bench.profile " + " ".join(argv if argv is not None else sys.argv[1:])
    pace = "no request finished" if ms is None else f"median decode {ms:.1f} ms/token while sampled"
    print(f"Command: `{command}`; {pace}; raw samples in {out}\n")
    for path in sorted(out.glob("stage*.txt")):
        print(summarize(path, args.top) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
