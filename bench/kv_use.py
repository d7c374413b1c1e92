"""KV memory by use (issue 39): `ppsmoke.py --seed -n 2 --serve --ctx 8192 --max-seqs 16` on the default model
serves, at once, one chat after a system prompt of about `--long-tokens` tokens and 15 short chats. Every answer
must complete; then each stage's peak RSS (VmHWM, from /proc) is read beside the KV it reserves and its weights
(its `worker_ready` log line).

  DEV=CPU python -m bench.kv_use --json docs/kv-use-smollm2.json
  DEV=CPU python -m bench.kv_use --kv-cache-dtype float32
  DEV=CPU python -m bench.kv_use --ctx 2048 --long-tokens 1500 --kv-cache-memory 1 --solo   # a burst past the budget

With `--kv-cache-memory` the stages' KV budget (issue 39: stage 0 admits, evicts and preempts by it) is smaller
than the burst needs; `--solo` then asks every chat again alone, one at a time, and counts the answers that equal
the burst's (greedy). Stage 0's /health says how many requests were preempted.

The KV caches are reserved for every slot's whole context but take memory only as requests write them, and a
finished request's slot gives its memory back (worker/files.py, StageModel.trim), so the peak follows what the
requests hold, not `--ctx` × `--max-seqs`. Exits 1 if a request fails or a stage's peak is over `--limit-mb`.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import httpx
import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import http, start_served_cluster
from .prefix import API_KEY, RULES, TIMEOUT, Api, chat, served_model

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "What is 2 + 2?",
             "Name a fruit.", "Give me one word for happy.", "What day comes after Monday?", "Name an animal.",
             "What is water made of?", "Name a planet.", "How many legs has a spider?", "Say goodbye.",
             "Name a month.", "What is the opposite of hot?", "Name a musical instrument."]


def long_system(rules: int) -> str:
    """A system prompt of `rules` numbered rules, RULES over and over."""
    return " ".join(f"Rule {j + 1}: {RULES[j % len(RULES)]}" for j in range(rules))


async def rules_for(client: httpx.AsyncClient, api: Api, target_tokens: int) -> tuple[int, int]:
    """How many rules make a system prompt of about `target_tokens` tokens, and its tokens (by /tokenize)."""
    async def count(rules: int) -> int:
        body = {"model": api.model, "messages": [{"role": "system", "content": long_system(rules)}],
                "add_generation_prompt": False}
        r = await client.post(api.url + "/tokenize", json=body, headers=api.headers)
        r.raise_for_status()
        return r.json()["count"]
    per_rule = await count(100) / 100
    rules = max(1, int(target_tokens / per_rule))
    return rules, await count(rules)


def stage_figures(pid: int) -> dict[str, int]:
    """A live process's peak and current resident memory, in bytes (/proc/PID/status)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return {"peak_rss_bytes": fields["VmHWM"], "rss_bytes": fields["VmRSS"]}


def ready_lines(log_dir: Path, stages: int, event: str = "worker_ready") -> list[dict]:
    """Each stage's first `event` line (worker_ready: weight_bytes, kv_bytes), from its log."""
    found = []
    for stage in range(stages):
        lines = (log_dir / f"stage{stage}.log").read_text().splitlines()
        found.append(next(json.loads(x) for x in lines if f'"event": "{event}"' in x))
    return found


