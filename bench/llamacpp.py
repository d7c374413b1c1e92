"""pp against llama.cpp on the same GGUF file, on this machine: decode tokens/s and peak RSS, and with
`--prompt-tokens` prompt processing, with `--batched-bench` many streams.

llama.cpp's side is its own `llama-bench` (decode of `--max-tokens` tokens, no prompt; prompt processing
of `--prompt-tokens`), at each thread count asked, `llama-batched-bench` (`--parallel` sequences, its
generation tokens/s), and, as the pipeline anchor, its RPC backend: the layers split over `--rpc-servers`
`rpc-server` processes on loopback, one thread each. pp's side is `bench.pipeline`'s: one process, then
N-stage clusters. llama.cpp is not a dependency: build it yourself (docs/benchmarks.md says how) and
name its binaries.

  python -m bench.make_gguf /tmp/bench-f32.gguf
  python -m bench.llamacpp /tmp/bench-f32.gguf --llama-bench ~/llama.cpp/build/bin/llama-bench \\
      --rpc-server ~/llama.cpp/build/bin/rpc-server --threads 1 2 --stages 2 --json /tmp/llamacpp.json
  python -m bench.llamacpp $SMOLLM2_GGUF --llama-bench $B/llama-bench --batched-bench $B/llama-batched-bench \\
      --threads 1 2 --stages 2 --prompt-tokens 512 --parallel 8

pp's prompt rows: one process (`bench.step --prefill`, the whole model) and the time to first token of a
prompt of that many tokens through N = 2 (tokens / TTFT). pp's many streams: `bench.serve`'s cluster of
N = 2 with `--parallel` concurrent requests of `--max-tokens` (generated tokens over the wall time, short
prompts' prefill included; llama-batched-bench's figure counts generation time only).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

from worker.batching import DEFAULT_MAX_SEQS
from worker.weights.contract import PRECISIONS

from .pipeline import ROOT, pipeline, summarize


def llama_bench(binary: Path, gguf: Path, threads: int, tokens: int, rpc: str | None = None) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3", "-o", "json"]
    if rpc:
        cmd += ["--rpc", rpc, "-ngl", "99"]
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB=%M", *cmd], check=True, capture_output=True, text=True)
    [result] = json.loads(done.stdout)
    rss_kb = int(done.stderr.rsplit("PEAK_RSS_KB=", 1)[1].split()[0])
    return {"engine": "llama.cpp" + (" RPC, 2 servers" if rpc else ""), "threads": threads,
            "tokens_per_s": result["avg_ts"], "peak_rss_mb": None if rpc else rss_kb / 1024, "command": " ".join(cmd)}


def llama_prompt(binary: Path, gguf: Path, threads: int, tokens: int) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "2", "-o", "json"]
    [result] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {"engine": f"llama.cpp, prompt of {tokens}", "threads": threads, "tokens_per_s": result["avg_ts"],
            "peak_rss_mb": None, "command": " ".join(cmd)}


def llama_batched(binary: Path, gguf: Path, threads: int, parallel: int, tokens: int, prompt: int = 128) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-c", "4096", "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(parallel),
           "-t", str(threads), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"speed_tg"' in line][-1]
    return {"engine": f"llama-batched-bench, {parallel} sequences", "threads": threads,
            "tokens_per_s": row["speed_tg"], "peak_rss_mb": None, "command": " ".join(cmd)}


def pp_prompt_one_process(gguf: Path, tokens: int) -> float:
    from worker.models import open_model
    import tempfile
    model = open_model(str(gguf), cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None)
    blocks = str(model.total_blocks)
    out = subprocess.run([sys.executable, "-m", "bench.step", "--model", str(gguf), "--blocks", blocks, "--head",
                          "--prefill", str(tokens)], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return float(out.rsplit(" at ", 1)[1].split()[0])


def long_prompt(gguf: Path, tokens: int) -> str:
    """A raw prompt of exactly `tokens` tokens of the model's vocabulary (plain words)."""
    from worker.models import open_model
    import tempfile
    tok = open_model(str(gguf), cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None).tokenizer()
    words = "the committee met on tuesday to review the quarterly figures and the new schedule " * (tokens // 4)
    return tok.decode(tok.encode(words)[:tokens])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_servers(binary: Path, n: int):
    """n rpc-server processes on loopback, one thread each; yields their "host:port,…" list."""
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(p), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        time.sleep(2.0)  # they listen within a second; llama-bench fails loudly if one does not
        yield ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def pp_one_process(gguf: Path, tokens: int, repeats: int, beam: int, precision: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--single", str(gguf), "--max-tokens", str(tokens),
                          "--repeats", str(repeats), "--beam", str(beam), "--precision", precision], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench binary")
    p.add_argument("--rpc-server", type=Path, help="llama.cpp's rpc-server binary (the RPC row)")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--stages", nargs="*", type=int, default=[2])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--beam", type=int, default=0, help="pp: kernel search at warm-up (PP_BEAM)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="pp: which weights keep the file's precision (PP_PRECISION; weights.contract.narrow_kinds)")
    p.add_argument("--prompt-tokens", type=int, help="also prompt processing of this many tokens")
    p.add_argument("--batched-bench", type=Path, help="llama.cpp's llama-batched-bench binary (the many-streams rows)")
    p.add_argument("--parallel", type=int, default=8, help="sequences / concurrent requests for the many-streams rows")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = []
    for t in args.threads:
        rows.append(llama_bench(args.llama_bench, args.gguf, t, args.max_tokens))
        print(f"done: llama.cpp, {t} threads", file=sys.stderr, flush=True)
    if args.prompt_tokens:
        rows += [llama_prompt(args.llama_bench, args.gguf, t, args.prompt_tokens) for t in args.threads]
    if args.batched_bench:
        rows.append(llama_batched(args.batched_bench, args.gguf, max(args.threads), args.parallel, args.max_tokens))
    if args.rpc_server:
        with rpc_servers(args.rpc_server, 2) as servers:
            rows.append(llama_bench(args.llama_bench, args.gguf, 1, args.max_tokens, rpc=servers))
    single = pp_one_process(args.gguf, args.max_tokens, args.repeats, args.beam, args.precision)
    base = summarize(str(args.gguf), 0, single, None)
    rows.append({"engine": f"pp, one process (beam {args.beam}, {args.precision})", "threads": None, "tokens_per_s": base["tokens_per_s"],
                 "peak_rss_mb": base["peak_rss_mb"][0], "weight_mb": base["weight_mb"][0], "kv_mb": base["kv_mb"][0]})
    for n in args.stages:
        result = trio.run(pipeline, str(args.gguf), n, "Say hello", args.max_tokens, args.repeats, args.beam,
                          args.precision)
        row = summarize(str(args.gguf), n, result, base["decode_ms_per_token"])
        rows.append({"engine": f"pp, N = {n} (beam {args.beam}, {args.precision})", "threads": None, "tokens_per_s": row["tokens_per_s"],
                     "peak_rss_mb": max(row["peak_rss_mb"]), "weight_mb": row["weight_mb"], "kv_mb": row["kv_mb"],
                     "rss_mb": row["peak_rss_mb"]})
        print(f"done: pp x {n}", file=sys.stderr, flush=True)
    if args.prompt_tokens:
        rows.append({"engine": f"pp, one process, prompt of {args.prompt_tokens}", "threads": None,
                     "tokens_per_s": pp_prompt_one_process(args.gguf, args.prompt_tokens), "peak_rss_mb": None})
        for n in args.stages:
            result = trio.run(pipeline, str(args.gguf), n, long_prompt(args.gguf, args.prompt_tokens), 2,
                              args.repeats, args.beam, args.precision)
            ttft = statistics.median(r["first_token_s"] for r in result["runs"])
            rows.append({"engine": f"pp, N = {n}, prompt of {args.prompt_tokens} (tokens / TTFT {ttft:.2f} s)",
                         "threads": None, "tokens_per_s": args.prompt_tokens / ttft, "peak_rss_mb": None})
    if args.batched_bench:
        from .serve import cluster
        for n in args.stages:
            [row] = trio.run(cluster, str(args.gguf), n, [args.parallel], args.max_tokens, DEFAULT_MAX_SEQS, 1)
            rows.append({"engine": f"pp, N = {n}, {args.parallel} concurrent streams", "threads": None,
                         "tokens_per_s": row["tokens_per_s"], "peak_rss_mb": None})
    command = "python -m bench.llamacpp " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, DEV="
          f"{os.environ.get('DEV', '(tinygrad default)')}\n")
    print("| engine | threads | tokens/s | peak RSS MB |\n|---|---|---|---|")
    for r in rows:
        rss = " / ".join(f"{v:.0f}" for v in r["rss_mb"]) if "rss_mb" in r else \
            ("—" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f}")
        print(f"| {r['engine']} | {r['threads'] or '—'} | {r['tokens_per_s']:.2f} | {rss} |")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
