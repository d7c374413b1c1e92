"""What a stage's worker and its callers share, and nothing more: the values that cross it (a request's
Sampling, a step's StepItem, a token's TokenLogprob, the worker's WorkerInfo) and the batched ops the actors
call (`Worker`). Light on purpose: no backend and no numpy here, so the wire types (roles/messages.py) and the
actors import this and none of the worker's internals. worker/stage.py's StageWorker is the one `Worker`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from .errors import WorkerError
from .partition import Role, Shard

if TYPE_CHECKING:
    import numpy as np

    from .grammar import Matcher

SAMPLING_EPS = 1e-5  # below this temperature, greedy (worker/sampling.py says why)
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)
MAX_LOGIT_BIAS = 100.0  # OpenAI's logit_bias range is -100..100

_v = attrs.validators


def _check_logit_bias(_, attribute, value) -> None:
    ids = [token for token, _ in value]
    for token, bias in value:
        if not (isinstance(token, int) and token >= 0 and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias: ({token!r}, {bias!r}) is not a token id >= 0 with a bias in "
                             f"-{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}")
    if len(set(ids)) != len(ids):  # OpenAI's logit_bias is a map: one bias per token
        raise ValueError(f"logit_bias: a token id appears more than once in {ids}")


_token_ids = _v.deep_iterable(member_validator=[_v.instance_of(int), _v.ge(0)])


@attrs.frozen
class Sampling:
    """How the last stage picks a request's tokens, and what it reports about them; vLLM's SamplingParams,
    travelling in RequestStart. Every field's default leaves the sampler as plain greedy / temperature / top-p."""

    temperature: float = attrs.field(default=0.0, validator=_v.ge(0.0))  # 0 = greedy argmax
    top_p: float = attrs.field(default=1.0, validator=[_v.gt(0.0), _v.le(1.0)])
    seed: int = 0  # with temperature > 0, the same seed gives the same tokens
    top_k: int = attrs.field(default=0, validator=_v.ge(0))  # 0: off (the API's -1 becomes 0)
    min_p: float = attrs.field(default=0.0, validator=[_v.ge(0.0), _v.le(1.0)])
    repetition_penalty: float = attrs.field(default=1.0, validator=_v.gt(0.0))  # prompt and output tokens
    presence_penalty: float = attrs.field(default=0.0, validator=[_v.ge(-2.0), _v.le(2.0)])  # output tokens
    frequency_penalty: float = attrs.field(default=0.0, validator=[_v.ge(-2.0), _v.le(2.0)])  # output tokens
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(  # (token id, bias in -100..100), added to the logits
        default=(), validator=_check_logit_bias)
    min_tokens: int = attrs.field(default=0, validator=_v.ge(0))  # stop tokens are masked until this many
    ignore_eos: bool = False  # the model's stop tokens do not end the request (stop_token_ids still do)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), validator=_token_ids)  # more tokens that end it
    logprobs: int | None = attrs.field(default=None, validator=_v.optional([_v.ge(0), _v.le(MAX_LOGPROBS)]))
    prompt_logprobs: int | None = attrs.field(default=None,  # echo: each prompt token's logprob, top-n beside
                                              validator=_v.optional([_v.ge(0), _v.le(MAX_LOGPROBS)]))
    grammar: str = ""  # constrained decoding: the response_format as canonical JSON (worker/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


GREEDY = Sampling()


@attrs.frozen
class TokenLogprob:
    """One position: the token there, its logprob, and the `top` most likely tokens with theirs
    (worker/logprobs.py computes them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    logits: bool = True  # last stage: the last row's logits are wanted (False: a prompt chunk before the last)
    from_cache: FromCache | None = None  # on a request's first step: where its slot comes from (prefix cache)

    @property
    def rows(self) -> int:
        return len(self.tokens) if self.tokens else self.seq_len


@attrs.frozen
class Kernels:
    """What a stage's steps compute with (/health, /metrics, gossip, the runner's stats line; issue 53)."""

    name: str  # "c": pp's hand-written CPU kernels; "tinygrad": tinygrad's own; "stub": the stand-in model
    device: str = ""  # tinygrad's device: CPU, CUDA, ...
    target: str | None = None  # on the CPU: the CPU pp's kernels are (or were to be) built for: native or PP_CPU_TARGET's
    threads: int = 1  # cores a step computes on
    fallback: str | None = None  # why pp's kernels are not in use where they would be: the cause; the fix

    @property
    def label(self) -> str:
        """Short, for a stats line and gossip: c/native, c/x86-64-v2, tinygrad/CUDA, tinygrad/CPU (fallback)."""
        if self.name == "c":
            return f"c/{self.target}"
        if self.name == "tinygrad":
            return f"tinygrad/{self.device}" + (" (fallback)" if self.fallback else "")
        return self.name


@attrs.frozen
class WorkerInfo:
    """What a ready worker reports about itself: its place in the chain (`shard`, sized) and its model's figures."""

    shard: Shard
    hidden_dim: int
    vocab_size: int
    max_context: int
    stop_ids: frozenset[int]
    weight_bytes: int
    kv_bytes: int = 0
    max_seqs: int = 1
    max_batch: int = 1
    kernels: Kernels = Kernels("stub")

    def require(self, role: Role, op: str) -> None:
        """Raises WorkerError unless this worker plays `role`: `op` is that role's alone."""
        if self.shard.role is not role:
            raise WorkerError(f"{op} is a {role.value}-stage op; this worker is stage {self.shard.index} "
                              f"of {self.shard.count} ({self.shard.role.value})")


class Worker(Protocol):
    """The batched ops a stage's actor (roles/) and its node call, on the compute thread unless said."""

    @property
    def info(self) -> WorkerInfo: ...

    def run(self, items: list[StepItem]) -> list[bytes | np.ndarray | WorkerError]:
        """Each item's hidden bytes (first and middle stages) or logits (the last), or the error refusing it."""

    def release(self, request_id: str, *, keep_as: str = "") -> None:
        """Free a request's slot, or keep its KV as the prefix-cache entry `keep_as`."""

    def restart(self, request_id: str) -> None:
        """The request's next item begins a new life (a replay), in the slot it holds."""

    def forget(self, entries: Sequence[str]) -> None:
        """Give up the KV of these prefix-cache entries (unknown ones are no-ops)."""

    def sample(self, request_id: str, logits: np.ndarray, *, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = (), stop_ids: frozenset[int] | None = None,
               allowed: np.ndarray | None = None) -> int:
        """The last stage: a request's next token, with the sampling it started with."""

    def grammar_matcher(self, grammar: str) -> Matcher:
        """The last stage: a request's constrained decoding, fresh at its first token."""

    def warm_up(self, beam: int = 0, *, lazy: bool = False, prompt_rows: int | None = None) -> dict[int, float]: ...
    def warm_more(self) -> tuple[int, float] | None: ...
    @property
    def wants_capture(self) -> bool: ...

    @property
    def kept(self) -> dict[str, int]:
        """The prefix-cache entries held and the positions each holds."""

    @property
    def kept_count(self) -> int:
        """How many prefix-cache entries hold slots; any thread."""

    @property
    def active(self) -> frozenset[str]:
        """The requests holding a slot."""

    @property
    def prefix_rows(self) -> dict[str, int]:
        """Positions of prefix-cache entries that starts shared (mapped, not copied) or copied; any thread."""

    @property
    def kv_positions(self) -> tuple[int, int]:
        """KV positions held by requests and by prefix-cache entries; any thread."""

    @property
    def slots_in_use(self) -> int:
        """How many slots requests hold; any thread."""
