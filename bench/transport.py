"""Transport micro-benchmark: what one hop costs on the wire, nothing else.

Times sequential POSTs of activation-sized bodies to /v1/activation over the project's own client
(node.transport.client.PeerClient) and server (node.transport.app), HTTP/2 and HTTP/1.1 side by side, and the same
activations as frames of one link stream (node/transport/streams.py). The server runs in a separate process so
that client and server do not share one event loop or one core, and its dispatcher only counts what
it is handed: no model, no compute. A POST's figure is a full round trip: the POST, the server's
decode of the activation, and its 202 answer. A stream's is one way, from the frame's encoding to its
delivery in the server's handler (one machine: one monotonic clock), since nobody answers a frame.

    python -m bench.transport --requests 500 --json /tmp/transport.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

from node.transport import wire
from node.transport.app import make_app, serve_app
from node.transport.link_routes import add_link_routes
from node.transport.client import PeerClient
from node.transport.tls import ClusterTls
from node.observe.hops import HopStats, now
from node.transport.links import Outbox
from node.transport.streams import LinkReceiver, LinkStream
from node.config.network import DEFAULT_MAX_BODY_BYTES
from worker.contract import GREEDY

TOKEN = "bench-transport"  # server and client derive the cluster's CA from it: every call is mutual TLS, as a node's
# (hidden_dim, seq_len): llama3.2:1b decode step, the tiny model's decode step, a 16-token prefill
CASES = [(2048, 1), (128, 1), (2048, 16)]
PROTOCOLS = [("HTTP/2", True), ("HTTP/1.1", False)]
REPO = Path(__file__).resolve().parent.parent


class CountingDispatcher:
    """Accepts every activation and only counts it, so the timings are transport alone."""

    swim, loading, serving = None, False, True

    def __init__(self, hidden_dim: int):
        self.hidden_dim = hidden_dim
        self.delivered = 0
        self.links_in, self.hops = LinkReceiver(), HopStats()

    def deliver(self, message, **_) -> None:
        self.delivered += 1

    def take_frame(self, link_id: str, source: str, seq: int, sent_at: float, message) -> None:
        self.links_in.delivered(link_id, seq)
        self.hops.record(f"from {source}", "wire", now() - sent_at)
        self.deliver(message)

    async def wait_response(self, request_id: str, wait_s: float):
        return None

    def health(self) -> dict:
        return {"delivered": self.delivered}


async def serve(port: int, dim: int) -> None:
    """Serve until stdin closes, so the server cannot outlive a benchmark that was killed."""
    dispatcher = CountingDispatcher(dim)
    app = make_app(dispatcher, token=TOKEN, max_body_bytes=DEFAULT_MAX_BODY_BYTES)
    add_link_routes(app, dispatcher)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(functools.partial(serve_app, app, "127.0.0.1", port,
                                                      tls=ClusterTls(TOKEN, "bench-server").server_context()))
        print(f"https://127.0.0.1:{bound}", flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        while await stdin.receive_some():
            pass
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def server_process(dim: int):
    """Spawn `--serve` in a child process, yield its URL; the child is killed on every way out."""
    cmd = [sys.executable, "-m", "bench.transport", "--serve", "--port", "0", "--dim", str(dim)]
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(lambda task_status: trio.run_process(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, check=False, task_status=task_status))
        try:
            yield await _read_line(proc.stdout, cmd)
        finally:
            nursery.cancel_scope.cancel()  # run_process terminates the child on cancel


async def _read_line(stream, cmd) -> str:
    data = b""
    with trio.fail_after(30):
        while not data.endswith(b"\n"):
            chunk = await stream.receive_some()
            if not chunk:
                raise RuntimeError(f"benchmark server exited before printing its URL: {shlex.join(cmd)}")
            data += chunk
    return data.decode().strip()


def activation_body(dim: int, seq_len: int) -> bytes:
    """A realistic body: a uuid request id, one stage's timing; a prefill carries its start and reply URL."""
    prefill = seq_len > 1
    start = wire.RequestStart(64, GREEDY, tuple(range(1000, 1000 + seq_len)), "http://127.0.0.1:8000") \
        if prefill else None
    segment = wire.SegmentMeta(uuid.uuid4().hex, 0 if prefill else 17, seq_len, (12.5,), start)
    return wire.encode_activation(wire.Activation(wire.ActivationMeta((segment,)), bytes(dim * seq_len * 4)))


async def time_requests(url: str, http2: bool, body: bytes, n: int, warmup: int) -> tuple[list[float], float]:
    """Latencies in ms of n sequential POSTs after warm-up requests, and the wall time of the n."""
    async with PeerClient(ClusterTls(TOKEN, "bench-client"), http2=http2) as client:
        for _ in range(warmup):
            await client.post(url, "/v1/activation", body, "application/octet-stream")
        ms = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter_ns()
            await client.post(url, "/v1/activation", body, "application/octet-stream")
            ms.append((time.perf_counter_ns() - t) / 1e6)
        return ms, time.perf_counter() - t0


async def served_counts(url: str) -> dict:
    async with PeerClient(ClusterTls(TOKEN, "bench-client"), http2=False) as client:
        return (await client.get(url, "/health")).json()


