"""Choosing the next token from logits: greedy by default, temperature and top-p on request.

Two inputs would otherwise break the arithmetic rather than the request: a temperature so small that the
logits divided by it overflow (1e-310 gives inf - inf = NaN probabilities), and a seed numpy cannot take.
Below SAMPLING_EPS sampling is greedy, as vLLM's is (vllm/sampling_params.py, _SAMPLING_EPS = 1e-5): at
such a temperature the most likely token has all the mass anyway. A seed is any integer 0..2**64 - 1
(OpenAI's `seed` is an integer; numpy's SeedSequence takes any non-negative one); another is a WorkerError
that fails its own request alone, as do logits that are not finite.
"""
from __future__ import annotations

import attrs
import numpy as np

from .errors import WorkerError

SAMPLING_EPS = 1e-5  # below this temperature, greedy
MAX_SEED = 2 ** 64 - 1


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)

_v = attrs.validators


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100), added to the logits
    min_tokens: int = attrs.field(default=0, validator=_v.ge(0))  # stop tokens are masked until this many
    ignore_eos: bool = False  # the model's stop tokens do not end the request (stop_token_ids still do)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the request
    logprobs: int | None = attrs.field(default=None, validator=_v.optional([_v.ge(0), _v.le(MAX_LOGPROBS)]))
    prompt_logprobs: int | None = attrs.field(default=None,  # echo: each prompt token's logprob, top-n beside
                                              validator=_v.optional([_v.ge(0), _v.le(MAX_LOGPROBS)]))
    grammar: str = ""  # constrained decoding: the response_format as canonical JSON (worker/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


GREEDY = Sampling()


def rng_for(sampling: Sampling) -> np.random.Generator:
    """The generator a request samples from, seeded by it; a seed outside 0..2**64 - 1 is a WorkerError."""
    seed = sampling.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise WorkerError(f"seed: {seed!r} is not an integer in 0..{MAX_SEED}")
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if not np.isfinite(probs).all():
        raise WorkerError(f"sampling at temperature {sampling.temperature}: the logits are not finite "
                          f"(min {logits.min()}, max {logits.max()})")
    order = np.argsort(-probs, kind="stable")
    # nucleus: the smallest prefix of tokens, by probability, whose mass reaches top_p
    keep = int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p) + 1)
    kept = order[:keep]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))
