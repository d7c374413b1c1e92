"""The planned split against the even one (issue 37), side by side in one run: K concurrent streamed greedy
chat completions from an outside client through an N-stage local cluster booted with `--layer-partition auto`
and with `--layer-partition equal`, in alternating rounds.

  DEV=CPU python -m bench.plan $SMOLLM2_GGUF --stages 2 --streams 8 --max-tokens 48 --rounds 3
  DEV=CPU python -m bench.plan $SMOLLM2_GGUF --stages 2 --slow-stage 1 --quota 0.35 --rounds 3   # as root
  DEV=CPU python -m bench.plan $SMOLLM2_GGUF --stages 2 --each 0.6 --rounds 3   # alike machines, as root

`--slow-stage S --quota Q` holds stage S's node to Q of one core from the moment its process starts: a cgroup
(v1 cpu controller, /sys/fs/cgroup/cpu) with cpu.cfs_quota_us = Q x cpu.cfs_period_us, which the node's
process joins before it execs Python. A machine slower than the others, as a laptop beside a desktop is.
`--each Q` holds every stage to Q of a core, each in its own group: alike machines. Without it the stages and
the client share this machine's cores, and once they are all busy (two stages and a client on two cores) moving
blocks from one stage to another moves work between processes that share the same cores: the split then
changes little.

`--modes auto equal 18,12` compares given splits too. Each round boots a fresh cluster of each mode (its boot
is timed: launch to pp-entry ready), sends one warm-up round of K streams, waits until every stage captured all
its step buckets, then sends `--timed` rounds of K streams: a round's tok/s is every completion token over its
wall time, and the cluster's the median of its rounds. Reported: the split each mode ran and what the nodes
measured (/v1/pipeline), each stage's share of the timed rounds in compute steps (/health's compute_s), tok/s
by cluster and their median, the ratio auto/equal, and whether every greedy answer was the same.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

from .cluster import http, start_local_cluster
from .serve import stage_counters, stage_figures
from .prefix import API_KEY, QUESTIONS, TIMEOUT, Answer, Api, chat, served_model

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
MODES = ("auto", "equal")


@contextlib.contextmanager
def cpu_quota(share: float, name: str = "pp-bench-slow"):
    """A cgroup holding its processes to `share` of one core; yields the wrapper command that puts a process in
    it and execs the rest of its command line. Emptied and removed at the end."""
    group = CPU_CGROUPS / name
    group.mkdir(exist_ok=True)
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(int(share * period)))
        yield ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"))
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        group.rmdir()


async def one_round(client: httpx.AsyncClient, api: Api, streams: int, max_tokens: int) -> dict:
    answers: dict[int, Answer] = {}

    async def one(i: int) -> None:
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        answers[i] = await chat(client, api, messages, max_tokens, extra={"ignore_eos": True})
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    wall = time.monotonic() - started
    tokens = sum(a.completion_tokens for a in answers.values())
    return {"tokens_per_s": tokens / wall, "texts": [answers[i].text for i in range(streams)]}


async def captured(urls: list[str], timeout_s: float = 180) -> None:
    """Until no stage has step buckets left to capture (/health's warming): they capture one whenever they idle
    for 2 s, and a capture in a timed round would be timed as compute."""
    async with http() as client:
        with trio.fail_after(timeout_s):
            while any([(await client.get(u + "/health")).json()["warming"] for u in urls]):
                await trio.sleep(1.0)


async def one_cluster(model: str, n: int, mode: str, streams: int, max_tokens: int,
                      wrappers: dict[int, tuple[str, ...]], repeats: int) -> dict:
    """Boot an N-stage cluster split by `mode`, then one warm-up and `repeats` timed rounds of `streams`
    streams: their median tok/s."""
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        orch, urls = await start_local_cluster(nursery, model, n, extra_env={"PP_LAYER_PARTITION": mode},
                                               api_keys=(API_KEY,), wrappers=wrappers)
        boot_s = time.monotonic() - started
        async with http(timeout=TIMEOUT, limits=httpx.Limits(max_connections=streams + 4)) as client:
            api = await served_model(client, urls[0])
            view = (await client.get(api.url + "/v1/pipeline", headers=api.headers)).json()
            await one_round(client, api, streams, max_tokens)  # every bucket's first use
            await captured(urls)
            before, started = await stage_counters(urls), time.monotonic()
            timed = [await one_round(client, api, streams, max_tokens) for _ in range(repeats)]
            busy = stage_figures(before, await stage_counters(urls), time.monotonic() - started)
        nursery.cancel_scope.cancel()
    return {"mode": mode, "boot_s": boot_s, "view": view, "compute_busy": [b["compute_busy"] for b in busy],
            "tokens_per_s": statistics.median(t["tokens_per_s"] for t in timed), "texts": timed[0]["texts"],
            "same_texts": all(t["texts"] == timed[0]["texts"] for t in timed)}


async def run(args) -> list[dict]:
    out = []
    with contextlib.ExitStack() as stack:
        wrappers = {}
        if args.each is not None:  # machines alike, each of them smaller than this one: every stage to its share
            for stage in range(args.stages):
                wrappers[stage] = stack.enter_context(cpu_quota(args.each, f"pp-bench-stage{stage}"))
        if args.slow_stage is not None:
            wrappers[args.slow_stage] = stack.enter_context(cpu_quota(args.quota))
        for r in range(args.rounds):
            for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):  # alternate which goes first
                result = await one_cluster(str(args.gguf), args.stages, mode, args.streams, args.max_tokens, wrappers,
                                           args.timed)
                print(f"round {r + 1} {mode}: {result['tokens_per_s']:.1f} tok/s, split "
                      f"{result['view']['split']['counts']}, compute busy {result['compute_busy']}, boot "
                      f"{result['boot_s']:.1f} s", file=sys.stderr, flush=True)
                out.append(result)
    return out


def stages_text(view: dict) -> str:
    """Each stage's blocks and what its node measured, from /v1/pipeline."""
    parts = []
    for s in view["stages"]:
        figure = "" if s["block_ms"] is None else f" ({s['block_ms']:.2f} ms/block" + \
            (f", head {s['head_ms']:.2f} ms" if s["head_ms"] is not None else "") + ")"
        parts.append(f"{s['blocks'][1] - s['blocks'][0]}{figure}")
    return " / ".join(parts)


def report(results: list[dict], args, command: str) -> str:
    lines = [f"Command: `{command}`  ", f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}, DEV={os.environ.get('DEV', '(tinygrad default)')}"
             + (f"; every stage held to {args.each:.0%} of one core" if args.each is not None else "")
             + (f"; stage {args.slow_stage} held to {args.quota:.0%} of one core (cgroup cpu quota)"
                if args.slow_stage is not None else "" if args.each is not None else "; no stage held back"), "",
             "| split | blocks per stage (measured) | boot s | stages' compute busy by round | tok/s by round | median tok/s |",
             "|---|---|---|---|---|---|"]
    medians = {}
    for mode in args.modes:
        mine = [r for r in results if r["mode"] == mode]
        medians[mode] = statistics.median(r["tokens_per_s"] for r in mine)
        boots = ", ".join(f"{r['boot_s']:.1f}" for r in mine)
        rates = ", ".join(f"{r['tokens_per_s']:.1f}" for r in mine)
        busy = ", ".join("/".join(f"{b:.0%}" for b in r["compute_busy"]) for r in mine)
        lines.append(f"| {mode} | {stages_text(mine[-1]['view'])} | {boots} | {busy} | {rates} | {medians[mode]:.1f} |")
    same = len({tuple(r["texts"]) for r in results}) == 1 and all(r["same_texts"] for r in results)
    ratio = (f"auto / equal: **{medians['auto'] / medians['equal']:.2f}×** (medians); "
             if {"auto", "equal"} <= medians.keys() else "")
    lines += ["", f"{ratio}the greedy answers {'are the same' if same else 'DIFFER'} in every round of every split"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path, help="the GGUF file the cluster runs")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="clusters booted per mode, alternating")
    p.add_argument("--timed", type=int, default=2, help="timed rounds of K streams per cluster; its figure is "
                   "their median (2)")
    p.add_argument("--slow-stage", type=int, help="hold this stage's node to --quota of one core (needs root)")
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   help="the --layer-partition values to compare (auto equal; also counts, e.g. 18,12)")
    p.add_argument("--quota", type=float, default=0.35, help="the slow stage's share of one core (0.35)")
    p.add_argument("--each", type=float, help="hold every stage to this share of one core, each in a cgroup of its "
                   "own (needs root): alike machines that leave this one's cores room for the client")
    p.add_argument("--json", type=Path, help="also write every round's figures and /v1/pipeline view here")
    args = p.parse_args(argv)
    results = trio.run(run, args)
    command = "python -m bench.plan " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(results, args, command))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "rounds": [{k: v for k, v in r.items() if k != "texts"}
                                                                        for r in results]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
