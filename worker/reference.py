"""Single-process generation over the whole model: the reference a pipeline must reproduce exactly."""
from __future__ import annotations

import attrs
import numpy as np

from .contract import GREEDY, Sampling
from .models import Model
from .sampling import sample, stop_set
from .stopping import generation_done


@attrs.frozen
class Generation:
    token_ids: list[int]        # generated ids, the stop id included when one ended the generation
    logits: list[np.ndarray]    # the logits each id was sampled from


def generate_full(model: Model, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY) -> Generation:
    full = model.open_slice(range(model.total_blocks), embed=True, head=True)
    stop_ids = stop_set(model.tokenizer().stop_ids, sampling)  # what min_tokens masks is what ends it
    rng = np.random.default_rng(sampling.seed)
    out, logits, x, pos = [], [], full.embed(prompt_ids), 0
    while True:
        step = full.forward(x, pos)
        pos += len(x)
        out.append(sample(step, sampling, rng, prompt_ids=prompt_ids, output_ids=out, stop_ids=stop_ids))
        logits.append(step)
        if generation_done(out[-1], generated=len(out), max_tokens=max_tokens, next_position=pos,
                           max_context=full.max_context, stop_ids=stop_ids):
            break
        x = full.embed([out[-1]])
    return Generation(out, logits)
