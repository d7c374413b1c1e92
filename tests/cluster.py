"""Test helper: an in-process cluster — the orchestrator plus N stage nodes over real hypercorn HTTP/2
on loopback, each node started as ppsmoke does: in order, each with its predecessor as PEER_DIRECT."""
from __future__ import annotations

import functools
import ssl
import time
import urllib.parse
from pathlib import Path

import h2.events
import h2.exceptions
import httpx
import trio

from node.config.settings import NodeConfig
from node.membership.gossip import SwimConfig
from node.compute import open_compute_thread
from node.main import run_node
from node.transport.client import member_transport
from node.transport.tls import ClusterTls
from runner.orchestrator import Orchestrator, run_orchestrator
from runner.session import api_base as api  # stage 0's API as a user's client reaches it: plain http://
from worker.models import stub_model
from worker.reference import generate_full
from worker.stub import StubSlice

TOKEN = "test-cluster-token"  # the nodes' own secret: their certificates, and so gossip, links, /v1/inference ...
API_KEY = "test-client-key"  # what a client holds: the OpenAI API, /v1/pipeline, /metrics
MEMBER_TLS = ClusterTls(TOKEN, "test-member")  # a member's certificate, as a runner holds one
# fast enough for tests, slow enough that a busy 2-core machine doesn't look dead
FAST_SWIM = SwimConfig(protocol_period_s=0.3, probe_timeout_s=0.15, suspicion_mult=4, sync_interval_s=2.0)
# for in-process clusters of tinygrad models: the nodes share one event loop with a compute thread that holds
# the GIL through long stretches of graph capture, and 5 such nodes on 2 cores missed 150 ms probes for long
# enough to be declared dead (test_serving at N = 5, most runs on a loaded machine)
PATIENT_SWIM = SwimConfig(protocol_period_s=0.5, probe_timeout_s=0.4, suspicion_mult=10, sync_interval_s=2.0)


def member_http(*, http1: bool = True, http2: bool = False, **kw) -> httpx.AsyncClient:
    """A client as a member is one: it shows a certificate of the cluster's CA and checks the node's (asking for the
    cluster's by name, as members do: node/transport/client.py)."""
    return httpx.AsyncClient(transport=member_transport(MEMBER_TLS, http1=http1, http2=http2), **kw)


def client_http(**kw) -> httpx.AsyncClient:
    """A client over TLS without a member's certificate (a user's, a scraper's): it checks the node's against the
    cluster's CA, and shows none of its own."""
    return httpx.AsyncClient(verify=ca_context(), **kw)


def ca_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=MEMBER_TLS.ca.pem)
    return ctx


async def open_raw(url: str, tls: ssl.SSLContext | None, alpn: list[str] | None = None) -> trio.abc.Stream:
    """A raw connection to a node, for hostile tests: plain TCP, or TLS with `tls` (asking for `alpn` where given,
    as HTTP/2 clients ask for h2)."""
    parts = urllib.parse.urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    if tls is None:
        return stream
    if alpn is not None:
        tls.set_alpn_protocols(alpn)
    return trio.SSLStream(stream, tls, server_hostname="node")


async def read_goaway(stream, conn, goaway: list, scope: trio.CancelScope) -> None:
    """Read an h2 client's connection until the server's GOAWAY (into `goaway`) or its end; then cancel `scope`."""
    try:
        while data := await stream.receive_some():
            goaway += [e for e in conn.receive_data(data) if isinstance(e, h2.events.ConnectionTerminated)]
            if goaway:
                break
    except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
        pass
    scope.cancel()


