"""Slots that share KV rows by mapping the same pages (worker/kv_pages.py): a prefix-cache hit reads the entry's
very bytes, writes stay each slot's own, and pages go back to the system once no slot maps them."""
import collections
import os

import numpy as np
import pytest

from chain import Chain
from worker.files import shared_zeros
from worker.kv_pages import SPARE, KvPages
from worker.models import tinygrad_model
from worker.weights.tiny import TinySource

ROWS, WIDTH = 64, 64  # float32: 256 bytes a position, 16 positions a page


@pytest.fixture
def pages():
    host, fd = shared_zeros((3 * ROWS, WIDTH), np.float32, file_factor=SPARE)
    return host, fd, KvPages([(host, fd)], 3, ROWS, [WIDTH * 4])  # the file closes with the array


def slot(host, s):
    return host[s * ROWS:(s + 1) * ROWS]


def held_bytes(fd) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_shared_prefix_reads_the_source_s_bytes_and_writes_stay_each_slot_s_own(pages):
    host, fd, kv = pages
    slot(host, 0)[:] = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH)
    before = held_bytes(fd)
    assert kv.share(0, 1, 32)
    assert held_bytes(fd) == before  # nothing copied, nothing new held
    assert (slot(host, 1)[:32] == slot(host, 0)[:32]).all() and not slot(host, 1)[32:].any()
    slot(host, 1)[32:40] = -1  # the new request's own positions
    slot(host, 0)[40] = 7  # the entry's own, past the shared prefix
    assert (slot(host, 0)[32:40] == np.arange(32 * WIDTH, 40 * WIDTH).reshape(8, WIDTH)).all()
    assert slot(host, 1)[40].sum() == 0 and (slot(host, 1)[32:40] == -1).all()


def test_a_source_reset_keeps_the_rows_others_share_and_gives_back_the_rest(pages):
    host, fd, kv = pages
    slot(host, 0)[:] = 1
    assert kv.share(0, 1, 32)
    kv.reset(0)  # the entry evicted: its slot takes a fresh region; the shared rows stay for slot 1
    assert held_bytes(fd) == 32 * WIDTH * 4  # only the 32 shared positions are held
    # (before any read of the fresh region: a read fault in a shared mapping takes a page, as a write does)
    assert not slot(host, 0).any() and (slot(host, 1)[:32] == 1).all()
    slot(host, 0)[:] = 5  # the slot's new request writes its own region
    assert (slot(host, 1)[:32] == 1).all()
    kv.reset(1)
    kv.reset(0)
    assert held_bytes(fd) == 0 and len(kv.free) == 3 * SPARE - 3  # every region back, each slot its own


def test_a_share_of_a_shared_prefix_maps_the_first_source_s_pages(pages):
    host, fd, kv = pages
    slot(host, 0)[:] = 2
    assert kv.share(0, 1, 48)
    slot(host, 1)[48:] = 3
    kv.reset(0)
    assert kv.share(1, 2, 64 - 16)  # slot 2 starts from slot 1's first 48: slot 0's old pages
    assert (slot(host, 2)[:48] == 2).all() and not slot(host, 2)[48:].any()


@pytest.mark.parametrize("position", [16, 20])  # on a page's edge, and inside one: its rows below are copied
def test_a_taken_slot_written_again_inside_its_shared_prefix_writes_its_own_pages(pages, position):
    host, fd, kv = pages
    slot(host, 0)[:] = np.arange(ROWS, dtype=np.float32)[:, None]
    assert kv.share(0, 1, 48)
    kv.writable(1, position)  # an entry taken by a request that matched only its first `position` rows
    assert (slot(host, 1)[:position] == slot(host, 0)[:position]).all()
    slot(host, 1)[position:] = -1
    assert (slot(host, 0)[:, 0] == np.arange(ROWS)).all()  # the source's rows are untouched
    assert kv.runs[1] == [(0, 16, 0), (16, ROWS, 1)]


def test_a_boundary_off_a_page_is_refused_and_the_caller_copies(pages):
    _, _, kv = pages
    assert not kv.share(0, 1, 20)  # 20 positions of 256 bytes end mid-page
    assert kv.runs[1] == [(0, ROWS, 1)]


def test_requests_that_share_a_cached_prefix_on_tinygrad_map_its_rows_and_answer_as_without_it():
    chain = Chain(2, max_seqs=4, model=tinygrad_model(TinySource()))
    system = "You are a terse assistant who answers in one line, always, whatever is asked of you. "
    chain.ask({"warm": chain.tokens(system + "Tell me a story about the rivers and the mountains of Europe.")})
    prompts = {f"q{i}": chain.tokens(system + q) for i, q in enumerate(["Say hello.", "Name a colour.", "Why?"])}
    assert chain.ask(prompts) == {rid: chain.reference(ids) for rid, ids in prompts.items()}
    assert all(chain.starts[rid] >= 16 for rid in prompts)  # each started after the cached blocks
    moved = [w.prefix_rows for w in chain.workers]
    assert all(m["shared"] == sum(chain.starts.values()) and m["copied"] == 0 for m in moved), moved
    chain.assert_clean()


