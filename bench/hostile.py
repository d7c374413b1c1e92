"""A live cluster under the issue-23 audit's hostile clients: how fast /health answers while each runs, and
how soon the slots of clients that walk away are free. Real node processes (tiny by default), as the audit's
`ppsmoke.py --seed -n 3 --serve`. One JSON object per phase on stdout.

  python -m bench.hostile                 # tiny, 3 stages
  python -m bench.hostile --model smollm2:135m

Phases (each while another process polls stage 0's /health every 20 ms):
  idle         nothing else
  long-prompt  8 clients at once send a 2 MiB message, 8 more one just under the body limit
  long-stops   4 streams, each with 4 stop strings at the 1024-character cap, 64 tokens
  rapid-reset  an HTTP/2 client opens and resets 20,000 streams, granting no flow-control credit, 3 times
  ping-flood   8 raw HTTP/2 connections send PING frames as fast as they can for 10 s, each reconnecting
               when the node closes it (the audit's ~190k frames/s stalled /health 2.4 s and got stage 0
               declared dead); also whether every stage stayed alive in the runner's gossip view (none
               suspect or dead, the same member and incarnation after): no replacement
  settings-flood  the same with SETTINGS frames, each of which the server must acknowledge
  stream-burst 200 HTTP/2 connections each open 100 `GET /health` at once, no key (the second audit's), and
               hold them 20 s: /health, the requests answered and refused, and whether any stage was suspected
  conn-flood   300 idle TCP connections from one address (the cap is 256)
  walk-away    20 HTTP/1.1 clients close their socket 0-5 ms after sending a 400-token request: the time
               until no stage holds a slot (the audit saw half of them run to max_tokens)
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import re
import secrets
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import hpack
import httpx
import trio

from node.api.openai_wire import MAX_STOP_CHARS
from node.membership.gossip import State

from .cluster import http, start_local_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_h2_abuse import rapid_reset  # noqa: E402 -- the tests' raw h2 client, not a copy of it

POLL_S = 0.02


async def main_async(args) -> None:
    key = secrets.token_urlsafe(16)
    async with trio.open_nursery() as nursery:
        orch, urls = await start_local_cluster(nursery, args.model, args.stages, api_keys=(key,))
        for name in args.phases:  # a client per phase: a phase may leave the node closing connections
            async with http(base_url=urls[0], headers={"Authorization": f"Bearer {key}"},
                                         timeout=120) as api:
                if name == args.phases[0]:  # the first request compiles and captures each stage's JIT
                    await api.post("/v1/completions", json={"model": args.model, "prompt": "warm", "max_tokens": 4})
                    await _all_serving(urls)
                phase = functools.partial(PHASES[name], orch=orch)
                figures, polled = await under_poll(urls[0], functools.partial(phase, api, urls, args.model))
            print(json.dumps({"phase": name, **health_figures(polled), **figures}), flush=True)
        nursery.cancel_scope.cancel()


async def _all_serving(urls: list[str], timeout_s: float = 120) -> None:
    """Until every stage's /health is 200: on a loaded machine a stage compiling its JIT may miss gossip
    probes and be suspected for a while, which is not what a phase measures."""
    async with http(timeout=10) as client:
        with trio.fail_after(timeout_s):
            for url in urls:
                while (await client.get(url + "/health")).status_code != 200:
                    await trio.sleep(0.5)


async def under_poll(url: str, phase) -> tuple[dict, dict]:
    """Run `phase()` while /health is polled from another process (this one's event loop is busy with the
    phase's own clients); its figures, and every /health latency (s) with the count of polls not answered."""
    async with trio.open_nursery() as nursery:
        poller = await nursery.start(functools.partial(
            trio.run_process, [sys.executable, "-m", "bench.hostile", "--poll", url], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE))
        first = await poller.stdout.receive_some()  # "ready" once its first /health is answered
        figures = await phase()
        await poller.stdin.aclose()
        out = first
        while chunk := await poller.stdout.receive_some():
            out += chunk
    return figures, json.loads(out.decode().split("\n", 1)[1])


def poll(url: str) -> None:
    """--poll: GET url/health every POLL_S until stdin closes; then print every latency (s) as JSON."""
    latencies, stop = [], threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with httpx.Client(timeout=30, verify=False) as client:  # /health holds no secret: see cluster.http
        deadline = time.perf_counter() + 60  # a stage suspected while compiling may take a while to be back
        while client.get(url + "/health").status_code != 200 and time.perf_counter() < deadline:
            time.sleep(0.5)
        client.get(url + "/health").raise_for_status()
        print("ready", flush=True)
        failed = 0  # polls not answered 200: a connection the node closed (as over its cap), or no node
        while not stop.is_set():
            sent = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.TransportError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - sent)
            else:
                failed += 1
            stop.wait(POLL_S)
    print(json.dumps({"latencies": latencies, "failed": failed}), flush=True)


