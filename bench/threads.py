"""pp against llama.cpp at each thread count, side by side in one run, on one GGUF file (issue 38):
decode of one stream, a prompt of `--prompt-tokens`, and pp's step time by rows and threads.

Each round runs every configuration once, llama.cpp's and pp's alternately, so that a noisy neighbour
slows both rather than one; the table gives each configuration's median over the rounds and pp's ratio
to llama.cpp at the same thread count.

  python -m bench.threads $SMOLLM2_GGUF --llama-bench $B/llama-bench --threads 1 2 --rounds 3

- decode: llama-bench -p 0 -n 32 -t T, against bench.pipeline's one process (`--single`: the whole model,
  its head and greedy sampling, a token at a time), each in its own process.
- prompt: llama-bench -p 512 -n 0 -t T, against bench.step --prefill (the whole model and head, the prompt
  cut into the buckets a node captures).
- rows: bench.step's median step of 1 and 8 decode rows through every block, by threads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from .llamacpp import llama_bench, llama_prompt
from .pipeline import ROOT


def pp_decode(gguf: Path, threads: int, tokens: int) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--single", str(gguf), "--max-tokens", str(tokens),
                          "--repeats", "2", "--threads", str(threads)], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    runs = json.loads(out)["runs"]
    return 1000 / statistics.median(r["decode_ms_per_token"] for r in runs)


def pp_step(gguf: Path, blocks: int, threads: int, rows: list[int], prefill: int | None = None) -> list[float]:
    """bench.step's figures: tokens/s of a prefill, or ms per step for each of `rows`."""
    cmd = [sys.executable, "-m", "bench.step", "--model", str(gguf), "--blocks", str(blocks), "--threads", str(threads)]
    cmd += ["--head", "--prefill", str(prefill)] if prefill else ["--batch", *map(str, rows), "--steps", "30"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if " thread(s)" in line]
    if prefill:
        return [float(lines[-1].rsplit(" at ", 1)[1].split()[0])]
    return [float(line.split("median ", 1)[1].split()[0]) for line in lines]


def blocks_of(gguf: Path) -> int:
    from worker.weights.gguf import GGUFSource
    return GGUFSource(gguf).config.n_layers


def measure(args) -> dict:
    blocks, seen = blocks_of(args.gguf), {}

    def add(key, value):
        seen.setdefault(key, []).append(value)
    for r in range(args.rounds):
        for t in args.threads:
            add(("decode", "llama.cpp", t), llama_bench(args.llama_bench, args.gguf, t, args.max_tokens)["tokens_per_s"])
            add(("decode", "pp", t), pp_decode(args.gguf, t, args.max_tokens))
            if args.prompt_tokens:
                add(("prompt", "llama.cpp", t), llama_prompt(args.llama_bench, args.gguf, t, args.prompt_tokens)["tokens_per_s"])
                add(("prompt", "pp", t), pp_step(args.gguf, blocks, t, [], args.prompt_tokens)[0])
            for rows, ms in zip(args.rows, pp_step(args.gguf, blocks, t, args.rows)):
                add(("rows", rows, t), ms)
            print(f"done: round {r + 1}, {t} thread(s)", file=sys.stderr, flush=True)
    return {key: statistics.median(values) for key, values in seen.items()} | {"_all": seen}


def table(args, med: dict) -> str:
    lines = ["| what | threads | llama.cpp tok/s | pp tok/s | pp / llama.cpp |", "|---|---|---|---|---|"]
    for what in ("decode", "prompt"):
        for t in args.threads:
            if (what, "pp", t) in med:
                a, b = med[(what, "llama.cpp", t)], med[(what, "pp", t)]
                label = "decode, 1 stream" if what == "decode" else f"prompt of {args.prompt_tokens}"
                lines.append(f"| {label} | {t} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    lines += ["", "| rows a step | " + " | ".join(f"{t} thread(s) ms" for t in args.threads)
              + " | speed-up at the most threads |", "|---" * (len(args.threads) + 2) + "|"]
    for rows in args.rows:
        ms = [med[("rows", rows, t)] for t in args.threads]
        lines.append(f"| {rows} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[0] / ms[-1]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench binary")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512, help="0: no prompt rows")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    med = measure(args)
    command = "python -m bench.threads " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, "
              f"{platform.processor() or platform.machine()}, DEV={os.environ.get('DEV', '(tinygrad default)')}; "
              f"medians of {args.rounds} rounds\n")
    print(header + "\n" + table(args, med))
    if args.json:
        rows = {" ".join(map(str, k)): v for k, v in med["_all"].items()}
        args.json.write_text(json.dumps({"command": command, "machine": header, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