def summarize(protocol: str, dim: int, seq_len: int, body: bytes, ms: list[float], wall_s: float) -> dict:
    p10, p50, p90, p99 = np.percentile(ms, [10, 50, 90, 99])
    return {"protocol": protocol, "dim": dim, "seq_len": seq_len, "body_bytes": len(body), "n": len(ms),
            "median_ms": round(p50, 4), "p10_ms": round(p10, 4), "p90_ms": round(p90, 4),
            "p99_ms": round(p99, 4), "req_per_s": round(len(ms) / wall_s, 1)}


async def bench_dim(dim: int, seq_lens: list[int], n: int, warmup: int) -> list[dict]:
    rows = []
    async with server_process(dim) as url:
        for seq_len in seq_lens:
            body = activation_body(dim, seq_len)
            for protocol, http2 in PROTOCOLS:
                before = await served_counts(url)
                ms, wall_s = await time_requests(url, http2, body, n, warmup)
                check_served(before, await served_counts(url), http2, n + warmup)
                rows.append(summarize(protocol, dim, seq_len, body, ms, wall_s))
            figures = await time_stream(url, wire.decode_activation(body, dim), n, warmup)
            rows.append({"protocol": "HTTP/2 link stream, one way", "dim": dim, "seq_len": seq_len,
                         "body_bytes": len(body), "n": figures["n"], "median_ms": round(figures["median_ms"], 4),
                         "p10_ms": None, "p90_ms": None, "p99_ms": round(figures["p99_ms"], 4), "req_per_s": None})
    return rows


async def time_stream(url: str, message, n: int, warmup: int, gap_s: float = 0.002) -> list[float]:
    """One-way ms of n frames on one link stream, each sent alone (a gap after each): the server's figures."""
    async with PeerClient(ClusterTls(TOKEN, "bench-client")) as client, trio.open_nursery() as nursery:
        outbox = Outbox()
        link = LinkStream("bench-server", source="bench", resolve=lambda _: url, client=client.http,
                          stats=HopStats(), on_lost=lambda messages, error: print(error, file=sys.stderr))
        nursery.start_soon(link.run, outbox)
        for i in range(warmup + n):
            if i == warmup:
                await client.post(url, "/v1/hops/reset", b"")
            outbox.put(message)
            await trio.sleep(gap_s)
        await trio.sleep(0.05)
        figures = (await client.get(url, "/v1/hops")).json()["from bench"]["wire"]
        nursery.cancel_scope.cancel()
    # fewer when two messages queued together went as one frame; one more when the reset beat a warm-up frame
    if not n // 2 <= figures["n"] <= n + 1:
        raise RuntimeError(f"server timed {figures['n']} frames; sent {n} messages: {figures}")
    return figures


def check_served(before: dict, after: dict, http2: bool, sent: int) -> None:
    """Refuse figures the server does not vouch for: every request delivered, over the protocol asked."""
    version = "2" if http2 else "1.1"
    delivered = after["delivered"] - before["delivered"]
    # the /health probes themselves go over HTTP/1.1
    served = after["http_versions"].get(version, 0) - before["http_versions"].get(version, 0) - (not http2)
    if delivered != sent or served != sent:
        raise RuntimeError(f"server saw {delivered} activations, {served} over HTTP/{version}; sent {sent}")


def header(argv: list[str]) -> list[str]:
    return [f"Command: `python -m bench.transport {shlex.join(argv)}`",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "Round trip of one POST /v1/activation (server in its own process, loopback, sequential); "
            "for the link stream, one way (encode to handler), frames 2 ms apart."]


def table(rows: list[dict]) -> list[str]:
    lines = ["| protocol | dim | seq_len | body bytes | n | median ms | p10 ms | p90 ms | p99 ms | req/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {r['protocol']} | {r['dim']} | {r['seq_len']} | {r['body_bytes']} | {r['n']} | "
                     f"{r['median_ms']:.3f} | {f(r['p10_ms'], '.3f')} | {f(r['p90_ms'], '.3f')} | {r['p99_ms']:.3f} | "
                     f"{f(r['req_per_s'], '.0f')} |")
    return lines


async def run_all(n: int, warmup: int) -> list[dict]:
    rows = []
    for dim in dict.fromkeys(d for d, _ in CASES):
        rows += await bench_dim(dim, [s for d, s in CASES if d == dim], n, warmup)
    return sorted(rows, key=lambda r: CASES.index((r["dim"], r["seq_len"])))  # stable: protocols stay paired


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500, metavar="N", help="timed requests per row (500)")
    p.add_argument("--warmup", type=int, default=50, metavar="N", help="untimed requests first (50)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON here")
    p.add_argument("--serve", action="store_true", help="internal: be the server (the benchmark spawns it)")
    p.add_argument("--port", type=int, default=0, help="with --serve: port to bind (0: any free one)")
    p.add_argument("--dim", type=int, default=2048, help="with --serve: hidden size of accepted activations")
    args = p.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        p.error("--requests must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.serve:
        trio.run(serve, args.port, args.dim)
        return
    rows = trio.run(run_all, args.requests, args.warmup)
    print("\n".join(header(argv) + [""] + table(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