def health_figures(polled: dict) -> dict:
    ms = sorted(1000 * s for s in polled["latencies"]) or [float("nan")]
    return {"health_polls": len(polled["latencies"]), "health_not_200": polled["failed"],
            "health_p50_ms": round(statistics.median(ms), 1), "health_p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 1),
            "health_max_ms": round(ms[-1], 1)}


async def idle(api, urls, model, *, orch) -> dict:
    await trio.sleep(2)
    return {}


async def long_prompt(api, urls, model, *, orch) -> dict:
    statuses: list[int] = []

    async def send(chars: int):
        body = {"model": model, "messages": [{"role": "user", "content": "x" * chars}], "max_tokens": 4}
        statuses.append((await api.post("/v1/chat/completions", json=body)).status_code)
    limit = await _body_limit(api, model)
    async with trio.open_nursery() as nursery:
        for chars in [2 << 20] * 8 + [limit - 1024] * 8:
            nursery.start_soon(send, chars)
    return {"statuses": sorted(statuses)}


async def _body_limit(api, model) -> int:
    """The API's body limit, as its 413 says it."""
    r = await api.post("/v1/chat/completions", json={"model": model, "messages": [], "x": "x" * (8 << 20)})
    return int(re.search(r"over the (\d+) bytes", r.json()["error"]["message"]).group(1))


async def long_stops(api, urls, model, *, orch) -> dict:
    stops = ["y" * (MAX_STOP_CHARS - 1) + end for end in "1234"]
    took: list[float] = []

    async def one():
        sent = time.perf_counter()
        r = await api.post("/v1/completions", json={"model": model, "prompt": "Tell me a story", "max_tokens": 64,
                                                    "temperature": 0, "stop": stops, "stream": True})
        assert r.status_code == 200, r.text
        took.append(time.perf_counter() - sent)
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    return {"answer_s": [round(t, 2) for t in sorted(took)]}


async def reset_flood(api, urls, model, *, orch) -> dict:
    goaways = [await rapid_reset(urls[0], 20_000) for _ in range(3)]
    return {"goaway": [g.error_code.name if g else None for g in goaways]}


async def conn_flood(api, urls, model, *, orch) -> dict:
    parts = urllib.parse.urlsplit(urls[0])
    socks, closed = [], 0
    for _ in range(300):
        socks.append(await trio.open_tcp_stream(parts.hostname, parts.port))
    for sock in socks[-44:]:  # the ones past the cap are closed by the node
        with trio.move_on_after(1):
            closed += await sock.receive_some(1) == b""
    await trio.sleep(1)
    for sock in socks:
        await sock.aclose()
    await trio.sleep(1)  # the node sees them go
    return {"opened": len(socks), "closed_by_node_of_last_44": closed}


