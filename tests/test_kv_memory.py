"""A stage's KV memory follows what its slots hold (issue 39): on the CPU the caches are reserved as pages the
kernel backs only once written (worker/files.lazy_zeros), and a slot no one will read again gives its pages
back (files.release, StageModel.trim): a released request's, and one a new request takes."""
import mmap

import numpy as np

from worker.contract import StepItem
from worker.files import lazy_zeros, release
from worker.models import open_worker, tinygrad_model
from worker.partition import Shard
from worker.weights.tiny import TinySource

MB = 2 ** 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_reserved_zeros_take_memory_only_where_written_and_release_gives_it_back():
    before = rss()
    cache = lazy_zeros((64 * MB // 4,), np.float32)
    assert rss() - before < 8 * MB and not cache.any()  # 64 MB reserved, none of it backed
    cache[: 32 * MB // 4] = 1.0
    assert rss() - before > 24 * MB  # what was written is backed
    release(cache, 0, 32 * MB)
    assert rss() - before < 8 * MB and not cache.any()  # given back, and it reads as zeros again


def test_release_keeps_the_pages_it_shares_with_the_bytes_around_it():
    cache = lazy_zeros((4 * mmap.PAGESIZE,), np.uint8)
    cache[:] = 7
    release(cache, 100, 3 * mmap.PAGESIZE + 100)  # only pages 1 and 2 lie wholly inside
    assert (cache[:mmap.PAGESIZE] == 7).all() and (cache[3 * mmap.PAGESIZE:] == 7).all()
    assert not cache[mmap.PAGESIZE:3 * mmap.PAGESIZE].any()


def host_caches(worker) -> list[np.ndarray]:
    model = worker.compute.model
    return [model.lazy_host(b.cache) for b in model.blocks]


def test_a_released_request_s_slot_gives_its_kv_back_and_the_next_request_answers_as_alone():
    model = tinygrad_model(TinySource())
    worker = open_worker(model, Shard.of(0, 2), max_seqs=2)
    ctx = worker.compute.max_context

    def run(request_id: str, tokens: tuple[int, ...]):
        return worker.run([StepItem(request_id, 0, tokens=tokens)])[0]

    first = run("a", (5, 6, 7, 8))
    run("b", (9, 10, 11))
    slot_of = {rid: worker._slots.requests[rid].slot for rid in ("a", "b")}
    assert all(c[slot_of["a"] * ctx:slot_of["a"] * ctx + 4].any() for c in host_caches(worker))
    worker.release("a")
    for c in host_caches(worker):
        assert not c[slot_of["a"] * ctx:(slot_of["a"] + 1) * ctx].any()  # given back
        assert c[slot_of["b"] * ctx:slot_of["b"] * ctx + 3].any()  # the other request's KV stays
    assert np.array_equal(run("c", (5, 6, 7, 8)), first)  # the trimmed slot serves the next request as new


def test_a_stage_counts_the_kv_positions_its_requests_and_its_prefix_cache_hold():
    worker = open_worker(tinygrad_model(TinySource()), Shard.of(0, 2), max_seqs=3)
    assert worker.kv_positions == (0, 0)
    worker.run([StepItem("a", 0, tokens=(5, 6, 7, 8)), StepItem("b", 0, tokens=(9, 10))])
    assert worker.kv_positions == (6, 0)
    worker.release("a", keep_as="entry-a")  # kept for the prefix cache: cached, not used
    worker.release("b")
    assert worker.kv_positions == (0, 4)
