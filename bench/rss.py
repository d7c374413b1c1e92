"""Peak RSS per stage against what it must hold (issue 39): its weights and its KV pool (the positions its
`--kv-cache-memory` budget holds, at the defaults `auto`), at N = 1, 2 and 5, under a load that holds every slot.

  DEV=CPU python -m bench.rss --stages 1 2 5 --json docs/rss-smollm2.json

- N = 1: one process opens the whole model as one slice, as a node does at the defaults (--max-seqs, --ctx,
  --kv-cache-dtype), and computes `--prompt` rows then `--decode` tokens in every slot (batched steps). Its pool
  is what a node's auto budget would be (node/kv_memory.py).
- N >= 2: `ppsmoke.py --seed -n N --serve` at the defaults serves --max-seqs chats at once, each after a
  system prompt of about `--prompt` tokens of its own, `--decode` tokens each.
- The baseline: a process that imports what a node imports and runs one tinygrad kernel on the CPU, no model:
  what Python and tinygrad cost any stage. A thin slice (N = 5) weighs less than that, so its figure is
  (peak RSS - baseline) / (weights + pool), beside peak RSS / (weights + pool).
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import http, start_served_cluster
from .kv_use import long_system, ready_lines, rules_for, stage_figures
from .prefix import API_KEY, TIMEOUT, chat, served_model

MB = 2 ** 20


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def baseline() -> dict:
    """In this process: what a node imports, one kernel on the CPU device; its peak RSS."""
    importlib.import_module("node.main")  # what a node imports: the measure
    from tinygrad import Tensor
    (Tensor.ones(64, 64) @ Tensor.ones(64, 64)).realize()
    return {"peak_rss_bytes": peak_rss()}


def one_process(model_spec: str, prompt: int, decode: int) -> dict:
    """In this process: the whole model in one slice at a node's defaults, every slot filled by real steps."""
    from node.kv_memory import stage_positions
    from node.config.settings import DEFAULT_MAX_SEQS  # a node's, not the library's
    from worker.batching import Segment
    from worker.calibrate import available_memory
    from worker.config import DEFAULT_CONTEXT
    from worker.models import open_model
    model = open_model(model_spec, cache_dir=Path("/tmp"), ollama_models_dir=None, max_context=DEFAULT_CONTEXT,
                       kv_dtype="float16")
    tokenizer = model.tokenizer()  # kept, as a node's stage does
    s = model.open_slice(range(model.total_blocks), embed=True, head=True, max_seqs=DEFAULT_MAX_SEQS)
    s.warm_up(lazy=True)
    ids = tokenizer.encode_chat("Tell me about the rivers of Europe. " * (prompt // 8))[:prompt]
    for slot in range(DEFAULT_MAX_SEQS):
        for at in range(0, len(ids), 8):
            chunk = ids[at:at + 8]
            s.forward_batch(s.embed(chunk), [Segment(slot, at, len(chunk))])
    for step in range(decode):
        rows = s.embed([ids[step % len(ids)]] * DEFAULT_MAX_SEQS)
        s.forward_batch(rows, [Segment(slot, len(ids) + step, 1) for slot in range(DEFAULT_MAX_SEQS)])
    slots_bytes = s.kv_bytes * DEFAULT_MAX_SEQS // (DEFAULT_MAX_SEQS + 1)
    pool = stage_positions(None, kv_bytes=slots_bytes, slot_positions=DEFAULT_MAX_SEQS * DEFAULT_CONTEXT,
                           max_context=DEFAULT_CONTEXT, available=available_memory())
    return {"weight_bytes": s.weight_bytes, "pool_bytes": pool.memory_bytes, "peak_rss_bytes": peak_rss(),
            "kv_used_bytes": round(slots_bytes / (DEFAULT_MAX_SEQS * DEFAULT_CONTEXT)
                                   * DEFAULT_MAX_SEQS * (len(ids) + decode))}


def child(mode: str, args) -> dict:
    """Run `mode` in a fresh process (peak RSS only grows in a process) and return what it printed."""
    out = subprocess.run([sys.executable, "-m", "bench.rss", "--child", mode, "--model", args.model,
                          "--prompt", str(args.prompt), "--decode", str(args.decode)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


async def cluster(args, n: int) -> list[dict]:
    """A served cluster at the defaults under --max-seqs chats at once; each stage's figures."""
    async with trio.open_nursery() as nursery:
        run = await start_served_cluster(nursery, args.model, n, api_key=API_KEY)
        log_dir = Path(next(t for _, t in run.lines if "logs in " in t).split("logs in ")[1].split()[0])
        async with http(timeout=TIMEOUT, http2=True) as client:
            api = await served_model(client, run.holders()[0][0])
            rules, _ = await rules_for(client, api, args.prompt)
            slots = (await client.get(run.holders()[0][0] + "/health")).json()["max_seqs"]
            chats = [[{"role": "system", "content": f"Assistant {i}. " + long_system(rules)},
                      {"role": "user", "content": "Which rule is first?"}] for i in range(slots)]
            async with trio.open_nursery() as requests:
                for c in chats:
                    requests.start_soon(chat, client, api, c, args.decode, lambda count: None,
                                        {"ignore_eos": True})
            holders = [run.holders()[s] for s in range(n)]  # (url, pid) by stage
            health = [(await client.get(url + "/health")).json() for url, _ in holders]
            stages = [{**stage_figures(pid), "weight_bytes": h["weight_bytes"], "kv_bytes": h["kv_bytes"],
                       "pool_bytes": budget["memory_bytes"]}
                      for (_, pid), h, budget in zip(holders, health, ready_lines(log_dir, n, "kv_budget"))]
        nursery.cancel_scope.cancel()
    return stages


def report(rows: list[dict], base: int) -> str:
    out = ["| N | stage | weights MB | KV pool MB | peak RSS MB | RSS / (weights + pool) | "
           "(RSS - baseline) / (weights + pool) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        held = r["weight_bytes"] + r["pool_bytes"]
        out.append(f"| {r['n']} | {r['stage']} | {r['weight_bytes'] / MB:.0f} | {r['pool_bytes'] / MB:.0f} | "
                   f"{r['peak_rss_bytes'] / MB:.0f} | {r['peak_rss_bytes'] / held:.2f} | "
                   f"{(r['peak_rss_bytes'] - base) / held:.2f} |")
    return f"Baseline (imports and one kernel, no model): {base / MB:.0f} MB\n\n" + "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 5])
    p.add_argument("--prompt", type=int, default=500, help="each request's prompt, in tokens (about)")
    p.add_argument("--decode", type=int, default=64, help="tokens each request generates")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", choices=("baseline", "one"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(baseline() if args.child == "baseline" else one_process(args.model, args.prompt, args.decode)))
        return
    base = child("baseline", args)["peak_rss_bytes"]
    rows = []
    for n in args.stages:
        started = time.monotonic()
        stages = [child("one", args)] if n == 1 else trio.run(cluster, args, n)
        rows += [{"n": n, "stage": i, "seconds": round(time.monotonic() - started, 1), **s} for i, s in enumerate(stages)]
    print(f"Command: `python -m bench.rss {' '.join(sys.argv[1:])}`\n\n{report(rows, base)}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "baseline_bytes": base,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
