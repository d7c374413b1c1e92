"""Drive N stage workers in one process exactly as the nodes do over the network: prefill through
every stage, then each sampled token fed back from the last stage to the first."""
from __future__ import annotations

import attrs
import numpy as np

from .sampling import GREEDY, Sampling
from .stage import StageWorker
from .stopping import generation_done


@attrs.frozen
class ChainResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logits: list[np.ndarray]
    text: str


def run_chain(workers: list[StageWorker], prompt_ids: list[int], max_tokens: int, *,
              sampling: Sampling = GREEDY, request_id: str = "chain") -> ChainResult:
    first, middles, last = workers[0], workers[1:-1], workers[-1]
    tokens, logits, position = [], [], 0
    hidden, seq_len = first.embed_and_forward(request_id, prompt_ids, 0), len(prompt_ids)
    while True:
        for w in middles:
            hidden = w.forward_range(request_id, hidden, position, seq_len)
        step = last.forward_and_sample(request_id, hidden, position, seq_len, sampling)
        position += seq_len
        tokens.append(step.token_id)
        logits.append(step.logits)
        if generation_done(step.token_id, generated=len(tokens), max_tokens=max_tokens, next_position=position,
                           max_context=last.info.max_context, stop_ids=last.info.stop_ids):
            break
        hidden, seq_len = first.decode_step(request_id, step.token_id, position), 1
    for w in workers:
        w.release(request_id)
    return ChainResult(list(prompt_ids), tokens, logits, last.detokenize(tokens))
