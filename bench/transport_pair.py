"""What a change to the transport costs a hop: `bench.transport` run in two checkouts in turn (A B A B ...), so
that both see the machine as it is at the time, and each row's median compared pair by pair.

    git worktree add /tmp/before <rev>
    python -m bench.transport_pair --before /tmp/before --rounds 3 --requests 300

Each checkout runs its own code (its own client and server) under this interpreter. A row's figure is the median,
over the rounds, of each run's median; the delta is after minus before, and the ratio the median of the
rounds' after/before ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(checkout: Path, requests: int, warmup: int) -> dict[tuple, float]:
    """One bench.transport run in `checkout`: (protocol, dim, seq_len) -> median ms."""
    for attempt in range(3):  # the bench refuses figures its server does not vouch for: say why, and run it again
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            done = subprocess.run([sys.executable, "-m", "bench.transport", "--requests", str(requests), "--warmup",
                                   str(warmup), "--json", out.name], cwd=checkout, capture_output=True, text=True)
            if done.returncode == 0:
                rows = json.loads(Path(out.name).read_text())
                return {(r["protocol"], r["dim"], r["seq_len"]): r["median_ms"] for r in rows}
        print(f"{checkout}: run {attempt + 1} refused: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    raise RuntimeError(f"bench.transport failed 3 times in {checkout}")


def paired(before: Path, after: Path, rounds: int, requests: int, warmup: int) -> list[dict]:
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(rounds):
        runs["before"].append(run(before, requests, warmup))
        runs["after"].append(run(after, requests, warmup))
    rows = []
    for key in runs["before"][0]:
        b = [r[key] for r in runs["before"] if key in r]
        a = [r[key] for r in runs["after"] if key in r]
        if len(a) != len(b):
            continue
        rows.append({"protocol": key[0], "dim": key[1], "seq_len": key[2], "before_ms": statistics.median(b),
                     "after_ms": statistics.median(a), "delta_ms": statistics.median(a) - statistics.median(b),
                     "ratio": statistics.median(x / y for x, y in zip(a, b))})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.transport_pair", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the checkout to compare with (a git worktree)")
    p.add_argument("--after", type=Path, default=REPO, help="this checkout (default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args(argv)
    rows = paired(args.before, args.after, args.rounds, args.requests, args.warmup)
    print(f"Command: `python -m bench.transport_pair {' '.join(sys.argv[1:] if argv is None else argv)}`")
    print(f"{args.rounds} rounds, before and after in turn; medians of each run's median ms\n")
    print("| protocol | dim | seq_len | before ms | after ms | delta ms | after/before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['protocol']} | {r['dim']} | {r['seq_len']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | "
              f"{r['delta_ms']:+.3f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
