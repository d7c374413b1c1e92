"""One stream's decode in one process, this checkout against another (a worktree of the commit before a change),
alternately, round by round, so that a noisy neighbour slows both: the paired before/after of a kernel change.

  git worktree add /tmp/before <commit>
  python -m bench.decode_pair --other /tmp/before --model smollm2:135m --kv-cache-dtype float16 --rounds 5

Each side runs in its own process (its own kernel library and cache entry), with its own environment where
`--env` / `--other-env` say (CC=clang-19, say, where the other checkout's kernels need a newer clang). A side's
figure is its process's median decode ms a token over `--repeats` answers after a warm one (the whole model,
its head and greedy sampling, a token at a time); the table gives each side's median over rounds and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
from worker.contract import GREEDY
from worker.models import open_model
from worker.sampling import sample
model, kv, threads, tokens, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
m = open_model(model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None, max_context=2048,
               threads=threads, kv_dtype=kv)
full = m.open_slice(range(m.total_blocks), embed=True, head=True)
full.warm_up(0)
ids = m.tokenizer().encode_chat("Say hello")
runs = []
for _ in range(repeats + 1):
    logits = full.forward(full.embed(ids), 0)
    first, pos, tok = time.perf_counter(), len(ids), sample(logits, GREEDY, None)
    for _ in range(tokens - 1):
        tok = sample(full.forward(full.embed([tok]), pos), GREEDY, None)
        pos += 1
    runs.append(1000 * (time.perf_counter() - first) / (tokens - 1))
print(json.dumps(sorted(runs[1:])[len(runs[1:]) // 2]))
"""


def decode_ms(tree: Path, env: dict[str, str], args) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.kv_cache_dtype, str(args.threads),
                          str(args.tokens), str(args.repeats)], cwd=tree, env={**os.environ, "DEV": "CPU",
                          "PYTHONPATH": str(tree), **env}, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def pairs(text: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", type=Path, required=True, help="the other checkout (the baseline)")
    p.add_argument("--env", nargs="*", default=[], metavar="K=V", help="this checkout's extra environment")
    p.add_argument("--other-env", nargs="*", default=[], metavar="K=V", help="the other's extra environment")
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--kv-cache-dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    this, other = [], []
    for r in range(args.rounds):
        this.append(decode_ms(ROOT, pairs(args.env), args))
        other.append(decode_ms(args.other, pairs(args.other_env), args))
        print(f"round {r + 1}: this {this[-1]:.2f} ms/token, other {other[-1]:.2f}", file=sys.stderr)
    a, b = statistics.median(this), statistics.median(other)
    print(f"| {args.model}, {args.kv_cache_dtype} KV, {args.threads} thread(s) | this {a:.2f} ms/token "
          f"({1000 / a:.1f} tok/s) | other {b:.2f} ({1000 / b:.1f} tok/s) | this / other {b / a:.3f}x speed |")
    print(json.dumps({"this_ms": this, "other_ms": other}))


if __name__ == "__main__":
    main()
