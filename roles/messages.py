"""The messages stages and the runner exchange, as plain frozen attrs types. How they are framed and parsed
on the wire (one strict cattrs converter, refusals naming the field) is node/transport/wire.py's job.

A request's life: the asker POSTs an InferenceRequest to pp-entry (stage 0), which queues it until a
sequence slot is free, then sends its prompt down the chain in Activations; the last stage samples and
feeds each Token back to stage 0; when the request ends — finished, failed or cancelled — stage 0 sends
an EndRequest down the chain so every stage frees its slot. Activations and NextTokens carry the rows of
several requests at once: one batched step's worth.

Preemption (roles/kv_budget.py): where a running request's next position does not fit the chain's KV budget,
stage 0 ends the newest request's life everywhere (EndRequest PREEMPTED) and replays it once it fits.

Replay: when a stage is replaced (or rows are lost on the way), stage 0 starts the request's next life,
its `generation`: the prompt and the tokens generated so far go down the chain again as one prefill
(RequestStart.replayed), each stage overwrites the request's slot, and rows and tokens of an earlier
generation still on their way are dropped wherever they arrive.
"""
from __future__ import annotations

import enum
import urllib.parse

import attrs

from worker.contract import GREEDY, Sampling, TokenLogprob

MAX_TOKENS_LIMIT = 1 << 16


class WireError(ValueError):
    """A message that cannot be accepted; the text names the field."""


def is_http_url(text: str) -> bool:
    """An absolute http(s) URL with a host and nothing after the path: where a response may be POSTed."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not (parts.query or parts.fragment
                                                                              or parts.username)


@attrs.frozen
class InferenceRequest:
    request_id: str
    prompt: str
    max_tokens: int = 64
    sampling: Sampling = GREEDY
    chat: bool = True
    reply_to: str | None = None  # base URL to POST the response to; None: the node that has it keeps it
    prompt_token_ids: tuple[int, ...] = ()  # already tokenized (the entry's OpenAI API); then prompt is ""
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cache entries

    def __attrs_post_init__(self):
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise WireError(f"max_tokens: {self.max_tokens} is outside 1..{MAX_TOKENS_LIMIT}")
        if not self.request_id:
            raise WireError("request_id: empty")
        if self.prompt and self.prompt_token_ids:
            raise WireError("prompt, prompt_token_ids: give one of them, not both")
        if self.reply_to is not None and not is_http_url(self.reply_to):
            raise WireError(f"reply_to: {self.reply_to[:100]!r} is not an http(s) URL")


@attrs.frozen
class CancelRequest:
    """Asker → pp-entry: stop a request, queued or running, and free its slots everywhere."""

    request_id: str


@attrs.frozen
class RequestStart:
    """What later stages need to know about a request; travels with its first segment (position 0)."""

    max_tokens: int
    sampling: Sampling
    prompt_token_ids: tuple[int, ...]
    reply_to: str | None = None
    queued_ms: float = 0.0  # waited at the entry for a free slot
    replayed: tuple[int, ...] = ()  # a replay: the tokens generated before it, prefilled after the prompt
    entry: str = ""  # the node id of the stage 0 that owns the request (a replaced entry's requests are freed)
    # The prefix cache (roles/prefix.py): the request's first `cached` positions are the KV every stage kept
    # as `cache_entry`, so its first rows start at position `cached`. With `take` the entry's slot becomes
    # the request's; else those rows are copied into a free slot. `drop`: kept entries to forget first.
    cached: int = 0
    cache_entry: str = ""
    take: bool = False
    drop: tuple[str, ...] = ()

    def __attrs_post_init__(self):
        if not self.prompt_token_ids:
            raise WireError("prompt_token_ids: empty")
        if len(self.replayed) >= self.max_tokens:
            raise WireError(f"replayed: {len(self.replayed)} tokens, no fewer than max_tokens {self.max_tokens}")
        if not 0 <= self.cached < self.prefill_len or bool(self.cached) != bool(self.cache_entry):
            raise WireError(f"cached: {self.cached} positions of entry {self.cache_entry!r}: need an entry exactly "
                            f"when cached > 0, and cached below the {self.prefill_len} prefill tokens")
        if self.take and not self.cache_entry:
            raise WireError("take: no cache_entry to take")

    @property
    def prefill_len(self) -> int:
        """Rows before the first token this life samples: the prompt, then what was generated before."""
        return len(self.prompt_token_ids) + len(self.replayed)


@attrs.frozen
class SegmentMeta:
    """One request's rows in an activation: seq_len consecutive positions from `position` on. A request's
    first segment carries its RequestStart and starts at position 0, or where its cached prefix ends."""

    request_id: str
    position: int
    seq_len: int
    stage_ms: tuple[float, ...] = ()  # compute ms of each stage so far, for these rows
    start: RequestStart | None = None  # on the request's first segment only
    generation: int = 0  # the request's life: 0, then one more per replay

    def __attrs_post_init__(self):
        if self.generation < 0:
            raise WireError(f"generation: {self.generation} is negative")
        if self.position < 0 or self.seq_len < 1:
            raise WireError(f"position {self.position} / seq_len {self.seq_len}: need position >= 0, seq_len >= 1")
        first = self.start.cached if self.start is not None else 0
        if (self.position == first) != (self.start is not None):
            raise WireError(f"start: present exactly on a request's first segment (position 0, or its cached "
                            f"positions), request {self.request_id!r} at position {self.position}")


@attrs.frozen
class ActivationMeta:
    segments: tuple[SegmentMeta, ...]

    def __attrs_post_init__(self):
        if not self.segments:
            raise WireError("segments: empty")

    @property
    def rows(self) -> int:
        return sum(s.seq_len for s in self.segments)


@attrs.frozen
class Activation:
    meta: ActivationMeta
    hidden: bytes  # float32, (rows, hidden_dim), the segments' rows in order, little-endian

    @staticmethod
    def of(segments: list[tuple[SegmentMeta, bytes]]) -> Activation:
        return Activation(ActivationMeta(tuple(s for s, _ in segments)), b"".join(h for _, h in segments))

    def split(self) -> list[tuple[SegmentMeta, bytes]]:
        """Each segment with its own rows' bytes."""
        out, offset = [], 0
        row_bytes = len(self.hidden) // self.meta.rows
        for s in self.meta.segments:
            out.append((s, self.hidden[offset:offset + s.seq_len * row_bytes]))
            offset += s.seq_len * row_bytes
        return out


