"""What a stage computes next: the rows waiting at it, and the planner that picks one batched step.

Every stage runs the same loop: rows arrive (a prompt, a prompt chunk, a decode token's row), wait here,
and the next step takes as many as fit in one batch of `max_rows`. The planner is a pure function:

1. Decode rows go first, oldest first, one row each: a generating request never waits behind a prompt
   for more than the one step already computing.
2. Prompt rows fill the rest of the step, oldest request first; a prompt that does not fit is split, and
   its remainder waits for the next step (chunked prefill). A stage's row budget is at least twice its
   sequence slots, so each step has room for every slot's decode row and at least as many prompt rows:
   prompts always advance too. The chunked prefill size (`prompt_rows`, a node's --chunked-prefill-size)
   caps a step's prompt rows lower still, so that a long prompt costs the streams decoding beside it
   little per step (issue 25: the stall a prefill puts on them), at the price of more steps for it. Not while
   a replay's rows wait: its stream stands still until they are through, and so usually does every other
   (a replacement's chain replays every request in flight), so they go as fast as the step's room allows.
3. A request's rows are taken in position order: a later piece is taken only after every earlier one.

So the bound on a decode's wait is one step of at most `max_rows` rows, whatever the prompts' length.

4. Stage 0 caps a step's decode rows at its share of the requests it has running (`decode_group`): with N
   stages and R requests, ceil(R / N) each. So the requests in flight travel as N micro-batches, one at each
   stage, and every stage has one to compute while the others do theirs; without the cap, rows that come
   back together from the last stage leave together again, as one batch that keeps one stage busy at a
   time (issue 34: at N = 2 under 8 streams each stage's device was ~50% busy). A decode row left over by
   the cap goes in the next step, right after.
5. While a request decodes beyond stage 0 (its row is further down the chain), stage 0 takes no prompt rows
   in a step without decode rows: prompt chunks ride with the decode rows (`prompts_ride`). Otherwise stage 0
   fills the chain with chunks as fast as it computes them, every stage is busy with prompt rows, and a
   decode row waits behind one at each stage: at N = 3 on 2 cores a stream ran 8-9x slower while a 450-token
   prompt was read (issue 34, `bench.stall`). With no request decoding, prompts run as fast as they can; so
   do they while a replay's rows wait (roles/messages.py), since its stream is stopped until they are through.
6. Beside decode rows, prompt rows stop where the step's rows fill a batch bucket (`bucket_fill`), when the
   chunk would otherwise spill into the next bucket's padding: one decode row and 3 prompt rows run as a
   bucket of 4, where 1 + 4 ran as a bucket of 8 at 2.8x a one-row step (15 SmolLM2 blocks: 5.78 / 9.71 /
   16.31 ms for 1 / 4 / 8 rows; issue 34). Both the stream beside the prompt and the prompt gain.

StageQueue holds the waiting rows, the requests that ended here (late rows for them are dropped), and
the slots to release in the worker before the next step.
"""
from __future__ import annotations

import collections
from typing import Collection, Sequence

import attrs

from worker.batching import bucket_sizes

from .messages import RequestStart

ENDED_REMEMBERED = 4096  # ended request ids kept to recognise their late rows


@attrs.frozen
class Unit:
    """Rows of one request waiting at a stage: tokens on the first stage, hidden bytes elsewhere."""

    request_id: str
    position: int
    rows: int
    decode: bool  # a generated token's row, not a prompt's
    tokens: tuple[int, ...] = ()
    hidden: bytes = b""
    stage_ms: tuple[float, ...] = ()
    start: RequestStart | None = None  # on the request's first rows (position 0)
    sample: bool = False  # last stage: these rows end the prompt, or are a decode: sample after them
    generation: int = 0  # the request's life these rows belong to (roles/messages.py: replay)

    def split(self, k: int) -> tuple[Unit, Unit]:
        """The first k rows, and the rest (which no longer starts the request). Upstream compute time stays
        with the first part: those stages computed all the rows in the steps it counts."""
        row_bytes = len(self.hidden) // self.rows
        head = attrs.evolve(self, rows=k, tokens=self.tokens[:k], hidden=self.hidden[:k * row_bytes], sample=False)
        tail = attrs.evolve(self, position=self.position + k, rows=self.rows - k, tokens=self.tokens[k:],
                            hidden=self.hidden[k * row_bytes:], start=None, stage_ms=(0.0,) * len(self.stage_ms))
        return head, tail


@attrs.frozen
class Step:
    units: tuple[Unit, ...]
    # requests whose slots the worker frees before computing, each with the name to keep its KV under ("": none)
    release: tuple[tuple[str, str], ...]
    restart: tuple[str, ...] = ()  # requests whose next rows begin a new life in the slot they hold (a replay)
    forget: tuple[str, ...] = ()  # prefix-cache entries whose KV the worker gives up before computing


