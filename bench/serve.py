"""Many requests at once: K = 1, 2, 4, 8, 16 concurrent requests through a real local cluster of N stages,
and through one process running the same batched scheduler over the whole model. For each: aggregate
decode tokens/s, time to first token and time between tokens (p50, p99). Writes a markdown table (and
JSON) for docs/; `--plot` draws tokens/s against K.

  DEV=CPU python -m bench.serve --models tiny --stages 2 3 5 --concurrency 1 2 4 8 16 --json docs/serve-tiny.json

All K requests are sent at once. Tokens/s is every generated token over the wall time from sending to the
last answer. Time to first token is, per request, its answer's arrival less its decode time (first to last
token, on the last stage's clock): the prompt's trip through the chain plus any wait for a slot. Time
between tokens pools the gaps between consecutive tokens of every request (the last stage's clock).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import http, start_local_cluster

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Say hello", "What is the capital of France?", "Write a haiku about the sea.", "Why?",
           "List three prime numbers.", "Tell me a story about a cat who learned to fly.", "ok",
           "Explain pipelines in one sentence."]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(model: str, n: int, k: int, wall_s: float, answers: list[dict]) -> dict:
    """answers: per request, `tokens`, `ttft_s` and `token_ms` (times of its tokens after its first)."""
    gaps = [b - a for r in answers for a, b in zip(r["token_ms"], r["token_ms"][1:])]
    tokens = sum(r["tokens"] for r in answers)
    ttft = [r["ttft_s"] for r in answers]
    return {"model": model, "stages": n, "concurrency": k, "tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tbt_p50_ms": percentile(gaps, 50), "tbt_p99_ms": percentile(gaps, 99)}


# -- one process: the stages' scheduler over one whole-model slice --------------------------------------

def median_run(runs: list[dict]) -> dict:
    """Of repeated runs of one configuration, the one with the median tokens/s (these machines are noisy)."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "repeats_tokens_per_s": [round(r["tokens_per_s"], 2) for r in runs]}


def one_process(model_name: str, concurrency: list[int], max_tokens: int, max_seqs: int, repeats: int) -> list[dict]:
    """Runs in a child process (`--single`): the whole model in one slice, driven by the same step planner
    the stages use (roles.schedule), with the same slots and batch buckets; greedy."""
    from worker.config import DEFAULT_CONTEXT
    from worker.models import open_model
    model = open_model(model_name, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None,
                       max_context=DEFAULT_CONTEXT)  # as a node's
    full = model.open_slice(range(model.total_blocks), embed=True, head=True, max_seqs=max_seqs)
    full.warm_up()
    tokenizer = model.tokenizer()
    serve_batch(full, tokenizer, PROMPTS[:2], max_tokens, max_seqs)  # warm-up
    rows = []
    for k in concurrency:
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            answers = serve_batch(full, tokenizer, [PROMPTS[i % len(PROMPTS)] for i in range(k)], max_tokens, max_seqs)
            runs.append(summarize(model_name, 0, k, time.perf_counter() - started, answers))
        rows.append(median_run(runs))
    return rows


def serve_batch(full, tokenizer, prompts: list[str], max_tokens: int, max_seqs: int) -> list[dict]:
    """Serve `prompts`, all arriving now, through one slice with the stages' planner; per-request figures."""
    from roles.schedule import StageQueue, Unit
    from worker.batching import Segment
    from worker.stopping import generation_done
    queue, t0 = StageQueue(full.max_batch), time.perf_counter()
    waiting, free = collections.deque(enumerate(prompts)), list(range(max_seqs))
    live, done = {}, {}
    while waiting or live:
        while waiting and free:
            rid, prompt = waiting.popleft()
            ids = tokenizer.encode_chat(prompt)
            live[rid] = {"slot": free.pop(0), "prompt_len": len(ids), "tokens": [], "times": []}
            queue.add(Unit(str(rid), 0, len(ids), False, tokens=tuple(ids)))
        step = queue.next_step()
        hidden = np.concatenate([full.embed(list(u.tokens)) for u in step.units])
        logits = full.forward_batch(hidden, [Segment(live[int(u.request_id)]["slot"], u.position, u.rows)
                                             for u in step.units])
        now = time.perf_counter()
        for u, row in zip(step.units, logits):
            rid, pos = int(u.request_id), u.position + u.rows
            req = live[rid]
            if pos < req["prompt_len"]:
                continue  # a prompt chunk before the last
            token = int(np.argmax(row))
            req["tokens"].append(token)
            req["times"].append(now)
            if generation_done(token, generated=len(req["tokens"]), max_tokens=max_tokens, next_position=pos,
                               max_context=full.max_context, stop_ids=tokenizer.stop_ids):
                free.append(live.pop(rid)["slot"])
                done[rid] = {"tokens": len(req["tokens"]), "ttft_s": req["times"][0] - t0,
                             "token_ms": [1000 * (t - req["times"][0]) for t in req["times"]]}
            else:
                queue.add(Unit(u.request_id, pos, 1, True, tokens=(token,)))
    return [done[i] for i in range(len(prompts))]


# -- a cluster ---------------------------------------------------------------------------------------

