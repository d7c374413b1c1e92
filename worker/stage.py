"""The worker contract a node calls: one stage's ops, checked against its role and each request's position.

Hidden states cross stage boundaries as float32 bytes of shape (seq_len, hidden_dim): f16 would
flip near-ties between the pipeline and single-process generation.

Many requests at once: each holds one of the slice's `max_seqs` sequence slots (its KV caches) from its
first step, at position 0, until `release`. `run` computes the steps of several requests as one batch;
the single-request ops (embed_and_forward, decode_step, forward_range, forward_and_sample) are a batch of
one. A step that is refused (unknown request, wrong position, bad input) fails alone; a batch whose
compute raises forgets every request in it, since their KV caches may be half-written.

The prefix cache (roles/prefix.py decides, stage 0 tells): `release(keep_as=)` keeps a finished request's
slot, its KV, as a named entry (worker/kept.py); a request whose first step names an entry
(StepItem.from_cache) starts at that position, in the entry's very slot (`take`) or in a free slot its rows
are copied into. Entries are forgotten when stage 0 says (`drop`), or here when a slot is needed and only
entries hold them.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np

from .errors import WorkerError
from .batching import Segment
from .grammar import GrammarCompiler, GrammarError, Matcher
from .kept import KeptSlots
from .partition import Role, layer_range, role_of
from .sampling import GREEDY, Sampling, rng_for, sample, stop_set
from .slice import Slice


@attrs.frozen
class WorkerInfo:
    """What a ready worker reports about itself."""

    stage: int
    num_stages: int
    role: Role
    layers: range
    total_blocks: int
    hidden_dim: int
    vocab_size: int
    max_context: int
    stop_ids: frozenset[int]
    weight_bytes: int
    kv_bytes: int = 0
    max_seqs: int = 1
    max_batch: int = 1


@attrs.frozen
class Sampled:
    token_id: int
    logits: np.ndarray  # (vocab,) float32, what token_id was drawn from


@attrs.frozen
class FromCache:
    """How a request's first step starts: forget the kept entries in `drop`, then start from `entry`'s KV
    (its first `position` rows), taking its slot (`take`) or copying them into a free one."""

    entry: str = ""
    take: bool = False
    drop: tuple[str, ...] = ()


@attrs.frozen
class StepItem:
    """One request's part of a batched step: `tokens` on the first stage, `hidden` bytes elsewhere."""

    request_id: str
    position: int
    tokens: tuple[int, ...] = ()
    hidden: bytes = b""
    seq_len: int = 0  # rows of `hidden`; the first stage takes len(tokens)
    sampling: Sampling = GREEDY  # kept when the request starts (position 0), for the last stage's sampler
    all_logits: bool = False  # last stage: the logits of every row (a prompt's logprobs), not only the last
    from_cache: FromCache | None = None  # on a request's first step: where its slot comes from (prefix cache)

    @property
    def rows(self) -> int:
        return len(self.tokens) if self.tokens else self.seq_len


@attrs.define
class _Request:
    slot: int
    next_position: int
    sampling: Sampling
    rng: np.random.Generator


