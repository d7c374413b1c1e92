"""What losing a stage costs the streams in flight (issue 36): `ppsmoke.py --seed --serve` at `--stages`, four
streams at once, each after its own system prompt of about `--system-tokens` tokens, and stage `--kill-stage`
SIGKILLed once the first stream has `--kill-after` chunks. The runner replaces the stage (from a warm standby
with `--standby K`), stage 0 replays the requests, and every stream must end with the text it had
undisturbed. Each round kills the stage's current holder again; a last pass after the rounds must answer the
same too.

  DEV=CPU python -m bench.failover                      # N = 3, stage 1, no standby, 2 rounds
  DEV=CPU python -m bench.failover --standby 1

Reported per round: each stream's longest gap between two chunks (the issue's figure: at most 8 s, 3 s with
a standby), the time from the kill to the stream's last chunk, and whether its text is the undisturbed one;
and the runner's lines: when it noticed the loss and when the replacement was ready. Times are the client's
(chunk arrivals) and the runner's (its stderr lines as read). Exits 1 if any text differs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import httpx
import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import ServedRun, http, start_served_cluster
from .prefix import API_KEY, RULES, TIMEOUT, Answer, Api, chat, served_model

QUESTION = "Count from 1 to 200, separated by commas."
STREAMS = 4


def system_prompts(count: int, rules_each: int) -> list[str]:
    """`count` different system prompts, each `rules_each` of RULES taken from its own offset."""
    prompts = []
    for i in range(count):
        picked = [RULES[(i * 7 + j) % len(RULES)] for j in range(rules_each)]
        prompts.append(f"You answer for desk {i + 1}. " + " ".join(picked))
    return prompts


async def rules_for(client: httpx.AsyncClient, api: Api, target_tokens: int) -> int:
    """How many RULES make a system prompt of about `target_tokens` tokens (the template's included)."""
    for count in range(1, len(RULES) + 1):
        body = {"model": api.model, "messages": [{"role": "system", "content": system_prompts(1, count)[0]}],
                "add_generation_prompt": False}
        r = await client.post(api.url + "/tokenize", json=body, headers=api.headers)
        r.raise_for_status()
        if r.json()["count"] >= target_tokens:
            return count
    return len(RULES)


async def streams(client: httpx.AsyncClient, api: Api, systems: list[str], max_tokens: int,
                  kill: tuple[int, int] | None = None) -> tuple[list[Answer], float | None]:
    """Every system prompt's stream at once; `kill`: (chunks, pid): SIGKILL pid once stream 0 has that many
    chunks. Returns the answers and when the kill was (None: no kill)."""
    answers: list[Answer | None] = [None] * len(systems)
    due, killed = trio.Event(), []

    def on_chunk(count: int) -> None:
        if kill is not None and count >= kill[0]:
            due.set()

    async def one(i: int) -> None:
        messages = [{"role": "system", "content": systems[i]}, {"role": "user", "content": QUESTION}]
        answers[i] = await chat(client, api, messages, max_tokens, on_chunk if i == 0 else lambda count: None)

    async with trio.open_nursery() as nursery:
        for i in range(len(systems)):
            nursery.start_soon(one, i)
        if kill is not None:
            await due.wait()
            killed.append(time.monotonic())
            os.kill(kill[1], signal.SIGKILL)
    return answers, (killed[0] if killed else None)


def replacement_log(run: ServedRun, stage: int, taken_line: str) -> dict:
    """From the replacement's own log (a new process's, or the standby's that took the stage): its boot's
    captures, the captures since, and its first steps' compute times (ms, by rows), which show whether any step
    paid for a compile."""
    text = next(t for _, t in run.lines if "logs in " in t)
    run_dir = Path(text.split("logs in ", 1)[1].split()[0])
    if " took it," in taken_line:  # "stage 1: standby standby0 took it, ..."
        path = run_dir / (taken_line.split(" standby ", 1)[1].split()[0] + ".log")
    else:
        attempt = sum("replacement listening" in t for _, t in run.lines if f"stage {stage}:" in t)
        path = run_dir / f"stage{stage}.r{attempt}.log"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    ready = next((r for r in records if r.get("event") == "worker_ready"), {})
    standby = next((r for r in records if r.get("event") == "standby_ready"), None)
    steps = next((r["steps"] for r in records if r.get("event") == "first_steps"), [])
    return {"boot_s": ready.get("seconds"), "boot_captures": ready.get("capture_by_bucket_s", {}),
            "standby_s": None if standby is None else standby["seconds"], "log": path.name,
            "captured": [(r["bucket"], r["seconds"]) for r in records if r.get("event") == "captured"],
            "first_steps": steps}


async def one_round(client, api, run: ServedRun, systems, max_tokens, kill_stage, kill_after, undisturbed) -> dict:
    seen, (_, pid) = len(run.lines), run.holders()[kill_stage]
    answers, killed = await streams(client, api, systems, max_tokens, (kill_after, pid))
    noticed, _ = await run.wait_line(f"stage {kill_stage} at ", 60, after=seen)
    _, taken = await run.wait_line(f"stage {kill_stage}: ", 120, after=seen)
    ready, line = await run.wait_line(f"stage {kill_stage} replaced in", 120, after=seen)
    return {"killed_pid": pid, "noticed_s": noticed - killed, "ready_s": ready - killed,
            "replacement": replacement_log(run, kill_stage, taken),
            "streams": [{"gap_s": a.longest_gap_s, "undisturbed_gap_s": u.longest_gap_s,
                         "last_after_kill_s": a.times[-1] - killed, "chunks": len(a.times),
                         "prompt_tokens": a.prompt_tokens, "identical": a.text == u.text}
                        for a, u in zip(answers, undisturbed)]}


async def spares_ready(run: ServedRun, count: int) -> None:
    """Until the runner has said `count` spares were ready (each one taken is followed by a new one)."""
    while sum(" ready in " in t and t.startswith("ppsmoke: standby ") for _, t in run.lines) < count:
        await run.wait_line("ppsmoke: standby ", 180, after=len(run.lines))


async def measure(args) -> dict:
    extra = ("--standby", str(args.standby)) if args.standby else ()
    async with trio.open_nursery() as nursery:
        run = await start_served_cluster(nursery, args.model, args.stages, api_key=API_KEY, args=extra)
        async with http(timeout=TIMEOUT) as client:
            api = await served_model(client, run.holders()[0][0])
            systems = system_prompts(STREAMS, await rules_for(client, api, args.system_tokens))
            undisturbed, _ = await streams(client, api, systems, args.max_tokens)
            rounds = []
            for r in range(args.rounds):
                await spares_ready(run, args.standby * (r + 1))  # a taken spare's successor is ready again
                rounds.append(await one_round(client, api, run, systems, args.max_tokens, args.kill_stage,
                                              args.kill_after, undisturbed))
                print(f"  round {r + 1}: done", file=sys.stderr, flush=True)
            after, _ = await streams(client, api, systems, args.max_tokens)
        nursery.cancel_scope.cancel()
    return {"rounds": rounds, "after_identical": [a.text == u.text for a, u in zip(after, undisturbed)]}


def report(args, out: dict) -> list[str]:
    lines = [f"Command: `python -m bench.failover {' '.join(sys.argv[1:])}`  ",
             f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"DEV={os.environ.get('DEV', '')}, model {args.model}, N = {args.stages}, stage {args.kill_stage} "
             f"SIGKILLed, standby {args.standby}\n",
             "| round | stream | prompt tokens | chunks | longest gap undisturbed s | longest gap s | "
             "last chunk after kill s | identical |", "|" + "---|" * 8]
    for r, rnd in enumerate(out["rounds"], 1):
        for i, s in enumerate(rnd["streams"]):
            lines.append(f"| {r} | {i} | {s['prompt_tokens']} | {s['chunks']} | {s['undisturbed_gap_s']:.2f} | "
                         f"{s['gap_s']:.2f} | {s['last_after_kill_s']:.2f} | {'yes' if s['identical'] else 'NO'} |")
    lines.append("")
    for r, rnd in enumerate(out["rounds"], 1):
        worst = max(s["gap_s"] for s in rnd["streams"])
        lines.append(f"- round {r}: longest gap {worst:.2f} s; runner noticed the loss after "
                     f"{rnd['noticed_s']:.2f} s, replacement ready after {rnd['ready_s']:.2f} s")
        rep = rnd["replacement"]
        steps = [ms for _, ms in rep["first_steps"]]
        spare = "" if rep["standby_s"] is None else f"a standby, ready {rep['standby_s']} s after its start; "
        lines.append(f"  - replacement ({rep['log']}): {spare}loaded in {rep['boot_s']} s, capturing buckets "
                     f"{rep['boot_captures']} s; "
                     f"captured since (bucket, s): {rep['captured'] or 'none'}; its first {len(steps)} steps' "
                     f"compute ms (rows): {' '.join(f'{ms:g} ({rows})' for rows, ms in rep['first_steps'])}")
    lines.append(f"- after the rounds, every stream identical: {'yes' if all(out['after_identical']) else 'NO'}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--kill-stage", type=int, default=1)
    p.add_argument("--standby", type=int, default=0, help="ppsmoke.py's --standby K (default 0: none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kill-after", type=int, default=10, help="chunks of stream 0 before the SIGKILL (default 10)")
    args = p.parse_args()
    if not 1 <= args.kill_stage < args.stages:
        p.error("--kill-stage: 1 .. stages - 1 (stage 0's streams end with it)")
    out = trio.run(measure, args)
    print("\n".join(report(args, out)))
    same = all(s["identical"] for rnd in out["rounds"] for s in rnd["streams"]) and all(out["after_identical"])
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