async def walk_away(api, urls, model, *, orch) -> dict:
    parts = urllib.parse.urlsplit(urls[0])
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 400,
                       "temperature": 0, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: {api.headers['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    async def leave():
        sock = await trio.open_tcp_stream(parts.hostname, parts.port)
        await sock.send_all(head + body)
        await trio.sleep(random.uniform(0, 0.005))
        await sock.aclose()
    before = await _ended(api)
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(leave)
    left = time.perf_counter()
    async with http() as client:
        while not await _idle(client, urls):
            await trio.sleep(0.01)
    free_s = time.perf_counter() - left
    after = await _ended(api)  # those closed before they were admitted never start
    return {"clients": 20, "slots_free_after_s": round(free_s, 3),
            "ended": {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}}


async def _ended(api) -> dict[str, float]:
    metrics = (await api.get("/metrics")).text
    return {k: float(v) for k, v in re.findall(r'pp_requests_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', metrics)}


async def _idle(client, urls) -> bool:
    """No stage holds a slot, and stage 0 neither runs, queues nor follows a request."""
    hs = [(await client.get(u + "/health")).json() for u in urls]
    return not (any(h["slots_in_use"] for h in hs) or hs[0]["slots"]["active"] or hs[0]["queue"]["waiting"]
                or hs[0]["followed"])


FLOOD_S, FLOODERS = 10.0, 8
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, payload: bytes, flags: int = 0, stream_id: int = 0) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) + payload


PING = _frame(6, b"\0" * 8)
SETTINGS = _frame(4, struct.pack(">HI", 2, 0))  # ENABLE_PUSH 0; each one must be acknowledged
CALM = _frame(7, struct.pack(">II", 0, 11))  # GOAWAY, last stream 0, ENHANCE_YOUR_CALM


async def ping_flood(api, urls, model, *, orch) -> dict:
    return await _flood(urls, PING, orch)


async def settings_flood(api, urls, model, *, orch) -> dict:
    return await _flood(urls, SETTINGS, orch)


