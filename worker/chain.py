"""Drive N stage workers in one process exactly as the nodes do over the network: prefill through
every stage, then each sampled token fed back from the last stage to the first.

One request at a time, so each op below is a batch of one through the worker's `run`, its refusal raised;
each checks first that the worker plays the role the op is for."""
from __future__ import annotations

import attrs
import numpy as np

from .contract import GREEDY, Sampling, StepItem
from .errors import WorkerError
from .partition import Role
from .stage import StageWorker
from .stopping import generation_done


@attrs.frozen
class ChainResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logits: list[np.ndarray]
    text: str


@attrs.frozen
class Sampled:
    token_id: int
    logits: np.ndarray  # (vocab,) float32, what token_id was drawn from


def run_chain(workers: list[StageWorker], prompt_ids: list[int], max_tokens: int, *,
              sampling: Sampling = GREEDY, request_id: str = "chain") -> ChainResult:
    first, middles, last = workers[0], workers[1:-1], workers[-1]
    tokens, logits, position = [], [], 0
    hidden, seq_len = embed_and_forward(first, request_id, prompt_ids, 0), len(prompt_ids)
    while True:
        for w in middles:
            hidden = forward_range(w, request_id, hidden, position, seq_len)
        step = forward_and_sample(last, request_id, hidden, position, seq_len, sampling)
        position += seq_len
        tokens.append(step.token_id)
        logits.append(step.logits)
        if generation_done(step.token_id, generated=len(tokens), max_tokens=max_tokens, next_position=position,
                           max_context=last.info.max_context, stop_ids=last.info.stop_ids):
            break
        hidden, seq_len = decode_step(first, request_id, step.token_id, position), 1
    for w in workers:
        w.release(request_id)
    return ChainResult(list(prompt_ids), tokens, logits, last.vocabulary.detokenize(tokens))


def embed_and_forward(worker: StageWorker, request_id: str, tokens: list[int], position: int = 0) -> bytes:
    """Prefill on the first stage: embed `tokens` at `position` and run its blocks."""
    worker.info.require(Role.FIRST, "embed_and_forward")
    if not tokens:
        raise WorkerError("embed_and_forward: no tokens")
    return one(worker, StepItem(request_id, position, tokens=tuple(tokens)))


def decode_step(worker: StageWorker, request_id: str, token_id: int, position: int) -> bytes:
    """Decode on the first stage: embed the token fed back by the last stage at `position` and run the blocks."""
    worker.info.require(Role.FIRST, "decode_step")
    return one(worker, StepItem(request_id, position, tokens=(token_id,)))


def forward_range(worker: StageWorker, request_id: str, hidden: bytes, position: int, seq_len: int) -> bytes:
    """A middle stage's blocks over `seq_len` rows of hidden state."""
    worker.info.require(Role.MIDDLE, "forward_range")
    return one(worker, StepItem(request_id, position, hidden=hidden, seq_len=seq_len))


def forward_and_sample(worker: StageWorker, request_id: str, hidden: bytes, position: int, seq_len: int,
                       sampling: Sampling | None = None) -> Sampled:
    """The last stage's blocks, final norm and head, then a sample from the last position's logits.
    `sampling` is taken when the request starts (position 0) and kept for its later steps."""
    worker.info.require(Role.LAST, "forward_and_sample")
    logits = one(worker, StepItem(request_id, position, hidden=hidden, seq_len=seq_len, sampling=sampling or GREEDY))
    return Sampled(worker.sample(request_id, logits), logits)


def one(worker: StageWorker, item: StepItem):
    """A batch of one: the item's result, or the WorkerError refusing it, raised."""
    [out] = worker.run([item])
    if isinstance(out, WorkerError):
        raise out
    return out
