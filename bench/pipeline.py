"""Pipeline vs one process, same weights, one machine: time to converge, time to first token, decode
tokens/s (median of repeats, with spread), cost per hop, bytes on the wire per token, and each stage's
peak RSS and weight bytes. Writes a markdown table (and JSON) for docs/; `bench.report` draws the plot.

  python -m bench.pipeline --models tiny small --stages 2 3 5 --repeats 3 --json docs/pipeline.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from node.observe.hops import PARTS as HOP_PARTS
from worker.weights.contract import PRECISIONS
from worker.weights.fetch import DEFAULT_MODEL

from .cluster import member_http, start_local_cluster

ROOT = Path(__file__).resolve().parent.parent


def single_process(model: str, prompt: str, max_tokens: int, repeats: int, beam: int = 0,
                   precision: str = "auto", threads: int = 1) -> dict:
    """Runs in a child process (`--single`), so its RSS is its own: whole-model decode, warm JIT."""
    import resource

    from worker.config import DEFAULT_CONTEXT
    from worker.contract import GREEDY
    from worker.models import open_model
    from worker.sampling import sample
    model_ = open_model(model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None, precision=precision,
                        tuned=beam > 0, max_context=DEFAULT_CONTEXT, threads=threads)  # as a node: comparable memory
    full = model_.open_slice(range(model_.total_blocks), embed=True, head=True)
    full.warm_up(beam)
    ids = model_.tokenizer().encode_chat(prompt)
    runs = []
    for _ in range(repeats + 1):  # the first run compiles and captures the JIT
        start = time.perf_counter()
        logits = full.forward(full.embed(ids), 0)
        first = time.perf_counter()
        pos, tok = len(ids), sample(logits, GREEDY, None)
        for _ in range(max_tokens - 1):
            tok = sample(full.forward(full.embed([tok]), pos), GREEDY, None)
            pos += 1
        end = time.perf_counter()
        runs.append({"first_token_s": first - start, "decode_ms_per_token": 1000 * (end - first) / (max_tokens - 1)})
    return {"runs": runs[1:], "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "weight_bytes": full.weight_bytes, "kv_bytes": full.kv_bytes}


async def pipeline(model: str, n: int, prompt: str, max_tokens: int, repeats: int, beam: int = 0,
                   precision: str = "auto") -> dict:
    started, token = time.monotonic(), secrets.token_urlsafe(16)
    async with trio.open_nursery() as nursery:
        orch, urls = await start_local_cluster(nursery, model, n, token=token, extra_env={"PP_BEAM": str(beam),
                                                                                     "PP_PRECISION": precision})
        converge_s = time.monotonic() - started
        runs, tokens = [], 0
        for i in range(repeats + 1):  # the first request compiles and captures each stage's JIT
            if i == 1:  # the hop figures of the timed requests only
                async with member_http(orch) as client:
                    for u in urls:
                        (await client.post(u + "/v1/hops/reset")).raise_for_status()
            sent = time.monotonic()
            r = await orch.submit(prompt, max_tokens=max_tokens)
            assert r.error is None and len(r.token_ids) > 1, r.error or "one token is no decode to time"
            tokens += len(r.token_ids)  # a trained model may end its answer before max_tokens
            runs.append({"first_token_s": time.monotonic() - sent - r.decode_s, "tokens": len(r.token_ids),
                         "decode_ms_per_token": 1000 * r.decode_s / (len(r.token_ids) - 1)})
        async with member_http(orch) as client:
            health = [(await client.get(u + "/health")).json() for u in urls]
            figures = [(await client.get(u + "/v1/hops")).json() for u in urls]
        nursery.cancel_scope.cancel()
    wire = sum(b for h in health for path, b in h["body_bytes"].items() if path != "/v1/inference")
    return {"converge_s": converge_s, "runs": runs[1:], "stages": [
        {k: h[k] for k in ("stage", "layers", "weight_bytes", "kv_bytes", "peak_rss_bytes")} for h in health],
        "wire_bytes_per_token": wire / tokens, "hops": hop_breakdown(figures)}


def hop_breakdown(figures: list[dict]) -> list[dict]:
    """Per hop (stage i -> its next; the last -> stage 0), its parts from both ends: the sender's encode and
    wait for the answer, the receiver's wire, queue, and the step it ran (hand-offs and compute)."""
    n, rows = len(figures), []
    for i in range(n):
        j = (i + 1) % n
        sender, receiver = figures[i].get(f"to pp-stage-{j}", {}), figures[j].get(f"from pp-stage-{i}", {})
        step = figures[j].get("step", {})
        parts = {"encode": sender.get("encode"), "wire": receiver.get("wire"), "queue": receiver.get("queue"),
                 "to_thread": step.get("to_thread"), "compute": step.get("compute"), "back": step.get("back"),
                 "answer": sender.get("answer")}
        rows.append({"hop": f"{i}→{j}", **parts})
    return rows


