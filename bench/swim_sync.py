"""What one /swim/sync push costs a member's event loop: the body decoded as the HTTP route decodes it
(node.transport.wire), then Swim.on_sync, for pushes naming N members nobody runs, into a view of one.
Prints one line per N: milliseconds to decode, to handle, and the view's size after.

    PYTHONPATH=. python -m bench.swim_sync 256 1000 3000 12000
"""
from __future__ import annotations

import json
import random
import sys
import time

import trio

from node.membership.gossip import Member, Meta, SwimConfig, Sync
from node.membership.swim import Swim
from node.transport import wire


class _NoPeers:
    async def ping(self, addr, msg):
        raise AssertionError("no peers")

    async def ping_req(self, addr, msg):
        raise AssertionError("no peers")

    async def sync(self, addr, msg):
        raise AssertionError("no peers")


def _body(n: int) -> bytes:
    members = [{"id": f"x{i}", "addr": f"http://x{i}:8000", "incarnation": 1, "state": "alive",
                "meta": {"stage": None, "names": [], "ready": False, "observer": False, "progress": None,
                         "max_seqs": None}} for i in range(n)]
    return json.dumps({"members": members}).encode()


async def _one(n: int) -> str:
    swim = Swim(Member("me", "http://me:1", 1, meta=Meta(stage=0)), SwimConfig(), _NoPeers(), random.Random(0), ())
    body = _body(n)
    started = time.perf_counter()
    try:
        msg = wire.decode(Sync, body)
    except wire.WireError as exc:
        decoded = time.perf_counter()
        return f"n={n}: decode {1000 * (decoded - started):.1f} ms, refused: {exc}"
    decoded = time.perf_counter()
    swim.on_sync(msg)
    handled = time.perf_counter()
    return (f"n={n}: decode {1000 * (decoded - started):.1f} ms, on_sync {1000 * (handled - decoded):.1f} ms, "
            f"view {len(swim.members())}")


async def main(sizes: list[int]) -> None:
    for n in sizes:
        print(await _one(n), flush=True)


if __name__ == "__main__":
    trio.run(main, [int(a) for a in sys.argv[1:]] or [256, 1000, 3000, 12000])
