"""A warm spare (`ppnode.py --standby`; `ppsmoke.py --seed --serve --standby K` starts them, runner/standby.py).

It loads the slice of every stage but the first and captures, for each, the step graphs a replacement needs at
once: bucket 1, and the largest, which a replay fills (stage 0 replays every request in flight through the
new chain, and only the new stage computes their whole prefixes). Then it waits, listening nowhere and in no
gossip, until its runner names a stage on its stdin: a line `take <stage>`. It boots as that stage's node with
the slice it holds, and drops the others. A lost stage then costs no process start, no imports, no weights
and no capture: only the replay (issue 36).

Not stage 0: its clients' streams end with it whatever replaces it, and its replacement must listen where
the API was. A standby holds N-1 slices with their KV caches: the model's weights less stage 0's blocks, and
N-1 stages' KV (PP_MAX_SEQS x PP_CTX positions a block), until it takes one.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Callable

import attrs
import trio

from node.compute import ComputeThread, open_compute_thread
from node.config.settings import NodeConfig
from node.main import ModelRefused, build_worker, open_stage_model, run_node, slice_url
from node.observe.log import event
from worker.partition import AUTO, Shard

log = logging.getLogger("pp.node")


class TakeRefused(ValueError):
    """The runner's line is no `take <stage>` this standby can take."""


def take_of(line: str, num_stages: int) -> int:
    """Pure: the stage a runner's line `take <stage>` names, one of 1 .. num_stages-1; TakeRefused otherwise."""
    words = line.split()
    if len(words) != 2 or words[0] != "take" or not words[1].isdigit():
        raise TakeRefused(f"the runner said {line.strip()!r}; a standby understands only `take <stage>`")
    stage = int(words[1])
    if not 1 <= stage < num_stages:
        raise TakeRefused(f"`take {stage}`: a standby takes a stage of 1 .. {num_stages - 1} (not stage 0, whose "
                          f"streams end with it)")
    return stage


def prepare(config: NodeConfig) -> dict[int, tuple]:
    """Compute thread: every stage but the first, as build_worker makes it, with bucket 1 and the largest
    captured. Stage → (worker, its phases' seconds)."""
    if config.layer_partition == AUTO:  # a spare starts after the plan: its runner gives it the cluster's split
        raise ModelRefused("a standby loads every stage's range of a split it is given: give --layer-partition the "
                           "cluster's split (ppsmoke --standby does), not auto")
    clock = time.perf_counter()
    model = open_stage_model(config, config.model)
    opened = round(time.perf_counter() - clock, 3)
    prepared = {}
    for stage in range(1, config.num_stages):
        worker, phases = build_worker(config, model, Shard.of(stage, config.num_stages, config.layer_partition),
                                     prompt_rows=None)
        prepared[stage] = worker, {"open_model_s": opened, **phases}
    return prepared


async def run_standby(config: NodeConfig, takes: trio.abc.ReceiveChannel[str], *, on_ready: Callable[[], None],
                      on_listening: Callable[[str], None] = lambda url: None) -> None:
    """Prepare, say so (`on_ready`), wait for the stage `takes` names, then run as its node until cancelled."""
    if slice_url(config.model) is not None:
        raise ModelRefused(f"a standby loads the whole model from this machine; {config.model!r} would be "
                           f"fetched: give the local file the runner fetched")
    async with open_compute_thread() as compute:
        started = time.perf_counter()
        prepared = await compute.call(prepare, config)
        event(log, "standby_ready", stages=list(prepared), seconds=round(time.perf_counter() - started, 3))
        on_ready()
        stage = take_of(await takes.receive(), config.num_stages)
        loaded = prepared.pop(stage)
        await _drop(compute, prepared)
        event(log, "standby_takes", stage=stage, node_id=config.node_id)
        await run_node(attrs.evolve(config, stage=stage, standby=False), on_listening=on_listening,
                       compute=compute, loaded=loaded)


async def _drop(compute: ComputeThread, prepared: dict) -> None:
    """The slices not taken, freed on the thread that made them (tinygrad's buffers)."""
    def drop():
        prepared.clear()
        gc.collect()
    await compute.call(drop)
