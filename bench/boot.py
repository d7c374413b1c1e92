"""A cluster's boot, phase by phase and stage by stage: runs the README's command, `ppsmoke.py --seed -n N`,
and reads its stages' logs into a timeline (issue 36). Times are seconds after the launch, or each phase's
own length: a stage's interpreter and imports (`imported`), the model's open, its weights, and each step
bucket's graph capture (the compute thread), then when it listened, was ready, and served.

  python -m bench.boot --stages 5 --runs 2          # the kernel cache as it is (warm after one run)
  python -m bench.boot --stages 5 --cold            # CACHEDB a new file: every kernel compiled again
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(stages: int, model: str | None, cold: bool, timeout_s: float) -> dict:
    """One `ppsmoke.py --seed` run: launch to exit, its answer, and each stage's logged events."""
    env = dict(os.environ)
    if cold:  # tinygrad's cache database: a new file holds no compiled kernel
        env["CACHEDB"] = str(Path(tempfile.mkdtemp(prefix="pp-boot-cache-")) / "cache.db")
    cmd = [sys.executable, "ppsmoke.py", "--seed", "-n", str(stages), *(["--model", model] if model else [])]
    launched = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    took = time.time() - launched
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    run_dir = Path(re.search(r"logs in (\S+)", done.stderr).group(1))
    converge = float(re.search(r"converged in ([0-9.]+) s", done.stderr).group(1))
    logs = [_events(run_dir / f"stage{i}.log") for i in range(stages)]
    return {"launch_to_exit_s": took, "converge_s": converge, "answer": done.stdout.strip().splitlines()[0],
            "stages": [_timeline(events, launched) for events in logs]}


def _events(path: Path) -> dict[str, dict]:
    """The first record of each event a stage logged."""
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        out.setdefault(record.get("event", ""), record)
    return out


def _at(record: dict | None, launched: float) -> float | None:
    if record is None:
        return None
    ts = datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
    return ts - launched


def _timeline(events: dict[str, dict], launched: float) -> dict:
    ready = events.get("worker_ready", {})
    return {"imported_s": events.get("imported", {}).get("seconds"),
            "listening_at": _at(events.get("listening"), launched),
            "open_model_s": ready.get("open_model_s"), "weights_s": ready.get("weights_s"),
            "capture_s": ready.get("capture_s"), "capture_by_bucket_s": ready.get("capture_by_bucket_s", {}),
            "ready_at": _at(events.get("worker_ready"), launched), "serving_at": _at(events.get("serving"), launched),
            "first_steps": events.get("first_steps", {}).get("steps", [])}


def _f(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def _steps(steps: list) -> str:
    """A stage's first logged steps (rows, compute ms): a compile would stand out as a max far above the median."""
    if not steps:
        return "—"
    ms = sorted(m for _, m in steps)
    rows, top = max(steps, key=lambda s: s[1])
    return f"{ms[len(ms) // 2]:.1f} / {top:.1f} ({rows})"


def table(run: dict, label: str) -> str:
    lines = [f"{label}: launch to exit {run['launch_to_exit_s']:.1f} s, converge {run['converge_s']:.1f} s",
             "", "| stage | imports s | listening at | open model s | weights s | capture s (by bucket) | ready at "
             "| serving at | first steps ms: median / max (rows of the max) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(run["stages"]):
        buckets = " / ".join(f"{v:.2f}" for v in s["capture_by_bucket_s"].values())
        lines.append(f"| {i} | {_f(s['imported_s'])} | {_f(s['listening_at'])} | {_f(s['open_model_s'])} "
                     f"| {_f(s['weights_s'])} | {_f(s['capture_s'])} ({buckets}) | {_f(s['ready_at'])} "
                     f"| {_f(s['serving_at'])} | {_steps(s['first_steps'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.boot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--model", help="ppsmoke's --model (default: its own)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="each run with an empty kernel cache (a new CACHEDB)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", type=Path, help="also write the runs as JSON here")
    args = p.parse_args()
    runs = []
    for n in range(args.runs):
        run = run_once(args.stages, args.model, args.cold, args.timeout)
        runs.append(run)
        print(table(run, f"run {n + 1} ({'cold' if args.cold else 'cache as it is'}), N = {args.stages}"), "\n",
              flush=True)
    print("answers equal:", len({r["answer"] for r in runs}) == 1, "—", runs[0]["answer"][:80])
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