async def cluster(model: str, n: int, concurrency: list[int], max_tokens: int, max_seqs: int,
                  repeats: int) -> list[dict]:
    async with trio.open_nursery() as nursery:
        orch, urls = await start_local_cluster(nursery, model, n, extra_env={"PP_MAX_SEQS": str(max_seqs),
                                                                             "PP_MAX_QUEUE": "256"})
        await serve_cluster(orch, PROMPTS[:2], max_tokens)  # warm-up
        rows = []
        for k in concurrency:
            runs = []
            for _ in range(repeats):
                before, started = await stage_counters(urls), time.monotonic()
                answers = await serve_cluster(orch, [PROMPTS[i % len(PROMPTS)] for i in range(k)], max_tokens)
                wall = max(a.pop("arrived") for a in answers) - started
                runs.append({**summarize(model, n, k, wall, answers),
                             "per_stage": stage_figures(before, await stage_counters(urls), wall)})
            rows.append(median_run(runs))
            print(f"  {model} N={n} K={k}: {rows[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()
    return rows


async def stage_counters(urls: list[str]) -> list[dict]:
    async with http() as client:
        return [(await client.get(u + "/health")).json() for u in urls]


def stage_figures(before: list[dict], after: list[dict], wall_s: float) -> list[dict]:
    """Per stage over one run: steps, rows per step, and the share of the wall time spent in compute."""
    out = []
    for b, a in zip(before, after):
        steps, rows = a["steps"] - b["steps"], a["rows"] - b["rows"]
        out.append({"steps": steps, "rows": rows, "rows_per_step": round(rows / max(steps, 1), 2),
                    "compute_busy": round((a["compute_s"] - b["compute_s"]) / wall_s, 3)})
    return out


async def serve_cluster(orch, prompts: list[str], max_tokens: int) -> list[dict]:
    sent, answers = time.monotonic(), {}

    async def one(i: int, prompt: str) -> None:
        r = await orch.submit(prompt, max_tokens=max_tokens)
        if r.error:
            raise RuntimeError(f"request failed: {r.error}")
        arrived = time.monotonic()
        answers[i] = {"tokens": len(r.token_ids), "ttft_s": arrived - sent - r.decode_s,
                      "token_ms": list(r.token_ms), "arrived": arrived}
    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(prompts):
            nursery.start_soon(one, i, prompt)
    return [answers[i] for i in range(len(prompts))]


# -- report ------------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    out = ["| model | stages | K | tokens | tok/s | × K=1 | TTFT p50 / p99 s | between tokens p50 / p99 ms |",
           "|" + "---|" * 8]
    base = {(r["model"], r["stages"]): r["tokens_per_s"] for r in rows if r["concurrency"] == 1}
    for r in rows:
        f = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
        gain = r["tokens_per_s"] / base[(r["model"], r["stages"])] if (r["model"], r["stages"]) in base else None
        out.append(f"| {r['model']} | {r['stages'] or '1 process'} | {r['concurrency']} | {r['tokens']} | "
                   f"{f(r['tokens_per_s'])} | {f(gain, 2)} | {f(r['ttft_p50_s'], 2)} / {f(r['ttft_p99_s'], 2)} | "
                   f"{f(r['tbt_p50_ms'])} / {f(r['tbt_p99_ms'])} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for n in sorted({r["stages"] for r in rows if r["model"] == model}):
            pts = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["model"] == model and r["stages"] == n]
            ax.plot(*zip(*pts), marker="o", label="1 process" if n == 0 else f"N = {n}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests K")
        ax.set_ylabel("aggregate tokens/s (prompts included)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3, 5])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-seqs", type=int, default=16, help="slots per stage (default 16: every K fits at once)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the median is reported")
    p.add_argument("--no-single", action="store_true", help="skip the one-process baseline")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--plot", type=Path, help="draw tokens/s against K into this PNG (needs matplotlib)")
    p.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                   help="run nothing: print the table of these --json files (and --plot them together)")
    p.add_argument("--single", help=argparse.SUPPRESS)  # internal: the one-process baseline for this model
    args = p.parse_args(argv)
    if args.report:
        rows = [r for path in args.report for r in json.loads(path.read_text())["rows"]]
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    if args.single:
        print(json.dumps(one_process(args.single, args.concurrency, args.max_tokens, args.max_seqs, args.repeats)))
        return 0
    rows = []
    for model in args.models:
        if not args.no_single:
            out = subprocess.run([sys.executable, "-m", "bench.serve", "--single", model, "--max-tokens",
                                  str(args.max_tokens), "--max-seqs", str(args.max_seqs), "--repeats",
                                  str(args.repeats), "--concurrency",
                                  *map(str, args.concurrency)], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout
            rows += json.loads(out)
            print(f"done: {model}, one process", file=sys.stderr, flush=True)
        for n in args.stages:
            rows += trio.run(cluster, model, n, args.concurrency, args.max_tokens, args.max_seqs, args.repeats)
    command = "python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, DEV={os.environ.get('DEV', '(tinygrad default)')}\n")
    print(header + "\n" + table(rows))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": header, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
