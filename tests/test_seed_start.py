"""ppsmoke --seed starts every stage at once, each on a port picked beforehand and handed its predecessor's
address as PEER_DIRECT (the spec's chain of direct peers), instead of waiting for each to listen in turn."""
import types
from pathlib import Path

import trio

from runner import seed
from worker.contract import GREEDY


def options(n: int, **kw) -> seed.SeedOptions:
    return seed.SeedOptions(num_stages=n, model="stub", prompt="p", max_tokens=1, sampling=GREEDY, timeout_s=1,
                            converge_timeout_s=1, base_env={}, **kw)


async def start_all(opts, monkeypatch) -> list[dict]:
    asked, all_asked = [], trio.Event()

    async def fake_start(nursery, opts, token, seed_url, stage, peer, log_path, *, port=None):
        asked.append({"stage": stage, "peer": peer, "port": port})
        if len(asked) == opts.num_stages:
            all_asked.set()
        with trio.fail_after(5):  # a stage that waited for the one before to listen would never get here
            await all_asked.wait()
        return types.SimpleNamespace(stage=stage, url=f"https://127.0.0.1:{port}", process=types.SimpleNamespace(pid=1))
    monkeypatch.setattr(seed, "_start_child", fake_start)
    children = []
    async with trio.open_nursery() as nursery:
        await seed._start_children(nursery, opts, "t", "https://seed", Path("/tmp"), children, lambda line: None)
    assert [c.stage for c in children] == list(range(opts.num_stages))
    return sorted(asked, key=lambda a: a["stage"])


async def test_every_stage_starts_at_once_each_with_its_predecessors_address(monkeypatch):
    asked = await start_all(options(5), monkeypatch)
    ports = [a["port"] for a in asked]
    assert len(set(ports)) == 5 and all(ports)
    # each stage's peer: its predecessor's address, https:// as every member's (they speak TLS)
    assert [a["peer"] for a in asked] == [None, *(f"https://127.0.0.1:{p}" for p in ports[:-1])]


async def test_stage_0_keeps_the_port_it_was_given(monkeypatch):
    asked = await start_all(options(3, port=18123), monkeypatch)
    assert asked[0]["port"] == 18123 and asked[1]["peer"] == "https://127.0.0.1:18123"
