"""Choosing the next token from logits, as vLLM's v1 sampler does (vllm/v1/sample/sampler.py).

The order is vLLM's. First the processors that can change even a greedy choice, on float64 logits:
the allowed mask (constrained decoding), min_tokens (the stop ids stay -inf until that many tokens are
out), logit_bias, then the penalties (repetition over prompt and output, frequency and presence over the
output; vllm/model_executor/layers/utils.py apply_penalties). Greedy is the argmax of that. Otherwise:
temperature, min_p, top_k, top_p, each cut renormalizing what is left (vLLM masks logits and softmaxes
again), then a draw from the request's rng. With every parameter at its default the arithmetic is the
plain temperature / top-p sampler's, so a seeded request draws the same stream it always has.

Two inputs would otherwise break the arithmetic rather than the request: a temperature so small that the
logits divided by it overflow (1e-310 gives inf - inf = NaN probabilities), and a seed numpy cannot take.
Below SAMPLING_EPS (worker/contract.py) sampling is greedy, as vLLM's is (vllm/sampling_params.py, _SAMPLING_EPS = 1e-5): at
such a temperature the most likely token has all the mass anyway. A seed is any integer 0..2**64 - 1
(OpenAI's `seed` is an integer; numpy's SeedSequence takes any non-negative one); another is a WorkerError
that fails its own request alone, as do logits that are not finite and logits every processor masked.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import Sampling
from .errors import WorkerError

MAX_SEED = 2 ** 64 - 1


def rng_for(sampling: Sampling) -> np.random.Generator:
    """The generator a request samples from, seeded by it; a seed outside 0..2**64 - 1 is a WorkerError."""
    seed = sampling.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise WorkerError(f"seed: {seed!r} is not an integer in 0..{MAX_SEED}")
    return np.random.default_rng(seed)


def stop_set(model_stop_ids: frozenset[int], sampling: Sampling) -> frozenset[int]:
    """The ids that end this request (and that min_tokens masks): the model's unless ignore_eos, plus
    stop_token_ids; vLLM's SamplingParams.all_stop_token_ids."""
    model = frozenset() if sampling.ignore_eos else frozenset(model_stop_ids)
    return model | frozenset(sampling.stop_token_ids)


def process_logits(logits: np.ndarray, sampling: Sampling, *, prompt_ids: Sequence[int],
                   output_ids: Sequence[int], stop_ids: frozenset[int],
                   allowed: np.ndarray | None = None) -> np.ndarray:
    """A float64 copy of `logits` with the processors that can change a greedy choice applied, in vLLM's
    order. float64 because the draw already works in it: no rounding step lies between the two, and a
    bias of 100 on a logit of 1e4 keeps its digits; one row of vocabulary size costs nothing to copy."""
    x = np.asarray(logits).astype(np.float64)
    if allowed is not None:
        if allowed.shape != x.shape:
            raise WorkerError(f"allowed mask: shape {allowed.shape}, the logits' is {x.shape}")
        x[~allowed] = -np.inf
    if len(output_ids) < sampling.min_tokens:
        x[[i for i in stop_ids if 0 <= i < x.size]] = -np.inf  # an id past the vocabulary is never drawn
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias)
        if max(ids) >= x.size:
            raise WorkerError(f"logit_bias: token id {max(ids)} is outside the vocabulary of {x.size}")
        x[list(ids)] += biases
    _penalize(x, sampling, prompt_ids, output_ids)
    return x


def _penalize(x: np.ndarray, sampling: Sampling, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
    """Repetition (CTRL's, arXiv:1909.05858: a seen token's logit moves toward less likely, divided when
    positive, multiplied when not), then OpenAI's frequency and presence penalties, in place."""
    s = sampling
    if s.repetition_penalty == 1.0 and not s.frequency_penalty and not s.presence_penalty:
        return
    counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=x.size)[:x.size]
    if s.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        seen[prompt[prompt < x.size]] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / s.repetition_penalty, x[seen] * s.repetition_penalty)
    x -= s.frequency_penalty * counts
    x -= s.presence_penalty * (counts > 0)


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator, *, prompt_ids: Sequence[int] = (),
           output_ids: Sequence[int] = (), stop_ids: frozenset[int] = frozenset(),
           allowed: np.ndarray | None = None) -> int:
    """The next token. `output_ids` are this request's tokens so far, `stop_ids` its stop_set, `allowed`
    the constrained-decoding mask of vocabulary size."""
    x = logits  # a decode step's usual case, every processor off: no copy of the row, nothing to check
    if _processed(sampling, allowed, output_ids):
        x = process_logits(logits, sampling, prompt_ids=prompt_ids, output_ids=output_ids, stop_ids=stop_ids,
                           allowed=allowed)
        if np.isneginf(x).all():
            raise WorkerError(f"no token left to sample: every logit of {x.size} is -inf after the allowed mask, "
                              f"min_tokens ({sampling.min_tokens}) and logit_bias")
    if sampling.greedy:
        return int(np.argmax(x))
    z = np.asarray(x, dtype=np.float64) / sampling.temperature
    with np.errstate(invalid="ignore"):  # inf - inf: the check below names it
        probs = np.exp(z - z.max())
        probs /= probs.sum()
    if not np.isfinite(probs).all():
        raise WorkerError(f"sampling at temperature {sampling.temperature}: the logits are not finite "
                          f"(min {x.min()}, max {x.max()})")
    kept = _candidates(probs, sampling)
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))


def _processed(sampling: Sampling, allowed: np.ndarray | None, output_ids: Sequence[int]) -> bool:
    """Whether any processor of process_logits would change the logits."""
    s = sampling
    return (allowed is not None or len(output_ids) < s.min_tokens or bool(s.logit_bias)
            or s.repetition_penalty != 1.0 or bool(s.frequency_penalty) or bool(s.presence_penalty))


def _candidates(probs: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The token ids a draw may pick, most likely first: min_p, then top_k, then the top_p nucleus."""
    order = np.argsort(-probs, kind="stable")
    if sampling.min_p:  # keep what is at least min_p times as likely as the most likely
        order = order[probs[order] >= sampling.min_p * probs[order[0]]]
    if sampling.top_k:
        order = order[:sampling.top_k]
    mass = probs[order]
    if sampling.min_p or sampling.top_k:  # top_p measures what the cuts left, as vLLM's softmax after them does
        mass = mass / mass.sum()
    # nucleus: the smallest prefix of tokens, by probability, whose mass reaches top_p
    keep = int(np.searchsorted(np.cumsum(mass), sampling.top_p) + 1)
    return order[:keep]