class StageWorker:
    def __init__(self, compute: Slice, tokenizer, *, stage: int, num_stages: int, total_blocks: int):
        self.role = role_of(stage, num_stages)
        self.compute, self.tokenizer = compute, tokenizer
        self.info = WorkerInfo(
            stage=stage, num_stages=num_stages, role=self.role,
            layers=layer_range(total_blocks, stage, num_stages), total_blocks=total_blocks,
            hidden_dim=compute.hidden_dim, vocab_size=compute.vocab_size, max_context=compute.max_context,
            stop_ids=frozenset(tokenizer.stop_ids), weight_bytes=compute.weight_bytes, kv_bytes=compute.kv_bytes,
            max_seqs=compute.max_seqs, max_batch=compute.max_batch)
        self._requests: dict[str, _Request] = {}
        self._kept = KeptSlots(stage)

    # -- first stage -------------------------------------------------------------------------
    def tokenize(self, prompt: str, *, chat: bool = True, add_special_tokens: bool = True) -> list[int]:
        """One user turn through the chat template, or (not `chat`) a raw prompt: BOS first where the vocabulary
        adds one, unless not `add_special_tokens` (vLLM's /tokenize flag)."""
        self._require(Role.FIRST, "tokenize")
        if chat:
            return self.tokenizer.encode_chat(prompt)
        return self.tokenizer.encode_prompt(prompt) if add_special_tokens else self.tokenizer.encode(prompt)

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes (so characters) one token stands for, control tokens' text included: a text of more
        characters than max_context times this cannot fit in the context. Made once, from the whole vocabulary."""
        self._require(Role.FIRST, "longest_token_bytes")
        return max((len(self.tokenizer.decode_bytes([i])) for i in range(self.info.vocab_size)), default=1)

    def tokenize_messages(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """A conversation (system, user and assistant turns) through the model's chat template, ending where the
        assistant's reply starts unless not `add_generation_prompt`."""
        self._require(Role.FIRST, "tokenize_messages")
        return self.tokenizer.encode_messages(messages, add_generation_prompt=add_generation_prompt)

    def token_strs(self, tokens: list[int]) -> list[str]:
        """Each token as the vocabulary spells it ("Ġhello", "▁the", "<|im_start|>"): vLLM's token_strs."""
        self._require(Role.FIRST, "token_strs")
        self.check_tokens(tokens)
        return self.tokenizer.token_strs(tokens)

    def prompt_text(self, tokens: list[int]) -> str:
        """The text `tokens` spell, control tokens included: what /tokenize made them from (vLLM's /detokenize)."""
        self._require(Role.FIRST, "prompt_text")
        self.check_tokens(tokens)
        return self.tokenizer.decode(tokens, specials=True)

    def tokenizer_info(self) -> dict:
        """The vocabulary's special tokens and chat template, as vLLM's GET /tokenizer_info answers (lm-eval's
        remote tokenizer reads eos_token, bos_token, pad_token and chat_template)."""
        self._require(Role.FIRST, "tokenizer_info")
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "bos_token": getattr(tok, "bos_token", None),
                "eos_token": getattr(tok, "eos_token", None), "pad_token": None,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": self.info.max_context}

    def embed_and_forward(self, request_id: str, tokens: list[int], position: int = 0) -> bytes:
        """Prefill: embed `tokens` at `position` and run this stage's blocks."""
        self._require(Role.FIRST, "embed_and_forward")
        if not tokens:
            raise WorkerError("embed_and_forward: no tokens")
        return self._one(StepItem(request_id, position, tokens=tuple(tokens)))

    def decode_step(self, request_id: str, token_id: int, position: int) -> bytes:
        """Decode: embed the token fed back by the last stage at `position` and run the blocks."""
        self._require(Role.FIRST, "decode_step")
        return self._one(StepItem(request_id, position, tokens=(token_id,)))

    # -- middle stages -----------------------------------------------------------------------
    def forward_range(self, request_id: str, hidden: bytes, position: int, seq_len: int) -> bytes:
        self._require(Role.MIDDLE, "forward_range")
        return self._one(StepItem(request_id, position, hidden=hidden, seq_len=seq_len))

    # -- last stage --------------------------------------------------------------------------
    def forward_and_sample(self, request_id: str, hidden: bytes, position: int, seq_len: int,
                           sampling: Sampling | None = None) -> Sampled:
        """Run the blocks, final norm and head, then sample from the last position's logits.

        `sampling` is taken when the request starts (position 0) and kept for its later steps.
        """
        self._require(Role.LAST, "forward_and_sample")
        logits = self._one(StepItem(request_id, position, hidden=hidden, seq_len=seq_len,
                                    sampling=sampling or GREEDY))
        return Sampled(self.sample(request_id, logits), logits)

    def sample(self, request_id: str, logits: np.ndarray, *, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = (), stop_ids: frozenset[int] | None = None,
               allowed: np.ndarray | None = None) -> int:
        """Draw the next token of a request from its logits, with the sampling it started with.

        The penalties read `prompt_ids` and `output_ids` (the tokens so far); min_tokens masks `stop_ids`,
        by default the model's stop ids as the request's ignore_eos and stop_token_ids make them.
        """
        self._require(Role.LAST, "sample")
        req = self._known(request_id)
        stops = stop_set(self.info.stop_ids, req.sampling) if stop_ids is None else stop_ids
        return sample(logits, req.sampling, req.rng, prompt_ids=prompt_ids, output_ids=output_ids,
                      stop_ids=stops, allowed=allowed)

    def grammar_matcher(self, grammar: str) -> Matcher:
        """A request's constrained decoding (Sampling.grammar, worker/grammar.py), fresh at its first token;
        compiled grammars are kept. On the compute thread: compiling takes milliseconds."""
        self._require(Role.LAST, "grammar_matcher")
        try:
            return self._grammars.matcher(grammar)
        except GrammarError as exc:
            raise WorkerError(f"response_format: {exc}") from None

    @functools.cached_property
    def _grammars(self) -> GrammarCompiler:
        tok = self.tokenizer
        return GrammarCompiler([tok.decode_bytes([i]) for i in range(tok.vocab_size)], tok.stop_ids,
                               self.info.vocab_size, control_ids=getattr(tok, "control_ids", ()), encode=tok.encode)

    def detokenize(self, tokens: list[int]) -> str:
        self._require(Role.LAST, "detokenize")
        self.check_tokens(tokens)
        return self.tokenizer.decode(tokens, specials=False)  # an answer's text: no control tokens

    def token_bytes(self, tokens: list[int], *, specials: bool = False) -> bytes:
        """The raw bytes of `tokens`, for the entry to stream text as tokens come back (the first stage
        holds the tokenizer too), control tokens left out as detokenize does unless `specials`; a character
        split across tokens is completed by the caller."""
        if self.role is Role.MIDDLE:
            raise WorkerError(f"token_bytes is a first- or last-stage op; this worker is stage {self.info.stage} "
                              f"of {self.info.num_stages} (middle)")
        self.check_tokens(tokens)
        return self.tokenizer.decode_bytes(tokens, specials=specials)

    # -- any stage ---------------------------------------------------------------------------
    def run(self, items: list[StepItem]) -> list[bytes | np.ndarray | WorkerError]:
        """Compute the steps of several requests as one batch, in order. Each result is the item's hidden
        bytes (first and middle stages), its last row's logits (the last stage; every row's, (rows, vocab),
        for an item with `all_logits`), or the WorkerError that refused it. A request starts, taking a free
        slot, with its step at position 0."""
        results: list = [None] * len(items)
        accepted: list[tuple[int, StepItem, _Request]] = []
        planned: dict[str, int] = {}  # next position per request, counting earlier items of this batch
        starting: dict[str, _Request] = {}  # kept only once the batch has computed
        for i, item in enumerate(items):
            try:
                accepted.append((i, item, self._admit(item, planned, starting)))
            except WorkerError as exc:
                results[i] = exc
        if accepted:
            self._compute(accepted, starting, results)
        return results

    def warm_up(self, beam: int = 0) -> None:
        """Compile before the first request (a node calls this before it reports ready); with `beam`, search
        for faster kernels first (tinygrad's BEAM; what it finds is cached on disk for the next boot)."""
        self.compute.warm_up(beam)

    def release(self, request_id: str, *, keep_as: str = "") -> None:
        """Free a request's slot, or (`keep_as`) keep its KV as the prefix-cache entry of that name, replacing
        any entry of the name; releasing an unknown request is a no-op so teardown can be repeated."""
        req = self._requests.pop(request_id, None)
        if req is not None and keep_as:
            self._kept.keep(keep_as, req.slot, req.next_position)

    @property
    def kept(self) -> dict[str, int]:
        """The prefix-cache entries held here and the positions each holds (compute thread)."""
        return self._kept.lengths()

    @property
    def kept_count(self) -> int:
        """How many prefix-cache entries hold slots here; safe to read from any thread."""
        return len(self._kept)

    @property
    def active(self) -> frozenset[str]:
        """The requests holding a slot (compute thread)."""
        return frozenset(self._requests)

    @property
    def slots_in_use(self) -> int:
        """How many slots are held; safe to read from any thread."""
        return len(self._requests)

    # -- internals ---------------------------------------------------------------------------
    def _one(self, item: StepItem):
        [out] = self.run([item])
        if isinstance(out, WorkerError):
            raise out
        return out

    def _admit(self, item: StepItem, planned: dict[str, int], starting: dict[str, _Request]) -> _Request:
        """Check one step and return its request; a step at position 0 of an unknown one starts it."""
        self._check_input(item)
        rid, position = item.request_id, item.position
        if position + item.rows > self.compute.max_context:
            raise WorkerError(f"request {rid!r}: position {position} + {item.rows} tokens exceeds the "
                              f"context of {self.compute.max_context}")
        req = self._requests.get(rid) or starting.get(rid)
        if req is None:
            if position != 0 and not (item.from_cache and item.from_cache.entry):
                raise WorkerError(f"unknown request {rid!r} (never started here, or released)")
            req = starting[rid] = self._new_request(item, starting)
        expected = planned.get(rid, req.next_position)
        if position != expected:
            raise WorkerError(f"request {rid!r}: got position {position}, expected {expected}")
        planned[rid] = position + item.rows
        return req

    def _new_request(self, item: StepItem, starting: dict[str, _Request]) -> _Request:
        """A request's slot: a free one, or its cached prefix's (taken, or copied into a free one)."""
        rng = rng_for(item.sampling)  # a bad seed fails this request alone, before any slot changes
        start = item.from_cache or FromCache()
        self._kept.forget(start.drop)
        if not start.entry:
            return _Request(self._free_slot(item, starting), 0, item.sampling, rng)
        source = self._kept.source(start.entry, item.position, item.request_id)
        if start.take:
            return _Request(self._kept.take(start.entry), item.position, item.sampling, rng)
        slot = self._free_slot(item, starting, keep=start.entry)
        self.compute.copy_rows(source, slot, item.position)
        return _Request(slot, item.position, item.sampling, rng)

    def _free_slot(self, item: StepItem, starting: dict[str, _Request], keep: str = "") -> int:
        """A slot no request or entry holds; failing that, the least recently used entry's other than `keep`
        (entries stage 0 no longer counts, such as those of a chain before a stage was replaced)."""
        taken = {r.slot for r in (*self._requests.values(), *starting.values())} | self._kept.slots()
        free = next((s for s in range(self.compute.max_seqs) if s not in taken), None)
        if free is None and (free := self._kept.evict(other_than=keep)) is None:
            raise WorkerError(f"request {item.request_id!r}: all {self.compute.max_seqs} sequence slots of stage "
                              f"{self.info.stage} are taken")
        return free

    def _compute(self, accepted: list[tuple[int, StepItem, _Request]], starting: dict[str, _Request],
                 results: list) -> None:
        segments = [Segment(req.slot, item.position, item.rows) for _, item, req in accepted]
        hidden = np.concatenate([self._input(item) for _, item, _ in accepted])
        wanted = _logit_rows([item for _, item, _ in accepted]) if self.role is Role.LAST else None
        try:
            out = (self.compute.forward_batch(hidden, segments) if wanted is None
                   else self.compute.forward_batch(hidden, segments, logit_rows=wanted[0]))
        except BaseException:
            for _, item, _ in accepted:
                self.release(item.request_id)
            raise
        self._requests.update(starting)
        offset = 0
        for n, (i, item, req) in enumerate(accepted):
            req.next_position = item.position + item.rows
            if self.role is not Role.LAST:
                results[i] = out[offset:offset + item.rows].tobytes()
            elif wanted is None:
                results[i] = out[n]
            else:
                results[i] = out[wanted[1][n]] if item.all_logits else out[wanted[1][n].stop - 1]
            offset += item.rows

    def _input(self, item: StepItem) -> np.ndarray:
        if self.role is Role.FIRST:
            return self.compute.embed(list(item.tokens))
        return np.frombuffer(item.hidden, dtype=np.float32).reshape(item.seq_len, self.info.hidden_dim)

    def _known(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise WorkerError(f"unknown request {request_id!r} (never started here, or released)")
        return req

    # -- checks ------------------------------------------------------------------------------
    def _require(self, role: Role, op: str) -> None:
        if self.role is not role:
            raise WorkerError(f"{op} is a {role.value}-stage op; this worker is stage {self.info.stage} "
                              f"of {self.info.num_stages} ({self.role.value})")

    def _check_input(self, item: StepItem) -> None:
        if self.role is Role.FIRST:
            if not item.tokens:
                raise WorkerError(f"request {item.request_id!r}: no tokens")
            self.check_tokens(list(item.tokens))
            return
        dim = self.info.hidden_dim
        if item.seq_len < 1 or len(item.hidden) != item.seq_len * dim * 4:
            raise WorkerError(f"hidden state of {len(item.hidden)} bytes does not match seq_len {item.seq_len} × "
                              f"hidden_dim {dim} × 4 bytes (float32)")

    def check_tokens(self, tokens: list[int]) -> None:
        """Raises WorkerError unless every id is one of the vocabulary's."""
        bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < self.info.vocab_size)]
        if bad:
            raise WorkerError(f"token ids out of range 0..{self.info.vocab_size - 1}: {bad[:5]}")


def _logit_rows(items: list[StepItem]) -> tuple[np.ndarray, list[slice]] | None:
    """Which of a step's rows the head runs on, where some item wants every row's logits: the step's row
    indices, and each item's slice of the head's output. None where every item wants only its last row."""
    if not any(item.all_logits for item in items):
        return None
    rows, spans, offset, taken = [], [], 0, 0
    for item in items:
        mine = range(offset, offset + item.rows) if item.all_logits else range(offset + item.rows - 1, offset + item.rows)
        rows.extend(mine)
        spans.append(slice(taken, taken + len(mine)))
        taken, offset = taken + len(mine), offset + item.rows
    return np.asarray(rows), spans