async def _flood(urls: list[str], frame: bytes, orch) -> dict:
    """FLOODERS connections to stage 0 send `frame` back to back for FLOOD_S, each reconnecting when closed."""
    parts, tally, blob = urllib.parse.urlsplit(urls[0]), collections.Counter(), frame * ((1 << 16) // len(frame))

    async def attack() -> None:
        async with trio.open_nursery() as flooders:
            for _ in range(FLOODERS):
                flooders.start_soon(_flooder, parts.hostname, parts.port, blob, len(blob) // len(frame), tally)
    stages = await _watched(attack, FLOOD_S, urls, orch)
    # frames written to sockets, most never read by a node that closes the connection: the flood offered
    return {"frames_offered_per_s": round(tally["frames"] / FLOOD_S), "connections": tally["connections"],
            "calmed": tally["calmed"], "refused": tally["refused"], **stages}


async def _watched(attack, seconds: float, urls: list[str], orch) -> dict:
    """Run `attack()` for `seconds`, then a second of quiet, all the while watching the runner's view of the
    stages: any stage member it held as anything but alive, whether the members are the same after (no
    replacement), and whether every stage then answers /health."""
    members = {m.meta.stage: (m.id, m.incarnation) for m in orch.stages()}
    not_alive: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_stages, orch, not_alive)
        with trio.move_on_after(seconds):
            await attack()
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    after = {m.meta.stage: (m.id, m.incarnation) for m in orch.stages()}
    healthy = [await _answers(u + "/health") for u in urls]
    return {"stages_not_alive": not_alive, "stage_members_unchanged": after == members,
            "stages_health_200": all(healthy)}


async def _answers(url: str) -> bool:
    async with http(timeout=5) as client:
        try:
            return (await client.get(url)).status_code == 200
        except httpx.TransportError:
            return False


async def _watch_stages(orch, seen: list[str]) -> None:
    """Record each stage member the runner's gossip view holds as anything but alive (what a replacement follows)."""
    while True:
        def news(swim):
            states = (f"stage {m.meta.stage} {m.state.value}" for m in swim.members().values()
                      if m.meta.stage is not None and m.state is not State.ALIVE)
            return [state for state in states if state not in seen]
        seen += await orch.swim.wait_until(news)


async def _flooder(host: str, port: int, blob: bytes, frames: int, tally: collections.Counter) -> None:
    while True:
        try:
            sock = await trio.open_tcp_stream(host, port)
        except OSError:  # refused: the node is down (a figure of its own), or out of its connection cap
            tally["refused"] += 1
            await trio.sleep(0.01)
            continue
        async with sock, trio.open_nursery() as nursery:
            tally["connections"] += 1
            nursery.start_soon(_drain, sock, tally, nursery.cancel_scope)
            try:
                await sock.send_all(PREFACE + _frame(4, b""))
                while True:
                    await sock.send_all(blob)
                    tally["frames"] += frames
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the node closed it (its reset reached us before its GOAWAY was read)
            nursery.cancel_scope.cancel()


async def _drain(sock, tally: collections.Counter, scope: trio.CancelScope) -> None:
    """Read and drop what the node sends (PING and SETTINGS ACKs), noting its GOAWAY ENHANCE_YOUR_CALM."""
    tail = b""
    try:
        while data := await sock.receive_some(1 << 16):
            if CALM in tail + data[:len(CALM)] or CALM in data:
                tally["calmed"] += 1
            tail = data[-len(CALM):]
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


BURST_CONNECTIONS, BURST_STREAMS, BURST_HOLD_S = 200, 100, 20.0
REFUSED_STREAM = 0x7


async def stream_burst(api, urls, model, *, orch) -> dict:
    """The second audit's burst: BURST_CONNECTIONS connections each open BURST_STREAMS `GET /health` at once, with
    no key (about 10 bytes a request with HPACK), then stay open BURST_HOLD_S reading what comes (before issue 33's
    stream cap, stage 0 was declared dead and replaced)."""
    parts, tally = urllib.parse.urlsplit(urls[0]), collections.Counter()

    async def attack() -> None:
        async with trio.open_nursery() as bursts:
            for _ in range(BURST_CONNECTIONS):
                bursts.start_soon(_burst, parts.hostname, parts.port, tally)
    stages = await _watched(attack, BURST_HOLD_S, urls, orch)
    return {"connections": tally["connections"], "requests": BURST_CONNECTIONS * BURST_STREAMS,
            "answered": tally["answered"], "refused_stream": tally["refused"], **stages}


async def _burst(host: str, port: int, tally: collections.Counter) -> None:
    encoder = hpack.Encoder()
    headers = [(b":method", b"GET"), (b":path", b"/health"), (b":scheme", b"http"), (b":authority", b"node")]
    requests = b"".join(_frame(1, encoder.encode(headers), 0x5, 2 * j + 1) for j in range(BURST_STREAMS))
    try:
        sock = await trio.open_tcp_stream(host, port)
    except OSError:
        tally["not_connected"] += 1
        return
    async with sock:
        tally["connections"] += 1
        await sock.send_all(PREFACE + _frame(4, b"") + requests)
        buffer = b""
        try:
            while data := await sock.receive_some(1 << 16):
                buffer += data
                while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                    length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                    if kind == 4 and not flags & 0x1:
                        await sock.send_all(_frame(4, b"", 0x1))  # acknowledge the node's SETTINGS
                    elif kind == 1:
                        tally["answered"] += 1
                    elif kind == 3 and int.from_bytes(buffer[9:13], "big") == REFUSED_STREAM:
                        tally["refused"] += 1
                    buffer = buffer[9 + length:]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


PHASES = {"idle": idle, "long-prompt": long_prompt, "long-stops": long_stops, "rapid-reset": reset_flood,
          "conn-flood": conn_flood, "walk-away": walk_away, "ping-flood": ping_flood,
          "settings-flood": settings_flood, "stream-burst": stream_burst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES), help="which, in order (all)")
    p.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the /health poller's own process
    args = p.parse_args(argv)
    if args.poll:
        poll(args.poll)
    else:
        trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