def decode_group(running: int, num_stages: int) -> int:
    """Stage 0's cap on a step's decode rows (rule 4): its share of `running` requests over the stages."""
    return max(1, -(-running // num_stages))


def prompts_ride(decoding_elsewhere: bool, waiting: Sequence[Unit], replaying: frozenset[str] = frozenset()) -> bool:
    """Rule 5: whether the next step takes prompt rows only beside decode rows (none are waiting: none). A
    replay's rows (requests in `replaying`) never wait: their streams stand still until the replay is done."""
    return decoding_elsewhere and not any(u.decode or u.request_id in replaying for u in waiting)


def bucket_fill(decodes: int, room: int, max_rows: int) -> int:
    """Rule 6: how many of `room` prompt rows go beside `decodes` decode rows: up to the largest bucket they
    fill whole, if any (else all of them: prompts always advance)."""
    if decodes == 0:
        return room
    fits = [b - decodes for b in bucket_sizes(max_rows) if decodes < b <= decodes + room]
    return max(fits) if fits else room


def replays(unit: Unit) -> bool:
    """A replay's prompt rows (a later life's): its stream stands still until they are through (rule 2)."""
    return not unit.decode and unit.generation > 0


def plan_rows(waiting: Sequence[Unit], max_rows: int, prompt_rows: int | None = None,
              decode_rows: int | None = None) -> list[int]:
    """How many rows of each waiting unit the next step takes (0: none), by the rules above; `prompt_rows`
    caps the prompt rows of one step (the chunked prefill size) below what the decode rows leave, and
    `decode_rows` its decode rows (stage 0's micro-batch)."""
    take = [0] * len(waiting)
    budget = max_rows
    decodes = max_rows if decode_rows is None else decode_rows
    seen: set[str] = set()
    for i, u in enumerate(waiting):
        if u.decode and budget > 0 and decodes > 0 and u.request_id not in seen:  # never ahead of its own rows
            take[i], budget, decodes = 1, budget - 1, decodes - 1
        seen.add(u.request_id)
    if prompt_rows is not None and not (prompt_rows and any(replays(u) for u in waiting)):
        budget = min(budget, prompt_rows)
    budget = bucket_fill(sum(take), budget, max_rows)
    blocked: set[str] = set()  # requests with an earlier piece not fully taken
    for i, u in enumerate(waiting):
        if u.decode:
            if take[i] == 0:
                blocked.add(u.request_id)
            continue
        if u.request_id in blocked or budget == 0:
            blocked.add(u.request_id)
            continue
        take[i] = min(u.rows, budget)
        budget -= take[i]
        if take[i] < u.rows:
            blocked.add(u.request_id)
    return take


class StageQueue:
    """The rows waiting at one stage. Event loop only."""

    def __init__(self, max_rows: int, prompt_rows: int | None = None):
        self.max_rows, self.prompt_rows = max_rows, prompt_rows
        self.waiting: list[Unit] = []
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._release: list[tuple[str, str]] = []
        self._restart: list[str] = []
        self._forget: list[str] = []

    def add(self, unit: Unit) -> None:
        self.waiting.append(unit)

    def ended(self, request_id: str) -> bool:
        return request_id in self._ended

    def end(self, request_id: str, keep_as: str = "") -> None:
        """Forget the request here: drop its waiting rows, free its slot before the next step (or, `keep_as`,
        keep its KV under that name: the prefix cache)."""
        self.waiting = [u for u in self.waiting if u.request_id != request_id]
        self._ended[request_id] = None
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self._release.append((request_id, keep_as))

    def free(self, request_id: str) -> None:
        """The request's life is over here but the request is not (preempted, roles/kv_budget.py): drop its
        waiting rows and free its slot before the next step; a later life's rows start it over."""
        self.waiting = [u for u in self.waiting if u.request_id != request_id]
        self._release.append((request_id, ""))

    def forget(self, entry: str) -> None:
        """Give up a prefix-cache entry's KV before the next step (EndReason.DROPPED)."""
        self._forget.append(entry)

    def restart(self, request_id: str) -> None:
        """The request begins a new life (a replay): drop its waiting rows; before the next step, which may
        hold its new first rows, the worker hears of it (what the slot holds is not computed again)."""
        self.waiting = [u for u in self.waiting if u.request_id != request_id]
        self._restart.append(request_id)

    def release_again(self, releases) -> None:
        """Free these slots before the next step: those of a step whose compute failed before freeing them."""
        self._release.extend(releases)

    def next_step(self, decode_rows: int | None = None, *, prompts: bool = True,
                  held: Collection[str] = ()) -> Step | None:
        """Take the next step's rows off the queue, or None when there is nothing to do; `decode_rows`: at
        most this many decode rows (plan_rows); without `prompts`, no prompt rows; the rows of the requests
        `held` stay where they are."""
        ready = [u for u in self.waiting if u.request_id not in held]
        takes = iter(plan_rows(ready, self.max_rows, self.prompt_rows if prompts else 0, decode_rows))
        units, rest = [], []
        for unit in self.waiting:
            k = 0 if unit.request_id in held else next(takes)
            if k == unit.rows:
                units.append(unit)
            elif k:
                head, tail = unit.split(k)
                units.append(head)
                rest.append(tail)
            else:
                rest.append(unit)
        self.waiting = rest
        if not units and not self._release and not self._restart and not self._forget:
            return None
        step = Step(tuple(units), tuple(self._release), tuple(self._restart), tuple(self._forget))
        self._release, self._restart, self._forget = [], [], []
        return step
