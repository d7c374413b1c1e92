"""The prefix cache (issue 27): what reusing a finished request's KV saves a request that shares its prefix, on
a real local cluster of the default model, each scenario on a fresh cluster with the cache and without it
(`PP_NO_PREFIX_CACHE=1`, which every node reads at its entrypoint):

1. chat: a conversation of `--turns` turns through `/v1/chat/completions` (streamed, greedy), each request
   carrying the whole conversation so far; the time to first token (TTFT) of each turn. Target, with the
   cache: the last turn's TTFT at most 1.3 × the first's.
2. shared: `--shared` requests one after another, each a different short question after the same system
   prompt of about `--system-tokens` tokens (counted by `/tokenize`). Target, with the cache: every TTFT
   after the first at most 0.25 × the first's. `--burst`: then 15 more questions sent at once.
3. kill: a streamed answer (the same long system prompt, a question with a long answer) on
   `ppsmoke.py --seed --serve` at each of `--kill-stages`; after `--kill-after` chunks stage 1 is SIGKILLed,
   the runner replaces it and stage 0 replays the request. The pause is the longest gap between chunks; the
   answer must equal the undisturbed run's (streamed before it), and so must a third run after the
   replacement.
4. identical: every answer of (1) and (2) with the cache equals the one without.

  DEV=CPU python -m bench.prefix --json docs/prefix.json
  DEV=CPU python -m bench.prefix --skip-kill --turns 3 --shared 4          # parts 1, 2 (and 4), small
  DEV=CPU python -m bench.prefix --skip-chat --skip-shared --kill-stages 3 # part 3 alone, N = 3

Times are the client's: TTFT runs from sending the request to the first chunk with text; gaps are between
chunks' arrivals. Stage 0's `pp_prefix_cache_queries_total` / `pp_prefix_cache_hits_total` (prompt tokens
looked up / found cached) are read from its `/metrics` before and after each scenario; "n/a" where the
node does not have them. Exits 1 if an answer differs where it must not.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

import attrs
import httpx
import trio

from worker.weights.fetch import DEFAULT_MODEL

from .cluster import http, start_local_cluster, start_served_cluster

API_KEY = "bench-prefix-key"
NO_CACHE = "PP_NO_PREFIX_CACHE"
MODES = {"cache": {}, "no-cache": {NO_CACHE: "1"}}
COUNTERS = ("pp_prefix_cache_queries_total", "pp_prefix_cache_hits_total")
TIMEOUT = httpx.Timeout(30.0, read=600.0)  # a long prompt's first chunk takes a while on CPUs

WARM_UP = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hello."}]
TUTOR = "You are a patient history tutor. Answer every question in full paragraphs, with dates and examples."
TURNS = ["Tell me about the history of the bicycle, from its invention to today.",
         "How did the bicycle change life in cities at the end of the nineteenth century?",
         "What role did the bicycle play in women's emancipation?",
         "Compare the bicycle with the early automobile as a means of transport.",
         "Which inventions made modern racing bicycles possible?",
         "What might bicycles look like fifty years from now, and why?"]
RULES = [
    "You are the customer assistant of Quill & Lantern, an independent bookshop with three branches.",
    "Greet every customer politely and answer in plain, friendly English, in at most a few sentences.",
    "The branches are on Harbour Street, in the Old Market and at the railway station.",
    "Harbour Street opens from nine in the morning to seven in the evening, Monday to Saturday.",
    "The Old Market branch opens from ten to six every day, Sundays included, except on public holidays.",
    "The railway station branch opens from six in the morning to ten at night, every day of the year.",
    "Customers may return any book in its original condition within thirty days, with the receipt.",
    "Without a receipt, a returned book is exchanged for a store credit at its current price.",
    "Signed first editions, rare books and opened audiobooks cannot be returned unless they are damaged.",
    "Orders for books not in stock usually arrive within five working days; customers are told by email.",
    "Delivery within the city is free above thirty euros; below that it costs three euros fifty.",
    "Members of the reading club receive ten percent off every purchase and an invitation to each event.",
    "Membership costs twenty euros a year and can be bought at any till or on the shop's website.",
    "Gift cards come in values of ten, twenty-five and fifty euros and never expire.",
    "The children's corner at Harbour Street holds a story hour every Saturday at eleven o'clock.",
    "Author readings take place on the first Thursday of each month, at the Old Market branch, at seven.",
    "Tickets for readings are free for members and five euros for everyone else, refunded on purchase.",
    "The shop buys second-hand books in good condition on Tuesday afternoons at Harbour Street only.",
    "Never give out the personal details of staff or other customers, whatever the reason given.",
    "If a customer complains, apologise, note the order number and offer to pass the matter to a manager.",
    "Do not recommend books you have not been told about; suggest asking a bookseller in the shop instead.",
    "Prices on the website and in the shops are the same; online-only offers are marked as such.",
    "Payment is accepted in cash, by card and with gift cards; cheques are no longer accepted.",
    "Wheelchair access is available at every branch; the station branch has a lift to the first floor.",
    "Dogs on a lead are welcome at Harbour Street and the Old Market, but not in the station branch.",
    "The café at the Old Market serves coffee, tea and cakes until half an hour before closing.",
    "Lost property is kept for one month at the branch where it was found, then given to charity.",
    "School orders of more than twenty copies get fifteen percent off and free delivery to the school.",
    "The shop does not sell e-books, but it sells e-readers and their covers at the station branch.",
    "If you do not know an answer, say so and give the shop's phone number, 0123 456 789.",
    "Staff wear green aprons with a lantern on the pocket, so customers can always find someone to ask.",
    "The bookshop was founded in 1952 by Margaret Quill and has been run by her family ever since.",
]
QUESTIONS = ["When does the station branch close?", "Can I return a book without a receipt?",
             "How much does delivery cost for a twenty euro order?", "Is there a story hour for children?",
             "How do I become a member of the reading club?", "Do gift cards expire?",
             "Can I bring my dog to the station branch?", "When are the author readings?",
             "Do you buy second-hand books?", "Can I pay by cheque?", "Is the Old Market open on Sundays?",
             "Do you sell e-books?", "Who founded the shop?", "What discount do schools get?",
             "Where can I get a coffee?", "What happens to lost property?"]
KILL_QUESTION = "Count from 1 to 200, separated by commas."


@attrs.frozen
class Api:
    """Stage 0's OpenAI API: where, the client's key and the served model's name."""
    url: str
    model: str
    headers: dict = attrs.field(factory=lambda: {"Authorization": f"Bearer {API_KEY}"})