async def measure(args) -> dict:
    flags = ("--ctx", str(args.ctx), "--max-seqs", str(args.max_seqs), "--kv-cache-dtype", args.kv_cache_dtype,
             "--kv-cache-memory", args.kv_cache_memory)
    async with trio.open_nursery() as nursery:
        run = await start_served_cluster(nursery, args.model, args.stages, api_key=API_KEY, args=flags)
        log_dir = Path(next(t for _, t in run.lines if "logs in " in t).split("logs in ")[1].split()[0])
        async with http(timeout=TIMEOUT, http2=True) as client:
            api = await served_model(client, run.holders()[0][0])
            rules, long_tokens = await rules_for(client, api, args.long_tokens)
            chats = [[{"role": "system", "content": long_system(rules)}, {"role": "user", "content": "Which rule is first?"}]]
            chats += [[{"role": "user", "content": q}] for q in QUESTIONS]
            answers: dict[int, object] = {}
            started = time.monotonic()

            async def one(i: int) -> None:
                try:
                    answers[i] = await chat(client, api, chats[i], args.max_tokens)
                except Exception as exc:  # the bench reports it; one failure must not hide the others
                    answers[i] = exc
            async with trio.open_nursery() as requests:
                for i in range(len(chats)):
                    requests.start_soon(one, i)
            took = time.monotonic() - started
            stages = [{**stage_figures(pid), **{k: line[k] for k in ("weight_bytes", "kv_bytes")},
                       **(await stage_kv(client, url))}
                      for (url, pid), line in zip([run.holders()[s] for s in range(args.stages)],
                                                  ready_lines(log_dir, args.stages))]
            solo = [await chat(client, api, c, args.max_tokens) for c in chats] if args.solo else []
        nursery.cancel_scope.cancel()
    failed = {i: repr(a) for i, a in answers.items() if isinstance(a, Exception) or not a.text}
    same = sum(not isinstance(answers[i], Exception) and answers[i].text == alone.text for i, alone in enumerate(solo))
    return {"long_prompt_tokens": long_tokens, "requests": len(chats), "completed": len(chats) - len(failed),
            "failed": failed, "seconds": round(took, 1), "stages": stages,
            **({"equal_to_solo": same} if args.solo else {})}


async def stage_kv(client: httpx.AsyncClient, url: str) -> dict:
    """A stage's KV figures from /health: the positions it may hold and, at stage 0, the preemptions."""
    health = (await client.get(url + "/health")).json()
    return {"kv_positions": health["kv_positions"]["total"], **({"kv": health["kv"]} if "kv" in health else {})}


def report(args, result: dict) -> str:
    mb = 2 ** 20
    rows = "\n".join(f"| {i} | {s['weight_bytes'] / mb:.0f} | {s['kv_bytes'] / mb:.0f} | {s['kv_positions']} "
                     f"| {s['peak_rss_bytes'] / mb:.0f} | {s['rss_bytes'] / mb:.0f} |" for i, s in enumerate(result["stages"]))
    kv = result["stages"][0].get("kv", {})
    solo = (f"; {result['equal_to_solo']} of {result['requests']} answers equal to the same chat asked alone"
            if "equal_to_solo" in result else "")
    return (f"Command: `python -m bench.kv_use {' '.join(sys.argv[1:])}`  \n"
            f"Machine: {platform.platform()}, Python {platform.python_version()}; --ctx {args.ctx} --max-seqs "
            f"{args.max_seqs} --kv-cache-dtype {args.kv_cache_dtype} --kv-cache-memory {args.kv_cache_memory}\n\n"
            f"{result['completed']} of {result['requests']} requests completed in {result['seconds']} s (one after a "
            f"system prompt of {result['long_prompt_tokens']} tokens, 15 short), {args.max_tokens} tokens each at most; "
            f"the chain's KV budget {kv.get('budget_positions')} positions, {kv.get('preemptions')} preemptions{solo}\n\n"
            f"| stage | weights MB | KV reserved MB | KV positions it may hold | peak RSS MB | RSS after MB |\n"
            f"|---|---|---|---|---|---|\n{rows}\n")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_use", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=("auto", "float16", "float32"), default="auto")
    p.add_argument("--kv-cache-memory", default="auto", help="each stage's KV budget, as ppsmoke's (auto)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--solo", action="store_true", help="then ask every chat alone and compare the answers")
    p.add_argument("--long-tokens", type=int, default=6000, help="the long chat's system prompt, in tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--limit-mb", type=float, default=1024, help="each stage's peak RSS at most (1024)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    result = trio.run(measure, args)
    print(report(args, result))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **result}, indent=1) + "\n")
    over = [s for s in result["stages"] if s["peak_rss_bytes"] > args.limit_mb * 2 ** 20]
    unequal = args.solo and result["equal_to_solo"] != result["requests"]
    sys.exit(1 if result["failed"] or over or unequal else 0)


if __name__ == "__main__":
    main()
