"""A live cluster under the issue-33 audit's costly requests, the ones whose cost a body's size does not show:
how fast stage 0's /health answers while 8 clients at once send each, and what each client is answered. Real
node processes (tiny by default, 3 stages), as the audit's `ppsmoke.py --seed -n 3 --serve`. One JSON object
per phase on stdout.

  python -m bench.hostile_api                 # tiny, 3 stages
  python -m bench.hostile_api --model smollm2:135m --phases empty-turns

Phases (each while another process polls stage 0's /health every 20 ms: bench.hostile's poller):
  idle          nothing else
  empty-turns   8 clients at once, each 9,000 empty messages (297 KB): the audit's; refused on the count
  most-turns    8 clients at once, each as many short messages as a conversation may have here: rendered and
                tokenized in worker threads, then answered (or refused as too long for the context)
  big-schemas   8 clients at once, each a response_format schema just under the 64 KiB cap (many optional
                properties), compiled at admission in worker threads
Each phase sends its burst of 8 five times over.
"""
from __future__ import annotations

import argparse
import functools
import json
import secrets
import sys
import time
from collections.abc import Callable

import trio

from node.api.openai_messages import MAX_MESSAGES
from worker.grammar import MAX_SCHEMA_CHARS

from .cluster import http, start_local_cluster
from .hostile import health_figures, under_poll

CLIENTS = 8
ROUNDS = 5  # bursts of CLIENTS per phase, one after another: enough /health polls to see a stall


async def main_async(args) -> None:
    key = secrets.token_urlsafe(16)
    async with trio.open_nursery() as nursery:
        _, urls = await start_local_cluster(nursery, args.model, args.stages, api_keys=(key,))
        async with http(base_url=urls[0], headers={"Authorization": f"Bearer {key}"},
                                     timeout=300) as api:
            await api.post("/v1/completions", json={"model": args.model, "prompt": "warm", "max_tokens": 4})
            context = (await api.get("/v1/models")).json()["data"][0]["max_model_len"]
            for name in args.phases:
                figures, polled = await under_poll(urls[0], functools.partial(PHASES[name], api, args.model, context))
                print(json.dumps({"phase": name, **health_figures(polled), **figures}), flush=True)
        nursery.cancel_scope.cancel()


async def at_once(api, body: bytes | Callable[[int], bytes]) -> dict:
    """ROUNDS times, CLIENTS clients send `body` at once (or body(k), client k's of all, counted across rounds):
    each distinct (status, error param), and how long the slowest round took until all were answered (s)."""
    answers: list[tuple[int, str | None]] = []
    failures: list[str] = []
    rounds: list[float] = []
    bodies = body if callable(body) else lambda k: body

    async def send(k: int):
        r = await api.post("/v1/chat/completions", content=bodies(k), headers={"Content-Type": "application/json"})
        error = r.json().get("error", {}) if r.status_code != 200 else {}
        answers.append((r.status_code, error.get("param")))
        if r.status_code >= 500:
            failures.append(error.get("message", "")[:200])
    for n in range(ROUNDS):
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(CLIENTS):
                nursery.start_soon(send, n * CLIENTS + k)
        rounds.append(time.perf_counter() - started)
    return {"clients": CLIENTS, "rounds": ROUNDS, "body_bytes": len(bodies(0)), "answers": sorted(set(answers)),
            "all_answered_max_s": round(max(rounds), 3), **({"failures": failures[:2]} if failures else {})}


async def idle(api, model: str, context: int) -> dict:
    await trio.sleep(2)
    return {}


async def empty_turns(api, model: str, context: int) -> dict:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * 9000}
    return await at_once(api, json.dumps(body).encode())  # json's default separators: 297 KB, as the audit's


async def most_turns(api, model: str, context: int) -> dict:
    turns = min(MAX_MESSAGES, context)
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}] * turns}
    return {"turns": turns, **await at_once(api, json.dumps(body).encode())}


async def big_schemas(api, model: str, context: int) -> dict:
    """Each request's schema its own (a property named after it), so none is the verdict the API keeps."""
    properties, schema = {}, {"type": "object", "properties": {}}
    while len(json.dumps(schema, separators=(",", ":"))) < MAX_SCHEMA_CHARS - 2048:
        properties[f"p{len(properties)}"] = {"type": "string", "enum": ["x" * 24, "y" * 24, "z" * 24]}
        schema = {"type": "object", "properties": properties}

    def body(k: int) -> bytes:
        own = {"type": "object", "properties": {f"client{k}": {"type": "string"}, **properties}}
        return json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                           "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": own}}
                           }).encode()
    return {"schema_chars": len(json.dumps(schema, separators=(",", ":"))), **await at_once(api, body)}


PHASES = {"idle": idle, "empty-turns": empty_turns, "most-turns": most_turns, "big-schemas": big_schemas}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES), help="which, in order (all)")
    args = p.parse_args(argv)
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
