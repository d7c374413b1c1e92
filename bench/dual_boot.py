"""Two clusters booting at once on one machine (issue 36): `ppsmoke.py --seed -n 3` and `ppsmoke.py --seed -n 2`
started together, `--runs` times in a row. A busy machine must not make a booting stage look dead: each run
must answer, and no stage may be declared dead or replaced.

  DEV=CPU python -m bench.dual_boot --runs 5

Reported per run and cluster: exit code, launch to exit, and the lines of the runner or any stage log that
say a stage was declared dead or replaced, or that a compute thread did not stop. Exits 1 if any run failed or any stage was.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TROUBLE = re.compile(r"declared (dead|left)|was replaced|replacement|did not stop within", re.IGNORECASE)


def run_pair(sizes: tuple[int, ...], timeout_s: float) -> list[dict]:
    """Every cluster of `sizes` started at once; each one's outcome."""
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "ppsmoke.py", "--seed", "-n", str(n)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in sizes]
    out = []
    for n, proc in zip(sizes, procs):
        stdout, stderr = proc.communicate(timeout=timeout_s)
        took = time.monotonic() - started
        found = re.search(r"logs in (\S+)", stderr)
        logs = sorted(Path(found.group(1)).glob("stage*.log")) if found else []
        trouble = [line for line in stderr.splitlines() if TROUBLE.search(line)]
        trouble += [f"{p.name}: {line[:160]}" for p in logs for line in p.read_text().splitlines()
                    if TROUBLE.search(line)]
        out.append({"stages": n, "code": proc.returncode, "took_s": took, "answer": stdout.strip()[:60],
                    "trouble": trouble})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    print(f"Command: `python -m bench.dual_boot {' '.join(sys.argv[1:])}`  \nMachine: {platform.platform()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, DEV={os.environ.get('DEV', '')}\n")
    print("| run | stages | exit | launch to exit s | stage declared dead or replaced | answer |\n|---|---|---|---|---|---|")
    bad = False
    for r in range(1, args.runs + 1):
        for c in run_pair((3, 2), args.timeout):
            bad |= c["code"] != 0 or bool(c["trouble"])
            print(f"| {r} | {c['stages']} | {c['code']} | {c['took_s']:.1f} | "
                  f"{'; '.join(c['trouble'][:3]) or 'no'} | {c['answer']!r} |", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