def stage_config(stage: int, n: int, *, model: str, seed: str, peer: str | None, tmp: Path, **kw) -> NodeConfig:
    """A node's config as ppsmoke would make it, but with the spec's even split unless `layer_partition` says
    otherwise: with `auto` (the default) every tinygrad node measures itself for seconds before it loads, and
    no node loads before every stage has (tests/test_planning.py boots clusters that plan); and with float32 KV
    caches unless `kv_cache_dtype` says otherwise, as the in-process references (generate_full on a model
    opened with its defaults) hold theirs: float16's rounding may flip a random-weight model's near-ties."""
    kw = {"api_keys": (API_KEY,), "layer_partition": None, "kv_cache_dtype": "float32", **kw}
    return NodeConfig(stage=stage, num_stages=n, cluster_token=TOKEN, node_id=f"stage{stage}", cache_dir=tmp,
                      ollama_models_dir=tmp / "ollama", seed_addr=seed, peer_direct=(peer,) if peer else (),
                      model=model, port=0, bind_host="127.0.0.1", **kw)


async def _node_until_listening(config: NodeConfig, compute, swim_config: SwimConfig = FAST_SWIM, *,
                                task_status=trio.TASK_STATUS_IGNORED):
    await run_node(config, swim_config=swim_config, on_listening=task_status.started, compute=compute)


async def start_cluster(nursery: trio.Nursery, n: int, tmp: Path, *, model: str = "stub",
                        swim_config: SwimConfig = FAST_SWIM, **kw) -> tuple[Orchestrator, list[str], list[trio.CancelScope]]:
    """Start everything in `nursery`; returns once pp-entry resolves. Each node has its own cancel
    scope, so a test can stop one."""
    orch = await nursery.start(functools.partial(run_orchestrator, TOKEN, swim_config=swim_config))
    compute = await nursery.start(_shared_compute)  # tinygrad is not thread-safe: one thread for all
    urls, scopes, prev = [], [], None
    for stage in range(n):
        scope = trio.CancelScope()
        config = stage_config(stage, n, model=model, seed=orch.url, peer=prev, tmp=tmp, **kw)
        prev = await nursery.start(_scoped, scope, config, compute, swim_config)
        urls.append(prev)
        scopes.append(scope)
    with trio.fail_after(120):
        await orch.converge(n)
    return orch, urls, scopes


async def _scoped(scope: trio.CancelScope, config: NodeConfig, compute, swim_config: SwimConfig = FAST_SWIM, *,
                  task_status=trio.TASK_STATUS_IGNORED):
    with scope:
        await _node_until_listening(config, compute, swim_config, task_status=task_status)


async def _shared_compute(*, task_status=trio.TASK_STATUS_IGNORED):
    async with open_compute_thread(name="cluster-compute") as compute:
        task_status.started(compute)
        await trio.sleep_forever()


async def start_cluster_behind_nat(nursery: trio.Nursery, n: int, tmp: Path, *, model: str = "stub",
                                   **kw) -> tuple[Orchestrator, list[str]]:
    """As on vast.ai with a runner on a laptop: the nodes know no seed and nobody can reach the
    orchestrator; it introduces the nodes to each other and long-polls for the answer."""
    orch = await nursery.start(functools.partial(run_orchestrator, TOKEN, reach=None, swim_config=FAST_SWIM))
    compute = await nursery.start(_shared_compute)
    urls = []
    for stage in range(n):
        config = stage_config(stage, n, model=model, seed=None, peer=None, tmp=tmp, **kw)
        urls.append(await nursery.start(_scoped, trio.CancelScope(), config, compute))
    with trio.fail_after(120):
        for url in urls:
            await orch.introduce(url)
        await orch.converge(n)
    return orch, urls


def slow_stub(monkeypatch, seconds: float) -> None:
    """Make every stand-in step take `seconds` longer, blocking the compute thread as a long tinygrad step would."""
    real = StubSlice.forward_batch

    def forward_batch(self, hidden, segments, logit_rows=None):
        time.sleep(seconds)
        return real(self, hidden, segments, logit_rows)
    monkeypatch.setattr(StubSlice, "forward_batch", forward_batch)


def stub_tokens(prompt: str, max_tokens: int) -> list[int]:
    """The stand-in model's greedy tokens for a prompt, in one process: what a cluster must answer."""
    model = stub_model()
    return generate_full(model, model.tokenizer().encode_chat(prompt), max_tokens).token_ids
