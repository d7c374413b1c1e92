"""Replay from kept KV (issue 36): a replay's new life keeps what a surviving stage holds. Only the rows a
stage lacks are computed, a first or middle stage passes on the rows it kept, and the answer is the one the
request would have had undisturbed. Driven here on stub workers, whose hash catches any KV that is wrong,
skipped or computed twice out of order."""
import numpy as np
import pytest

from worker.chain import one, run_chain
from worker.contract import StepItem
from worker.kept import KeptRows
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.resume import pieces
from worker.stub import StubTokenizer

PROMPT = StubTokenizer().encode_chat("Tell me a long story about the sea")
RID = "r"


@pytest.mark.parametrize("position, rows, held, kept, expected", [
    # the last stage (kept None): held rows are skipped, the item's last row is always computed
    (0, 10, 0, None, [(0, 10, True)]),
    (0, 10, 6, None, [(0, 6, False), (6, 10, True)]),
    (0, 10, 10, None, [(0, 9, False), (9, 10, True)]),
    (0, 10, 25, None, [(0, 9, False), (9, 10, True)]),
    (8, 4, 6, None, [(8, 12, True)]),
    # first and middle stages: kept rows inside the held positions go on as they are
    (0, 10, 0, (0, 0), [(0, 10, True)]),
    (0, 10, 10, (0, 10), [(0, 10, False)]),
    (0, 10, 6, (0, 6), [(0, 6, False), (6, 10, True)]),
    (0, 10, 10, (0, 7), [(0, 7, False), (7, 10, True)]),       # rows kept for fewer positions than held
    (0, 10, 10, (3, 10), [(0, 3, True), (3, 10, False)]),      # a hole at the start: computed
    (0, 12, 12, (3, 8), [(0, 3, True), (3, 8, False), (8, 12, True)]),
    (4, 4, 12, (0, 12), [(4, 8, False)]),
    (10, 4, 12, (0, 12), [(10, 12, False), (12, 14, True)]),
    (0, 10, 0, (0, 10), [(0, 10, True)]),                      # rows of an earlier life count only once held
])
def test_an_item_is_cut_into_what_is_held_and_what_is_computed(position, rows, held, kept, expected):
    assert pieces(position, rows, held=held, kept=kept) == expected


@pytest.mark.parametrize("position, rows, held, expected", [
    (0, 10, 25, [(0, 10, False)]),  # a prompt chunk before the last, all held: nothing at all
    (0, 10, 6, [(0, 6, False), (6, 10, True)]),
    (0, 10, 0, [(0, 10, True)]),
])
def test_the_last_stage_skips_every_held_row_of_a_chunk_whose_logits_nobody_wants(position, rows, held, expected):
    assert pieces(position, rows, held=held, kept=None, last_row=False) == expected


def test_kept_rows_grow_in_runs_and_hand_out_any_span():
    rows = KeptRows()
    data = np.arange(40, dtype=np.float32).reshape(10, 4)
    rows.add(3, data[3:6])
    rows.add(6, data[6:7])
    rows.add(0, data[0:3])  # a run just before the kept ones
    assert (rows.first, rows.end) == (0, 7)
    assert np.array_equal(rows.span(2, 7), data[2:7])
    below = rows.below(5)
    assert (below.first, below.end) == (0, 5) and np.array_equal(below.span(0, 5), data[0:5])
    rows.add(9, data[9:10])  # a run apart from the others starts them over
    assert (rows.first, rows.end) == (9, 10)
    with pytest.raises(ValueError, match="not all kept"):
        rows.span(8, 10)


class Counted:
    """The rows each stage computed, per forward_batch call: (position, length) of each segment."""

    def __init__(self, workers):
        self.rows = [[] for _ in workers]
        for i, w in enumerate(workers):
            self.wrap(i, w)

    def wrap(self, i, worker):
        inner = worker.compute.forward_batch

        def counted(hidden, segments, **kw):
            self.rows[i] += [(s.position, s.length) for s in segments]
            return inner(hidden, segments, **kw)
        worker.compute.forward_batch = counted

    def total(self, i) -> int:
        return sum(n for _, n in self.rows[i])

    def clear(self):
        self.rows = [[] for _ in self.rows]


def chain(n=3):
    model = stub_model()
    return model, [open_worker(model, Shard.of(s, n)) for s in range(n)]


