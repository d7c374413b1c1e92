"""Stage actors, one role per file: what a stage does with each message. No I/O here: an actor admits
messages and plans batched steps (in the event loop), runs a step with the worker (on the compute
thread), and turns its results into messages to send; the node does the sending."""
from __future__ import annotations

from worker.partition import Role

from .first import FirstActor
from .last import LastActor
from .middle import MiddleActor

DEFAULT_MAX_QUEUE = 64


def make_actor(worker, *, capacity: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE, node_id: str = "",
               prompt_rows: int | None = None, prefix_cache: bool = True):
    """The actor for the role of the worker's shard, sized by the worker. `capacity`: requests stage 0 lets hold
    slots at once (default: its own max_seqs; a node passes the smallest of the chain); `node_id`: stage 0 names
    itself so in its requests (RequestStart.entry); `prompt_rows`: the chunked prefill size (roles/schedule.py);
    `prefix_cache`: stage 0 keeps finished requests' KV for later ones to start from (roles/prefix.py)."""
    info, vocabulary = worker.info, worker.vocabulary
    if info.shard.role is Role.FIRST:
        return FirstActor(info.shard, tokenize=lambda prompt, chat: vocabulary.tokenize(prompt, chat=chat),
                          max_context=info.max_context, max_rows=info.max_batch,
                          capacity=capacity or info.max_seqs, max_queue=max_queue, entry=node_id,
                          check_tokens=vocabulary.check_tokens, prompt_rows=prompt_rows, prefix_cache=prefix_cache)
    if info.shard.role is Role.MIDDLE:
        return MiddleActor(info.shard, max_rows=info.max_batch, prompt_rows=prompt_rows)
    return LastActor(info.shard, max_rows=info.max_batch, prompt_rows=prompt_rows, detokenize=vocabulary.detokenize,
                     stop_ids=info.stop_ids, max_context=info.max_context)