# --- copy on write, for everyone who maps a page (issue 54) ---------------------------------------------------

def test_a_taken_entry_written_past_its_match_leaves_a_slot_that_shares_its_rows_as_it_was(pages):
    """The audit's finding: slot 1 shares 48 rows of entry 0; a request that matched only entry 0's first 16 rows
    takes it and writes from 16 on. Slot 1 must still read entry 0's old rows, not the newcomer's."""
    host, fd, kv = pages
    slot(host, 0)[:] = np.arange(ROWS, dtype=np.float32)[:, None]
    assert kv.share(0, 1, 48)
    kv.writable(0, 16)
    slot(host, 0)[16:] = -1  # the newcomer's rows
    assert (slot(host, 1)[:48, 0] == np.arange(48)).all()
    assert (slot(host, 0)[:16, 0] == np.arange(16)).all()


class Private:
    """What each slot would hold were every slot's rows a private copy: the property's reference."""

    def __init__(self, slots: int):
        self.rows = np.zeros((slots, ROWS, WIDTH), np.float32)
        self.valid = [0] * slots  # positions a slot's request has, readable


def apply(op: str, kv: KvPages, host: np.ndarray, ref: Private, rng: np.random.Generator) -> None:
    """One step of a stage's slots, done to the pages and to the reference alike."""
    slots = len(ref.valid)
    s, other = (int(x) for x in rng.choice(slots, 2, replace=False))
    if op == "share":  # a start from another slot's cached prefix: a fresh slot, then its first rows
        p = int(rng.integers(0, ref.valid[other] + 1))
        p = p // 16 * 16 if rng.random() < 0.8 else p  # mostly whole blocks, as the prefix cache matches
        kv.reset(s)
        if not kv.share(other, s, p):  # off a page, or few regions left: copied, as kv_rows.copy_rows does
            slot(host, s)[:p] = slot(host, other)[:p]
        ref.rows[s, :p], ref.valid[s] = ref.rows[other, :p], p
    elif op == "take":  # an entry continued from a shorter match, or a replay from an earlier position
        ref.valid[s] = int(rng.integers(0, ref.valid[s] + 1))
    elif op == "reset":  # a request released, an entry evicted
        kv.reset(s)
        ref.valid[s] = 0
    if op in ("write", "share", "take"):  # then a step's rows at its next position: a prompt chunk, a decode row
        write(kv, host, ref, s, int(rng.integers(1, 24)), rng)


def write(kv: KvPages, host: np.ndarray, ref: Private, s: int, n: int, rng: np.random.Generator) -> None:
    at = ref.valid[s]
    n = min(n, ROWS - at)
    if n:
        kv.writable(s, at)
        rows = rng.standard_normal((n, WIDTH)).astype(np.float32)
        slot(host, s)[at:at + n] = rows
        ref.rows[s, at:at + n] = rows
        ref.valid[s] = at + n


def assert_private(kv: KvPages, host: np.ndarray, ref: Private, history: list[str]) -> None:
    for s, valid in enumerate(ref.valid):
        got = slot(host, s)[:valid]
        assert np.array_equal(got, ref.rows[s, :valid]), f"slot {s} after {history[-6:]}: runs {kv.runs}"
    counted = sum((collections.Counter(g for _, _, g in runs) for runs in kv.runs), collections.Counter())
    assert +kv.refs == counted and not set(kv.free) & set(counted), (kv.refs, counted, kv.free)
    owns = [runs[-1][2] for runs in kv.runs]
    assert len(set(owns)) == len(owns) and all(runs[-1][1] == ROWS for runs in kv.runs), kv.runs


@pytest.mark.parametrize("spare", [2, 3, 4], ids=lambda n: f"{n} regions a slot")
def test_every_slot_reads_what_a_private_copy_would_hold_whatever_the_interleaving(spare):
    """Random interleavings of starts (fresh or from a shared prefix), writes, takes, replays and resets over a
    small pool of pages: after every step, every slot's readable rows equal a private copy's. With few regions
    to spare, the slots that read a writer's pages move instead of the writer."""
    slots, rng = 4, np.random.default_rng(spare)
    for run in range(60):
        host, fd = shared_zeros((slots * ROWS, WIDTH), np.float32, file_factor=spare)
        kv, ref, history = KvPages([(host, fd)], slots, ROWS, [WIDTH * 4], spare=spare), Private(slots), []
        for _ in range(40):
            op = str(rng.choice(["write", "write", "share", "take", "reset"]))
            apply(op, kv, host, ref, rng)
            history.append(op)
            assert_private(kv, host, ref, history)
        del host
