"""Choosing the next token from logits: greedy by default, temperature and top-p on request."""
from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class Sampling:
    temperature: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))  # 0 = greedy argmax
    top_p: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    seed: int = 0  # with temperature > 0, the same seed gives the same tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    # nucleus: the smallest prefix of tokens, by probability, whose mass reaches top_p
    keep = int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p) + 1)
    kept = order[:keep]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))
