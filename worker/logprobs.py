"""Log-probabilities of tokens, as the OpenAI API reports them (`logprobs`, `top_logprobs`, and with `echo`
the prompt's own tokens): the log-softmax of the model's logits, in float32, from the same logits the
last stage samples from and before any sampling parameter changes them (vLLM's default, raw logprobs).

The last stage computes them and sends only what was asked: a token's logprob and its `top` alternatives,
so the wire carries per requested token, never a vocabulary's worth of floats.
"""
from __future__ import annotations

import numpy as np

from .contract import TokenLogprob

FLOOR = -9999.0  # a logprob of -inf (a logit of -inf) is reported as this: JSON has no infinity


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of logits (..., vocab) → log-probabilities, float32, stable for large logits."""
    z = np.asarray(logits, dtype=np.float32)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, token_ids, top_n: int) -> list[TokenLogprob]:
    """For each row of `logits` (rows, vocab), the logprob of that row's token in `token_ids` and the
    `top_n` likeliest tokens (ties broken by the lower id, as a stable sort would)."""
    lp = log_softmax(np.atleast_2d(logits))
    out = []
    for row, token in zip(lp, token_ids):
        top = ()
        if top_n > 0:
            top = tuple((i, _finite(row[i])) for i in _top(row, top_n))
        out.append(TokenLogprob(int(token), _finite(row[int(token)]), top))
    return out


def _top(row: np.ndarray, n: int) -> list[int]:
    """The ids of the n largest values, largest first, the lower id first among equals: a partition finds
    the n-th largest value, and only the values at or above it are sorted."""
    if n >= len(row):
        return sorted(range(len(row)), key=lambda i: (-row[i], i))
    cut = row[np.argpartition(-row, n - 1)[n - 1]]
    candidates = np.flatnonzero(row >= cut)
    return sorted(candidates.tolist(), key=lambda i: (-row[i], i))[:n]


def _finite(value) -> float:
    return max(float(value), FLOOR)