def summarize(model: str, n: int, result: dict, single_ms: float | None) -> dict:
    decode = [r["decode_ms_per_token"] for r in result["runs"]]
    ms = statistics.median(decode)
    row = {"model": model, "stages": n, "decode_ms_per_token": ms, "spread_ms": [min(decode), max(decode)],
           "tokens_per_s": 1000 / ms, "first_token_s": statistics.median(r["first_token_s"] for r in result["runs"]),
           "converge_s": result.get("converge_s"), "peak_rss_mb": [], "weight_mb": [], "kv_mb": []}
    if n:
        row["hops"] = result["hops"]
        row["cost_per_hop_ms"] = (ms - single_ms) / n  # a token crosses n - 1 activation hops and the feedback
        row["wire_bytes_per_token"] = result["wire_bytes_per_token"]
        row["peak_rss_mb"] = [s["peak_rss_bytes"] / 2**20 for s in result["stages"]]
        row["weight_mb"] = [s["weight_bytes"] / 2**20 for s in result["stages"]]
        row["kv_mb"] = [s["kv_bytes"] / 2**20 for s in result["stages"]]
    else:
        row["peak_rss_mb"], row["weight_mb"] = [result["peak_rss_bytes"] / 2**20], [result["weight_bytes"] / 2**20]
        row["kv_mb"] = [result["kv_bytes"] / 2**20]
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | stages | decode ms/token (min–max) | tok/s | first token s | converge s | cost/hop ms | "
           "wire B/token | peak RSS MB per stage | weights MB per stage | KV MB per stage | RSS ÷ (weights + KV) |",
           "|" + "---|" * 12]
    for r in rows:
        f = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
        out.append(f"| {r['model']} | {r['stages'] or '1 process'} | {f(r['decode_ms_per_token'])} "
                   f"({f(r['spread_ms'][0])}–{f(r['spread_ms'][1])}) | {f(r['tokens_per_s'])} | "
                   f"{f(r['first_token_s'], 2)} | {f(r['converge_s'])} | {f(r.get('cost_per_hop_ms'), 2)} | "
                   f"{f(r.get('wire_bytes_per_token'), 0)} | {' / '.join(f'{v:.0f}' for v in r['peak_rss_mb'])} | "
                   f"{' / '.join(f'{v:.1f}' for v in r['weight_mb'])} | {' / '.join(f'{v:.1f}' for v in r.get('kv_mb', []))} | "
                   f"{' / '.join(f'{p / (w + k):.2f}' for p, w, k in zip(r['peak_rss_mb'], r['weight_mb'], r.get('kv_mb', [])))} |")
    return "\n".join(out)


def hop_table(rows: list[dict]) -> str:
    """Median / p99 ms of each part of each hop; compute etc. are the receiving stage's steps."""
    out = ["| model | stages | hop | " + " | ".join(HOP_PARTS) + " |", "|" + "---|" * (3 + len(HOP_PARTS))]
    for r in rows:
        for hop in r.get("hops", []):
            cells = ["—" if hop[p] is None else f"{hop[p]['median_ms']:.2f} / {hop[p]['p99_ms']:.2f}"
                     for p in HOP_PARTS]
            out.append(f"| {r['model']} | {r['stages']} | {hop['hop']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3, 5])
    p.add_argument("--prompt", default="Say hello")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed requests per configuration, after one warm-up")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--beam", type=int, default=0, help="kernel search at warm-up, one process and every stage (PP_BEAM)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="which weights keep the file's precision (PP_PRECISION; weights.contract.narrow_kinds)")
    p.add_argument("--threads", type=int, default=1, help="the one process's threads (ppnode --threads)")
    p.add_argument("--single", help=argparse.SUPPRESS)  # internal: run the one-process baseline for this model
    args = p.parse_args(argv)
    if args.single:
        print(json.dumps(single_process(args.single, args.prompt, args.max_tokens, args.repeats, args.beam,
                                        args.precision, args.threads)))
        return 0
    rows = []
    for model in args.models:
        out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--single", model, "--max-tokens",
                              str(args.max_tokens), "--repeats", str(args.repeats), "--prompt", args.prompt,
                              "--beam", str(args.beam), "--precision", args.precision, "--threads", str(args.threads)],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
        rows.append(summarize(model, 0, json.loads(out), None))
        single_ms = rows[-1]["decode_ms_per_token"]
        for n in args.stages:
            result = trio.run(pipeline, model, n, args.prompt, args.max_tokens, args.repeats, args.beam,
                              args.precision)
            rows.append(summarize(model, n, result, single_ms))
            print(f"done: {model} x {n}", file=sys.stderr, flush=True)
    command = "python -m bench.pipeline " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, DEV={os.environ.get('DEV', '(tinygrad default)')}, "
              f"PP_LINKS={os.environ.get('PP_LINKS', 'stream')}, precision {args.precision}\n")
    print(header + "\n" + table(rows))
    print("\nPer hop, median / p99 ms (encode and answer on the sender; wire, queue and the step on the receiver; "
          f"links: {os.environ.get('PP_LINKS', 'stream')})\n\n" + hop_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
