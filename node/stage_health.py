"""What a stage reports about itself: /health's figures and the metrics' snapshot, read from the node's parts
at the moment they are asked for. Functions of the node; nothing here changes it."""
from __future__ import annotations

import collections
import resource

import attrs


def memory(worker, kv_budget: int | None = None) -> dict:
    """The memory figures of /health and of the metrics' gauges: weights, KV caches (the bytes reserved, and
    the positions this stage may hold (`kv_budget`, else all slots'), those requests hold and those prefix-cache
    entries hold: on the CPU only positions held take memory), slots held, peak RSS."""
    info = worker.info if worker is not None else None
    used, cached = worker.kv_positions if worker is not None else (None, None)
    total = None if info is None else kv_budget or info.max_seqs * info.max_context
    return {"weight_bytes": info.weight_bytes if info else None, "kv_bytes": info.kv_bytes if info else None,
            "kv_positions": None if info is None else {"total": total, "used": used, "cached": cached},
            "prefix_rows": worker.prefix_rows if worker is not None else None,  # shared or copied at a hit
            "slots_in_use": worker.slots_in_use if worker is not None else None,
            "slots_kept": worker.kept_count if worker is not None else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # ru_maxrss is KiB


def kernels(worker) -> dict | None:
    """What a loaded stage computes with (worker.contract.Kernels), as /health shows it: name, device, target,
    threads, and the fallback's cause and fix where pp's CPU kernels could not be built."""
    return attrs.asdict(worker.info.kernels) if worker is not None else None


def health(node) -> dict:
    """A stage's /health body: its place, its slice, memory, figures, the actor's queue and slots, its links."""
    info = node.worker.info if node.worker is not None else None
    links = node.links
    return {"ok": True, "node": node.node_id, "stage": node.shard.index, "role": node.shard.role.value,
            "ready": info is not None, "layers": [info.shard.blocks.start, info.shard.blocks.stop] if info else None,
            "max_seqs": info.max_seqs if info else None, "max_batch": info.max_batch if info else None,
            "warming": node.warming,  # step buckets left to capture: steps until then are cut into the captured ones
            "kernels": kernels(node.worker),  # what its steps compute with: pp's CPU kernels or tinygrad's, and why
            **memory(node.worker, node.kv_budget),
            **node.side.figures(),
            **node.figures.health(),
            **(node.actor.health() if node.actor else {}),
            "links": links.pending() if links else {},
            "link_streams": {d: s.opened for d, s in links.streams.items()} if links else {}}


def metrics_snapshot(node) -> dict:
    """The figures the metrics' gauges read (node/observe/metrics.py): requests running and queued, the prefix
    cache, memory, and the members gossip knows by state."""
    view = node.swim.members().values() if node.swim is not None else ()
    health = node.actor.health() if node.actor is not None else {}
    return {"running": node.side.running(health),
            "queued": health.get("queue", {}).get("waiting"), "prefix_cache": health.get("prefix_cache"),
            "preemptions": health.get("kv", {}).get("preemptions"),
            **memory(node.worker, node.kv_budget), "kernels": kernels(node.worker),
            "members": collections.Counter(m.state.value for m in view)}