@attrs.frozen
class Token:
    request_id: str
    token_id: int
    position: int  # where token_id is fed back in
    done: bool
    generation: int = 0  # of the request's rows it was sampled from
    logprob: TokenLogprob | None = None  # asked for (Sampling.logprobs): this token's, with its top alternatives
    # asked for (Sampling.prompt_logprobs), on a request's first token: the prompt's tokens from the second on
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class NextTokens:
    """Last stage → stage 0: the tokens one step sampled."""

    tokens: tuple[Token, ...]

    def __attrs_post_init__(self):
        if not self.tokens:
            raise WireError("tokens: empty")


class EndReason(enum.Enum):
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    LOST = "lost"  # a stage could not pass the request's rows on: stage 0 replays it, nothing ends
    # Stage 0 -> down the chain only, nothing ends (roles/kv_budget.py): free the request's slot, its life
    # (`generation`) is over and a later one starts it over once its KV fits; or forget the prefix-cache entry
    # named `request_id` (an entry evicted while no request starts, whose RequestStart.drop would name it)
    PREEMPTED = "preempted"
    DROPPED = "dropped"


@attrs.frozen
class EndRequest:
    """Stage 0 → down the chain: free this request's slot. Any stage → stage 0: this request failed here,
    or (LOST) the rows of its `generation` did not get past this stage. A `poison` failure is the request's
    own (computing it failed: its input, or an error of the compute itself), not the transport's: a replay
    would compute it again, so it ends the request whatever life stage 0 has started since. With `keep_as`,
    stages keep the finished request's KV as an entry of the prefix cache rather than free its slot."""

    request_id: str
    reason: EndReason
    error: str | None = None
    failed_stage: int | None = None
    generation: int = 0
    poison: bool = False
    keep_as: str = ""  # a finished request: every stage keeps its slot's KV under this name (the prefix cache)
    param: str = ""  # a failure that is the request's own value's: the parameter to name in a 400 (worker InvalidParam)


@attrs.frozen
class InferenceResponse:
    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    # compute per stage over the request: the wall time of every batched step its rows were in
    stage_compute_ms: tuple[float, ...] = ()
    decode_s: float = 0.0  # first token sampled to last, on the last stage's clock
    token_ms: tuple[float, ...] = ()  # when each token was sampled, ms after the first, on the same clock
    queued_s: float = 0.0  # waited at the entry for a free sequence slot
    error: str | None = None
    failed_stage: int | None = None
