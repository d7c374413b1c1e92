"""The worker a stage's node calls: one stage's batched step, checked against its role and each request's position.

Hidden states cross stage boundaries as float32 bytes of shape (seq_len, hidden_dim): f16 would
flip near-ties between the pipeline and single-process generation.

Many requests at once: each holds one of the slice's `max_seqs` sequence slots (its KV caches, worker/slots.py)
from its first step, at position 0, until `release`. `run` computes the steps of several requests as one batch
(worker/chain.py drives one request through a chain of workers with it). A step that is refused (unknown
request, wrong position, bad input) fails alone; a batch whose compute raises forgets every request in it,
since their KV caches may be half-written.

The prefix cache (roles/prefix.py decides, stage 0 tells): `release(keep_as=)` keeps a finished request's
slot, its KV, as a named entry (worker/kept.py); a request whose first step names an entry
(StepItem.from_cache) starts at that position, in the entry's very slot (`take`) or in a free slot its rows
are copied into. Entries are forgotten when stage 0 says (`drop`), or here when a slot is needed and only
entries hold them.

The first and last stages hold the model's Vocabulary (worker/tokens/vocabulary.py), `vocabulary`: text to
tokens and back is its, not the worker's (stage 0's node hands it to the API and the first actor).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import StepItem, WorkerInfo
from .errors import WorkerError
from .batching import Segment
from .grammar import GrammarError, Matcher
from .partition import Role, Shard
from .resume import pieces
from .sampling import sample, stop_set
from .slice import Slice
from .slots import Request, Slots
from .tokens.vocabulary import Vocabulary, check_token_ids


class StageWorker:
    """Stage `shard` (sized: its blocks) of a model, computing on `compute` (its slice); `vocabulary` is the
    model's, kept on the first and last stages."""

    def __init__(self, compute: Slice, vocabulary: Vocabulary, shard: Shard):
        self.compute, self.role = compute, shard.role
        self.vocabulary = None if self.role is Role.MIDDLE else vocabulary
        self.info = WorkerInfo(
            shard=shard, hidden_dim=compute.hidden_dim, vocab_size=compute.vocab_size,
            max_context=compute.max_context, stop_ids=vocabulary.stop_ids, weight_bytes=compute.weight_bytes,
            kv_bytes=compute.kv_bytes, max_seqs=compute.max_seqs, max_batch=compute.max_batch,
            kernels=compute.kernels)
        self._slots = Slots(stage=shard.index, max_seqs=compute.max_seqs, max_context=compute.max_context,
                            copy_rows=lambda source, slot, n: self.compute.copy_rows(source, slot, n),
                            trim=lambda slot: self.compute.trim(slot))
        self._grammars = None  # the last stage's GrammarCompiler, made at the first grammar

    # -- the batched ops (worker/contract.py's Worker) ----------------------------------------
    def run(self, items: list[StepItem]) -> list[bytes | np.ndarray | WorkerError]:
        """Compute the steps of several requests as one batch, in order. Each result is the item's hidden
        bytes (first and middle stages), its last row's logits (the last stage; every row's, (rows, vocab),
        for an item with `all_logits`), or the WorkerError that refused it. A request starts, taking a free
        slot, with its step at position 0."""
        results: list = [None] * len(items)
        accepted: list[tuple[int, StepItem, Request]] = []
        planned: dict[str, int] = {}  # next position per request, counting earlier items of this batch
        starting: dict[str, Request] = {}  # kept only once the batch has computed
        for i, item in enumerate(items):
            try:
                _check_input(item, self.info)
                accepted.append((i, item, self._slots.admit(item, planned, starting)))
            except WorkerError as exc:
                results[i] = exc
        if accepted:
            self._compute(accepted, starting, results)
        return results

    def sample(self, request_id: str, logits: np.ndarray, *, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = (), stop_ids: frozenset[int] | None = None,
               allowed: np.ndarray | None = None) -> int:
        """Draw the next token of a request from its logits, with the sampling it started with.

        The penalties read `prompt_ids` and `output_ids` (the tokens so far); min_tokens masks `stop_ids`,
        by default the model's stop ids as the request's ignore_eos and stop_token_ids make them.
        """
        self.info.require(Role.LAST, "sample")
        req = self._slots.known(request_id)
        stops = stop_set(self.info.stop_ids, req.sampling) if stop_ids is None else stop_ids
        return sample(logits, req.sampling, req.rng, prompt_ids=prompt_ids, output_ids=output_ids,
                      stop_ids=stops, allowed=allowed)

    def grammar_matcher(self, grammar: str) -> Matcher:
        """A request's constrained decoding (Sampling.grammar, worker/grammar.py), fresh at its first token;
        compiled grammars are kept. On the compute thread: compiling takes milliseconds."""
        self.info.require(Role.LAST, "grammar_matcher")
        if self._grammars is None:
            self._grammars = self.vocabulary.grammar_compiler()
        try:
            return self._grammars.matcher(grammar)
        except GrammarError as exc:
            raise WorkerError(f"response_format: {exc}") from None

    def warm_up(self, beam: int = 0, *, lazy: bool = False, prompt_rows: int | None = None) -> dict[int, float]:
        """Compile before the first request (a node calls this before it reports ready); with `beam`, search
        for faster kernels first (tinygrad's BEAM; what it finds is cached on disk for the next boot). `lazy`:
        only the smallest step bucket and the one a prompt chunk of `prompt_rows` fills now, the others one at
        a time by warm_more (worker/compute/warm.py). Returns each capture's seconds."""
        return self.compute.warm_up(beam, lazy=lazy, prompt_rows=prompt_rows)

    def warm_more(self) -> tuple[int, float] | None:
        """After a lazy warm_up, between steps: capture the next bucket (its size and seconds), or None once
        every one is."""
        return self.compute.warm_more()

    @property
    def wants_capture(self) -> bool:
        """Steps keep wanting a bucket not captured yet: capture it now rather than at an idle moment (a plain
        read, safe from the event loop)."""
        return self.compute.wants_capture

    def release(self, request_id: str, *, keep_as: str = "") -> None:
        """Free a request's slot, or (`keep_as`) keep its KV as the prefix-cache entry of that name, replacing
        any entry of the name; releasing an unknown request is a no-op so teardown can be repeated."""
        self._slots.release(request_id, keep_as=keep_as)

    def restart(self, request_id: str) -> None:
        """The request's next item begins a new life (a replay): it keeps the slot, and the rows the slot holds
        are not computed again (worker/resume.py). An unknown request starts afresh."""
        self._slots.restart(request_id)

    def forget(self, entries: Sequence[str]) -> None:
        """Give up the KV of these prefix-cache entries, their slots' memory with it; unknown ones are no-ops."""
        self._slots.forget(entries)

    @property
    def kept(self) -> dict[str, int]:
        """The prefix-cache entries held here and the positions each holds (compute thread)."""
        return self._slots.kept.lengths()

    @property
    def kept_count(self) -> int:
        """How many prefix-cache entries hold slots here; safe to read from any thread."""
        return len(self._slots.kept)

    @property
    def active(self) -> frozenset[str]:
        """The requests holding a slot (compute thread)."""
        return frozenset(self._slots.requests)

    @property
    def slots_in_use(self) -> int:
        """How many slots are held; safe to read from any thread."""
        return len(self._slots)

    @property
    def prefix_rows(self) -> dict[str, int]:
        """Positions of prefix-cache entries that starts mapped (shared, nothing copied) or copied; any thread."""
        return dict(self._slots.rows_moved)

    @property
    def kv_positions(self) -> tuple[int, int]:
        """KV positions held by requests and by prefix-cache entries; safe to read from any thread."""
        return self._slots.positions()

    # -- internals ---------------------------------------------------------------------------
    def _compute(self, accepted: list[tuple[int, StepItem, Request]], starting: dict[str, Request],
                 results: list) -> None:
        """Run the rows the slots lack as one batch (a replay's kept ones are not computed: worker/resume.py)
        and fill in each item's result."""
        plans = [(i, item, req, self._pieces(item, req)) for i, item, req in accepted]
        segments, inputs, wants = [], [], []  # wants: of each segment, its last rows whose logits are wanted
        for _, item, req, parts in plans:
            rows = _input(item, self.info, self.compute)
            for start, stop, computed in parts:
                if computed:
                    segments.append(Segment(req.slot, start, stop - start))
                    inputs.append(rows[start - item.position:stop - item.position])
                    wants.append(_logits_wanted(item, stop - start))
        out = self._forward(segments, inputs, wants, accepted) if segments else None
        self._slots.requests.update(starting)
        offset = 0
        for i, item, req, parts in plans:
            req.next_position = item.position + item.rows
            if self.role is Role.LAST:  # the logits rows of the item's one computed piece, if it wants any
                k = _logits_wanted(item, item.rows)
                results[i] = None if not k else out[offset] if not item.all_logits else out[offset:offset + k]
                offset += k
                continue
            chunks = []
            for start, stop, computed in parts:
                if computed:
                    chunks.append(out[offset:offset + stop - start])
                    req.rows.add(start, chunks[-1])
                    offset += stop - start
                else:
                    chunks.append(req.rows.span(start, stop))
            results[i] = (chunks[0] if len(chunks) == 1 else np.concatenate(chunks)).tobytes()

    def _pieces(self, item: StepItem, req: Request) -> list:
        if self.role is Role.LAST:  # every row's logits wanted: nothing is skipped
            return pieces(item.position, item.rows, held=0 if item.all_logits else req.held, kept=None,
                          last_row=item.logits)
        return pieces(item.position, item.rows, held=req.held, kept=(req.rows.first, req.rows.end))

    def _forward(self, segments: list[Segment], inputs: list[np.ndarray], wants: list[int],
                 accepted: list) -> np.ndarray:
        """The batch's computed rows: hidden rows, or (the last stage) the logits its segments want."""
        hidden = np.concatenate(inputs)
        try:
            if self.role is not Role.LAST:
                return self.compute.forward_batch(hidden, segments)
            return self.compute.forward_batch(hidden, segments, logit_rows=_logit_rows(segments, wants))
        except BaseException:
            for _, item, _ in accepted:
                self.release(item.request_id)
            raise