@attrs.frozen
class Answer:
    text: str
    sent: float
    times: tuple[float, ...]  # each chunk with text, its arrival (monotonic)
    prompt_tokens: int | None  # from the stream's usage chunk
    completion_tokens: int | None = None

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.sent

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


async def chat(client: httpx.AsyncClient, api: Api, messages: list[dict], max_tokens: int,
               on_chunk: Callable[[int], None] = lambda count: None, extra: dict | None = None) -> Answer:
    """One streamed greedy chat completion; `on_chunk(count)` after each chunk with text; `extra`: more fields
    of the request's body."""
    body = {"model": api.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    sent, texts, times, usage = time.monotonic(), [], [], {}
    async with client.stream("POST", api.url + "/v1/chat/completions", json=body, headers=api.headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            usage = event.get("usage") or usage
            for text in ((c.get("delta") or {}).get("content") for c in event.get("choices", ())):
                if text:
                    texts.append(text)
                    times.append(time.monotonic())
                    on_chunk(len(times))
    if not times:
        raise RuntimeError("the stream ended before any text")
    return Answer("".join(texts), sent, tuple(times), usage.get("prompt_tokens"), usage.get("completion_tokens"))


async def served_model(client: httpx.AsyncClient, url: str) -> Api:
    r = await client.get(url + "/v1/models", headers=Api(url, "").headers)
    r.raise_for_status()
    return Api(url, r.json()["data"][0]["id"])


async def prefix_counters(client: httpx.AsyncClient, api: Api) -> dict[str, float]:
    """Stage 0's prefix-cache counters from its /metrics (summed over any labels); those it lacks are absent."""
    r = await client.get(api.url + "/metrics", headers=api.headers)
    r.raise_for_status()
    found: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in COUNTERS and not line.startswith("#"):
            found[name] = found.get(name, 0.0) + float(value.rsplit(" ", 1)[-1])
    return found


def counted(before: dict, after: dict) -> dict[str, float | None]:
    return {name: after[name] - before.get(name, 0.0) if name in after else None for name in COUNTERS}


# -- 1 and 2: a conversation, and requests that share a system prompt ----------------------------------------

def user_turns(count: int) -> list[str]:
    return [TURNS[i] if i < len(TURNS) else "Tell me more about that." for i in range(count)]


async def chat_turns(client: httpx.AsyncClient, api: Api, turns: int, max_tokens: int) -> dict:
    """One conversation, each turn's request carrying all of it so far."""
    messages, answers = [{"role": "system", "content": TUTOR}], []
    for question in user_turns(turns):
        messages.append({"role": "user", "content": question})
        answers.append(await chat(client, api, messages, max_tokens))
        messages.append({"role": "assistant", "content": answers[-1].text})
    return {"answers": answers}


async def system_prompt(client: httpx.AsyncClient, api: Api, target_tokens: int) -> str:
    """RULES, one more at a time, until the system message alone is `target_tokens` tokens (the template's
    included) or RULES run out."""
    for count in range(1, len(RULES) + 1):
        text = " ".join(RULES[:count])
        body = {"model": api.model, "messages": [{"role": "system", "content": text}],
                "add_generation_prompt": False}
        r = await client.post(api.url + "/tokenize", json=body, headers=api.headers)
        r.raise_for_status()
        if r.json()["count"] >= target_tokens:
            break
    return text


async def shared_prompt(client: httpx.AsyncClient, api: Api, count: int, system_tokens: int, max_tokens: int,
                        burst: bool) -> dict:
    """`count` questions one after another after one system prompt; with `burst`, 15 others at once after."""
    system = await system_prompt(client, api, system_tokens)
    ask = lambda q: chat(client, api, [{"role": "system", "content": system},  # noqa: E731
                                       {"role": "user", "content": q}], max_tokens)
    answers = [await ask(q) for q in QUESTIONS[:count]]
    together: dict[int, Answer] = {}
    if burst:
        async def one(i: int, q: str) -> None:
            together[i] = await ask(f"Another customer asks: {q}")
        async with trio.open_nursery() as nursery:
            for i, q in enumerate(QUESTIONS[1:]):
                nursery.start_soon(one, i, q)
    return {"answers": answers, "burst": [together[i] for i in sorted(together)]}


async def on_fresh_cluster(model: str, n: int, mode: str, work: Callable[[httpx.AsyncClient, Api],
                                                                          Awaitable[dict]]) -> dict:
    """`work` on a fresh local cluster after a warm-up request, with the prefix counters it moved."""
    async with trio.open_nursery() as nursery:
        _, urls = await start_local_cluster(nursery, model, n, extra_env=MODES[mode], api_keys=(API_KEY,))
        async with http(timeout=TIMEOUT) as client:
            api = await served_model(client, urls[0])
            await chat(client, api, WARM_UP, 4)
            before = await prefix_counters(client, api)
            result = await work(client, api)
            result["counters"] = counted(before, await prefix_counters(client, api))
            # prefix-cache rows each stage's starts mapped (shared pages) or copied, over the whole run
            result["prefix_rows"] = [(await client.get(u + "/health")).json().get("prefix_rows") for u in urls]
        nursery.cancel_scope.cancel()
    return result


# -- 3: SIGKILL of stage 1 mid-stream ------------------------------------------------------------------------

async def killed_stream(model: str, n: int, mode: str, *, system_tokens: int, max_tokens: int,
                        kill_after: int) -> dict:
    """On `ppsmoke.py --seed --serve`: the answer undisturbed, again with stage 1 SIGKILLed after `kill_after`
    chunks, and once more after the replacement."""
    async with trio.open_nursery() as nursery:
        run = await start_served_cluster(nursery, model, n, api_key=API_KEY, extra_env=MODES[mode])
        async with http(timeout=TIMEOUT) as client:
            api = await served_model(client, run.holders()[0][0])
            system = await system_prompt(client, api, system_tokens)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": KILL_QUESTION}]
            undisturbed = await chat(client, api, messages, max_tokens)
            seen, (_, pid) = len(run.lines), run.holders()[1]
            killed, disturbed = await stream_and_kill(client, api, messages, max_tokens, kill_after, pid)
            noticed, _ = await run.wait_line("stage 1 at ", 60, after=seen)
            ready, line = await run.wait_line("stage 1 replaced in", 60, after=seen)
            after = await chat(client, api, messages, max_tokens)
        nursery.cancel_scope.cancel()
    return {"stages": n, "mode": mode, "prompt_tokens": undisturbed.prompt_tokens, "chunks": len(undisturbed.times),
            "undisturbed_gap_s": undisturbed.longest_gap_s, "pause_s": disturbed.longest_gap_s,
            "noticed_s": noticed - killed, "ready_s": ready - killed,
            "replaced_in_s": float(line.split(" replaced in ", 1)[1].split()[0]),
            "identical": disturbed.text == undisturbed.text, "after_identical": after.text == undisturbed.text}


async def stream_and_kill(client: httpx.AsyncClient, api: Api, messages: list[dict], max_tokens: int,
                          kill_after: int, pid: int) -> tuple[float, Answer]:
    """The answer streamed while `pid` is SIGKILLed once `kill_after` chunks have come: (when it was, answer)."""
    due, got = trio.Event(), {}

    def on_chunk(count: int) -> None:
        if count >= kill_after:
            due.set()

    async def answer() -> None:
        got["answer"] = await chat(client, api, messages, max_tokens, on_chunk)
        if not due.is_set():
            raise RuntimeError(f"the answer ended after {len(got['answer'].times)} chunks, before the kill")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        await due.wait()
        got["killed"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    return got["killed"], got["answer"]


# -- report ---------------------------------------------------------------------------------------------------

def fmt(value: float | None, places: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{places}f}"


def hits(counters: dict) -> str:
    q, h = counters["pp_prefix_cache_queries_total"], counters["pp_prefix_cache_hits_total"]
    return "n/a" if q is None or h is None else f"{h:.0f} / {q:.0f}"


def chat_table(runs: dict[str, dict]) -> list[str]:
    modes = list(runs)
    out = ["| turn | prompt tokens | " + " | ".join(f"TTFT s, {m}" for m in modes) + " |",
           "|" + "---|" * (2 + len(modes))]
    first = runs[modes[0]]["answers"]
    for i, a in enumerate(first):
        out.append(f"| {i + 1} | {a.prompt_tokens} | "
                   + " | ".join(fmt(runs[m]["answers"][i].ttft_s) for m in modes) + " |")
    for m in modes:
        answers = runs[m]["answers"]
        ratio = answers[-1].ttft_s / answers[0].ttft_s
        target = f" (target ≤ 1.3: {'met' if ratio <= 1.3 else 'not met'})" if m == "cache" else ""
        out.append(f"\n{m}: turn {len(answers)} / turn 1 = {ratio:.2f}{target}; prefix cache hits / queries "
                   f"(tokens): {hits(runs[m]['counters'])}")
    return out


def shared_table(runs: dict[str, dict]) -> list[str]:
    out = ["| | prompt tokens | request 1 TTFT s | 2.. median / max s | max / first | target ≤ 0.25 | "
           "burst median / max s | hits / queries (tokens) | rows shared / copied, all stages |", "|" + "---|" * 9]
    for m, run in runs.items():
        first, rest = run["answers"][0], [a.ttft_s for a in run["answers"][1:]]
        ratio = max(rest) / first.ttft_s if rest else None
        burst = [a.ttft_s for a in run["burst"]]
        out.append(f"| {m} | {first.prompt_tokens} | {fmt(first.ttft_s)} | "
                   f"{fmt(statistics.median(rest) if rest else None)} / {fmt(max(rest, default=None))} | "
                   f"{fmt(ratio)} | {'met' if ratio is not None and ratio <= 0.25 else 'not met'} | "
                   f"{fmt(statistics.median(burst) if burst else None)} / {fmt(max(burst, default=None))} | "
                   f"{hits(run['counters'])} | {moved(run.get('prefix_rows') or [])} |")
    return out


def moved(stages: list[dict | None]) -> str:
    known = [s for s in stages if s]
    return f"{sum(s['shared'] for s in known)} / {sum(s['copied'] for s in known)}" if known else "n/a"


def kill_table(rows: list[dict]) -> list[str]:
    out = ["| stages | | prompt tokens | chunks | longest gap undisturbed s | pause s | runner noticed s | "
           "replacement ready s | answer identical | identical after |", "|" + "---|" * 10]
    for r in rows:
        out.append(f"| {r['stages']} | {r['mode']} | {r['prompt_tokens']} | {r['chunks']} | "
                   f"{fmt(r['undisturbed_gap_s'])} | {fmt(r['pause_s'])} | {fmt(r['noticed_s'])} | "
                   f"{fmt(r['ready_s'])} ({r['replaced_in_s']:.1f} by its line) | "
                   f"{'yes' if r['identical'] else 'NO'} | {'yes' if r['after_identical'] else 'NO'} |")
    return out


def identical(chats: dict[str, dict], shared: dict[str, dict]) -> tuple[bool | None, list[str]]:
    """Part 4: every answer of (1) and (2) with the cache against the one without."""
    lines, same = [], []
    for name, runs in (("chat", chats), ("shared", shared)):
        if {"cache", "no-cache"} <= set(runs):
            pairs = [(a.text == b.text) for key in ("answers", "burst")
                     for a, b in zip(runs["cache"].get(key, []), runs["no-cache"].get(key, []))]
            same += pairs
            lines.append(f"- {name}: {sum(pairs)} / {len(pairs)} answers identical")
    if not same:
        return None, ["- n/a (needs part 1 or 2 run in both modes)"]
    return all(same), lines


def as_json(value):
    if isinstance(value, Answer):
        return {**attrs.asdict(value), "ttft_s": value.ttft_s, "longest_gap_s": value.longest_gap_s}
    raise TypeError(type(value))


# -- the run --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", type=int, default=3, help="stages for parts 1 and 2 (default 3)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48, help="each chat turn's answer (default 48)")
    p.add_argument("--shared", type=int, default=16, help=f"requests after one system prompt, 2..{len(QUESTIONS)}")
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--shared-max-tokens", type=int, default=24)
    p.add_argument("--burst", action="store_true", help="part 2: then 15 other questions at once")
    p.add_argument("--kill-stages", nargs="+", type=int, default=[3, 5])
    p.add_argument("--kill-after", type=int, default=10, help="chunks streamed before the SIGKILL (default 10)")
    p.add_argument("--kill-max-tokens", type=int, default=96)
    for part in ("chat", "shared", "kill"):
        p.add_argument(f"--skip-{part}", action="store_true")
    p.add_argument("--json", type=Path, help="also write every figure as JSON here")
    args = p.parse_args(argv)
    if not 2 <= args.shared <= len(QUESTIONS) or args.turns < 2:
        p.error(f"--shared must be 2..{len(QUESTIONS)} and --turns at least 2")
    if NO_CACHE in os.environ:
        p.error(f"unset {NO_CACHE}: this benchmark sets it itself for the runs without the cache")
    return args


def run_parts(args: argparse.Namespace) -> dict:
    """Every part asked for, each mode on a fresh cluster; progress on stderr."""
    out: dict = {"chat": {}, "shared": {}, "kill": []}
    talk = functools.partial(chat_turns, turns=args.turns, max_tokens=args.max_tokens)
    share = functools.partial(shared_prompt, count=args.shared, system_tokens=args.system_tokens,
                              max_tokens=args.shared_max_tokens, burst=args.burst)
    kill = functools.partial(killed_stream, system_tokens=args.system_tokens, max_tokens=args.kill_max_tokens,
                             kill_after=args.kill_after)
    for mode in args.modes:
        for part, work in (("chat", talk), ("shared", share)):
            if not getattr(args, f"skip_{part}"):
                out[part][mode] = trio.run(on_fresh_cluster, args.model, args.stages, mode, work)
                print(f"  {part}, {mode}: done", file=sys.stderr, flush=True)
    for n in [] if args.skip_kill else args.kill_stages:
        for mode in args.modes:
            out["kill"].append(trio.run(kill, args.model, n, mode))
            print(f"  kill at N = {n}, {mode}: done", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run_parts(args)
    command = "python -m bench.prefix " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command}`  \nMachine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, DEV={os.environ.get('DEV', '(tinygrad default)')}, model {args.model}\n")
    if out["chat"]:
        print("\n".join([f"### 1. A {args.turns}-turn chat, N = {args.stages}\n", *chat_table(out["chat"]), ""]))
    if out["shared"]:
        print("\n".join([f"### 2. {args.shared} requests after one system prompt, N = {args.stages}\n",
                         *shared_table(out["shared"]), ""]))
    if out["kill"]:
        print("\n".join(["### 3. SIGKILL of stage 1 mid-stream\n", *kill_table(out["kill"]), ""]))
    same, lines = identical(out["chat"], out["shared"])
    print("\n".join(["### 4. Answers with the cache against without\n", *lines]))
    if args.json:
        args.json.write_text(json.dumps({"command": command, **out}, indent=1, default=as_json))
    broken = same is False or not all(r["identical"] and r["after_identical"] for r in out["kill"])
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
