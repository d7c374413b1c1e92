"""Does a long prompt stall the streams already decoding? A real local cluster of N stages; one request
decodes a long answer while, a second after its first token, another request's long prompt is prefilled.
The decoding stream's time per token inside the prefill window is compared with the same stream's alone,
and the long prompt's time to first token is reported (what a small chunk costs it).

  DEV=CPU python -m bench.stall --stages 3 --prompt-tokens 450
  DEV=CPU python -m bench.stall --stages 3 --chunked-prefill-size 4 8 16

`--chunked-prefill-size` (SGLang's name; PP_CHUNKED_PREFILL_SIZE) is the prompt rows a stage's step takes at
most, beside its decode rows (roles/schedule.py). Each value is a fresh cluster.

Times: the stream's token times come from the last stage's clock (`token_ms`), placed on the runner's
clock by its arrival (all processes share this machine's monotonic clock); the window runs from sending
the long prompt to its first token's arrival. The stream has to outlast the window: raise
`--stream-tokens` if "tokens inside" is small.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import start_local_cluster

FILLER = ("The committee met on Tuesday to review the quarterly figures, the staffing plan and the schedule "
          "for the new warehouse, and agreed to meet again after the audit. ")


STREAM = "Count from 1 to 500, separated by commas."


async def stream_alone(orch, stream_tokens: int) -> tuple[float, float]:
    """The stream by itself: its median time per token (ms) and its time to first token (s)."""
    sent = time.monotonic()
    r = await orch.submit(STREAM, max_tokens=stream_tokens)
    first = time.monotonic() - r.decode_s
    gaps = [b - a for a, b in zip(r.token_ms, r.token_ms[1:])]
    return statistics.median(gaps), first - sent


async def stream_with_prompt(orch, prompt_words: str, stream_tokens: int, delay_s: float) -> dict:
    """The stream again; `delay_s` after sending it (past its first token), the long prompt (one token out).
    Returns the stream's gaps that end inside the long prompt's window, and that prompt's TTFT."""
    got: dict = {}

    async def stream() -> None:
        r = await orch.submit(STREAM, max_tokens=stream_tokens)
        first = time.monotonic() - r.decode_s
        got["stream"] = [first + ms / 1000 for ms in r.token_ms]

    async def prompt() -> None:
        await trio.sleep(delay_s)
        sent = time.monotonic()
        r = await orch.submit(prompt_words, max_tokens=1)
        got["window"] = (sent, time.monotonic())
        got["prompt_tokens"] = len(r.prompt_token_ids)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        nursery.start_soon(prompt)
    times, (start, end) = got["stream"], got["window"]
    inside = [1000 * (b - a) for a, b in zip(times, times[1:]) if start <= b <= end]
    return {"inside_ms": statistics.median(inside) if inside else None, "inside_max_ms": max(inside, default=None),
            "ttft_s": end - start, "prompt_tokens": got["prompt_tokens"], "tokens_inside": len(inside)}


async def measure(model: str, n: int, chunk: int | None, prompt_tokens: int, stream_tokens: int) -> dict:
    extra = {"PP_CHUNKED_PREFILL_SIZE": str(chunk)} if chunk else {}
    words = FILLER * max(1, prompt_tokens // 28) + "Summarise the meeting in one sentence."
    async with trio.open_nursery() as nursery:
        orch, _ = await start_local_cluster(nursery, model, n, extra_env=extra)
        await orch.submit("Say hello", max_tokens=4)  # warm-up
        alone_ms, ttft_s = await stream_alone(orch, stream_tokens)
        row = await stream_with_prompt(orch, words, stream_tokens, delay_s=ttft_s + 1.0)
        nursery.cancel_scope.cancel()
    return {"stages": n, "chunk": chunk, "outside_ms": alone_ms, **row}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=450, help="about this long a prompt (the filler's count)")
    p.add_argument("--stream-tokens", type=int, default=400)
    p.add_argument("--chunked-prefill-size", nargs="*", type=int, default=[0],
                   help="chunk sizes to compare (0: the node's default)")
    args = p.parse_args(argv)
    rows = [trio.run(measure, args.model, args.stages, b or None, args.prompt_tokens, args.stream_tokens)
            for b in args.chunked_prefill_size]
    command = "python -m bench.stall " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command}`  \nMachine: {platform.platform()}\n")
    print("| stages | chunked prefill size | prompt tokens | stream ms/token alone / during the prefill (worst) | "
          "× | tokens inside | long prompt's TTFT s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["inside_ms"] / r["outside_ms"] if r["inside_ms"] else float("nan")
        print(f"| {r['stages']} | {r['chunk'] or 'default'} | {r['prompt_tokens']} | {r['outside_ms']:.1f} / "
              f"{r['inside_ms'] or float('nan'):.1f} ({r['inside_max_ms'] or float('nan'):.0f}) | {ratio:.2f} | "
              f"{r['tokens_inside']} | "
              f"{r['ttft_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