def _logits_wanted(item: StepItem, rows: int) -> int:
    """The last stage: of `rows` computed rows of an item, how many (the last ones) need logits: every row
    (a prompt's logprobs), the last (its rows end the prompt, or decode), or none (a prompt chunk before)."""
    return rows if item.all_logits else 1 if item.logits else 0


def _check_input(item: StepItem, info: WorkerInfo) -> None:
    """Raises WorkerError unless `item` carries what its stage takes: token ids on the first, hidden rows elsewhere."""
    if info.shard.first:
        if not item.tokens:
            raise WorkerError(f"request {item.request_id!r}: no tokens")
        check_token_ids(list(item.tokens), info.vocab_size)
        return
    dim = info.hidden_dim
    if item.seq_len < 1 or len(item.hidden) != item.seq_len * dim * 4:
        raise WorkerError(f"hidden state of {len(item.hidden)} bytes does not match seq_len {item.seq_len} × "
                          f"hidden_dim {dim} × 4 bytes (float32)")


def _input(item: StepItem, info: WorkerInfo, compute: Slice) -> np.ndarray:
    """An item's rows as the slice takes them: its tokens embedded (the first stage), or its hidden bytes."""
    if info.shard.first:
        return compute.embed(list(item.tokens))
    return np.frombuffer(item.hidden, dtype=np.float32).reshape(item.seq_len, info.hidden_dim)


def _logit_rows(segments: list[Segment], wants: list[int]) -> np.ndarray:
    """Which of a step's rows the head runs on: the last `wants[n]` rows of segment n, in order."""
    rows, offset = [], 0
    for s, k in zip(segments, wants):
        offset += s.length
        rows.extend(range(offset - k, offset))
    return np.asarray(rows, dtype=np.int64)
