"""Many streams from outside: K concurrent streamed chat completions (greedy, ignore_eos, `--max-tokens`
each) through `ppsmoke.py --seed -n N --serve`, sent by an OpenAI-style HTTP client as a user's would be,
against `llama-batched-bench` on the same GGUF file in the same run.

  DEV=CPU python -m bench.streams $SMOLLM2_GGUF --stages 2 --streams 8 --max-tokens 64 \\
      --batched-bench $B/llama-batched-bench --threads 2

pp's tokens/s: every completion token of a round (the streams' usage) over the round's wall time, from
sending the K requests at once to the last stream's end (prompts' prefill included). llama-batched-bench's
is its generation-only figure (`speed_tg`, `-npp 32 -ntg max_tokens -npl K`), so the ratio slightly favours
llama.cpp. The gap between tokens pools every stream's gaps between chunks as the client received them.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

from .cluster import http, start_served_cluster
from .llamacpp import llama_batched
from .prefix import API_KEY, QUESTIONS, TIMEOUT, Answer, Api, chat, served_model


async def one_round(client: httpx.AsyncClient, api: Api, streams: int, max_tokens: int) -> dict:
    results: list[Answer] = []

    async def one(i: int) -> None:
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        results.append(await chat(client, api, messages, max_tokens, extra={"ignore_eos": True}))
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    wall = time.monotonic() - started
    gaps = [b - a for r in results for a, b in zip(r.times, r.times[1:])]
    tokens = sum(r.completion_tokens for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "gap_p50_ms": 1000 * statistics.median(gaps), "gap_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))]}


async def served(model: str, n: int, streams: int, max_tokens: int, rounds: int) -> list[dict]:
    async with trio.open_nursery() as nursery:
        run = await start_served_cluster(nursery, model, n, api_key=API_KEY)
        async with http(timeout=TIMEOUT, limits=httpx.Limits(max_connections=streams + 4)) as client:
            api = await served_model(client, run.holders()[0][0])
            await one_round(client, api, streams, max_tokens)  # warm-up: every bucket's first use
            out = [await one_round(client, api, streams, max_tokens) for _ in range(rounds)]
        nursery.cancel_scope.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path, help="the GGUF file both engines run")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up; the median is reported")
    p.add_argument("--batched-bench", type=Path, help="llama.cpp's llama-batched-bench binary (the anchor)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (-t)")
    args = p.parse_args(argv)
    rounds = trio.run(served, str(args.gguf), args.stages, args.streams, args.max_tokens, args.rounds)
    best = sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]
    anchor = (llama_batched(args.batched_bench, args.gguf, args.threads, args.streams, args.max_tokens, prompt=32)
              if args.batched_bench else None)
    command = "python -m bench.streams " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, DEV={os.environ.get('DEV', '(tinygrad default)')}\n")
    print("| engine | streams × tokens | tok/s | gap p50 / p99 ms | against llama-batched-bench |\n|---|---|---|---|---|")
    ratio = f"{best['tokens_per_s'] / anchor['tokens_per_s']:.2f}×" if anchor else "—"
    each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in rounds)
    print(f"| pp, N = {args.stages}, `ppsmoke.py --seed --serve` (median of {len(rounds)} rounds: "
          f"{each}) | {args.streams} × {args.max_tokens} | "
          f"{best['tokens_per_s']:.1f} | {best['gap_p50_ms']:.0f} / {best['gap_p99_ms']:.0f} | {ratio} |")
    if anchor:
        print(f"| {anchor['engine']}, -t {args.threads} (`{anchor['command']}`) | {args.streams} × {args.max_tokens} | "
              f"{anchor['tokens_per_s']:.1f} | — | 1 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