def forward(workers, tokens, position, *, upto=None):
    """Rows for `tokens` at `position` through the first `upto` stages (all: the last samples)."""
    upto = len(workers) if upto is None else upto
    out = one(workers[0], StepItem(RID, position, tokens=tuple(tokens)))
    for w in workers[1:upto]:
        out = one(w, StepItem(RID, position, hidden=out, seq_len=len(tokens)))
    if upto == len(workers):
        return workers[-1].sample(RID, out)
    return out


def generate(workers, count):
    """The prompt, then `count` tokens decoded through the chain: the tokens."""
    tokens = [forward(workers, PROMPT, 0)]
    while len(tokens) < count:
        tokens.append(forward(workers, [tokens[-1]], len(PROMPT) + len(tokens) - 1))
    return tokens


def replay(workers, tokens, chunk, then):
    """A replay's new life: prompt and `tokens` again from position 0 in chunks, then `then` more tokens."""
    for w in workers:
        w.restart(RID)
    ids = [*PROMPT, *tokens]
    for start in range(0, len(ids), chunk):
        got = forward(workers, ids[start:start + chunk], start)
    out = [got]
    while len(out) < then:
        out.append(forward(workers, [out[-1]], len(ids) + len(out) - 1))
    return out


def undisturbed(count):
    model, workers = chain()
    return run_chain(workers, PROMPT, count).token_ids


def test_a_stage_that_holds_none_computes_every_row_and_the_survivors_none_they_hold():
    model, workers = chain()
    before = generate(workers, 6)
    workers[1] = open_worker(model, Shard.of(1, 3))  # the replacement: holds nothing
    counted = Counted(workers)
    after = replay(workers, before[:-1], chunk=8, then=5)
    assert before + after[1:] == undisturbed(10)  # the replay's first token is the last one again
    replayed = len(PROMPT) + 5
    assert counted.total(1) == replayed + 4  # every row, then four decode rows
    assert counted.total(0) == 4  # stage 0 held every replayed row: only the decode rows
    assert counted.total(2) == len(range(0, replayed, 8)) + 4  # the last row of each chunk, then decode


def test_a_stage_that_holds_part_computes_the_rest():
    model, workers = chain()
    tokens = generate(workers, 6)
    lost = len(PROMPT) + len(tokens) - 1
    forward(workers, [tokens[-1]], lost, upto=2)  # fed back, but lost before the last stage
    workers[1] = open_worker(model, Shard.of(1, 3))
    counted = Counted(workers)
    after = replay(workers, tokens, chunk=8, then=4)
    assert tokens + after == undisturbed(10)
    # stage 0 held the lost position too; the last stage lacked it, and computes it with the last chunk's row
    assert counted.total(0) == 3
    assert (lost, 1) in counted.rows[2]


def test_a_hole_in_the_kept_rows_is_computed_and_the_rows_after_it_reused():
    model, workers = chain()
    before = generate(workers, 6)
    held = workers[0]._slots.requests[RID]
    kept = held.rows
    held.rows = KeptRows(8, (kept.span(8, kept.end),))  # as if the first 8 positions' rows were not kept
    workers[2] = open_worker(model, Shard.of(2, 3))  # the last stage is the one replaced
    counted = Counted(workers)
    after = replay(workers, before[:-1], chunk=8, then=4)
    assert before + after[1:] == undisturbed(9)
    assert counted.rows[0][0] == (0, 8)  # the hole, computed again from its input
    assert counted.total(0) == 8 + 3
    assert counted.total(1) == 3  # stage 1 held and kept every row


def test_a_new_life_that_starts_past_what_the_slot_holds_starts_afresh():
    model, workers = chain()
    generate(workers, 3)
    workers[0].restart(RID)
    w0 = workers[0]
    with pytest.raises(Exception, match="unknown request"):
        one(w0, StepItem(RID, 100, tokens=(2,)))  # the slot was freed: a start past position 0 is refused
    assert RID not in w0.active


def test_the_last_stage_gives_no_logits_for_a_prompt_chunk_before_the_last():
    model, workers = chain(2)
    hidden = one(workers[0], StepItem(RID, 0, tokens=tuple(PROMPT)))
    counted = Counted(workers)
    head = []
    inner = workers[1].compute.forward_batch
    workers[1].compute.forward_batch = lambda h, segs, logit_rows=None: head.append(len(logit_rows)) or inner(
        h, segs, logit_rows=logit_rows)
    assert one(workers[1], StepItem(RID, 0, hidden=hidden, seq_len=len(PROMPT), logits=False)) is None
    assert head == [0] and counted.total(1) == len(PROMPT)  # the rows fill the KV; the head runs on none
