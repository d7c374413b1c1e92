"""OpenAI's wire format at pp-entry, requests: parsing `/v1/chat/completions` and `/v1/completions` bodies
into an ApiRequest. The answers' shapes are node/api/openai_answer.py's.

Unknown parameters are ignored, as OpenAI's server does; a known parameter of the wrong type or out of
range is refused with 400 naming it, and so is one we cannot honour (`suffix`, `best_of` > 1):
nothing known is silently dropped. vLLM's extensions are read as vLLM spells them (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, return_token_ids, cache_salt); README's table lists them all.

Errors are node/api/openai_fields.py's ApiError; chat messages, tool-call history included, are
node/api/openai_messages.py's to parse, and tools node/api/openai_tools.py's.

Work per request is bounded before it reaches the event loop's hot paths: at most MAX_STOPS stop strings of
at most MAX_STOP_CHARS characters each, at most MAX_PROMPTS prompts and MAX_PROMPTS choices (n × prompts), `n`
at most the slots a stage has, and a conversation's turns and characters as Limits says
(node/api/openai_messages.py). A response_format's schema is compiled here (worker/grammar.py): parse
requests in a worker thread.
"""
from __future__ import annotations

import math

import attrs

from worker.contract import MAX_LOGPROBS, Sampling
from worker.grammar import GrammarError, canonical_format
from worker.sampling import MAX_SEED
from worker.tool_formats import GENERIC

from node.api.openai_fields import ApiError, checked_text, field, shown
from node.api.openai_messages import MAX_MESSAGES, MessageBudget, messages
from node.api.openai_tools import ToolRequest, tool_request

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # per stop string; a longer one is refused (OpenAI states no limit; vLLM has none)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 256  # prompts, and choices (n × prompts), in one request (each choice is a request of the engine's)
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 256


@attrs.frozen
class Limits:
    """What a request is checked against: the model's vocabulary, and the choices one request may ask for."""

    vocab_size: int | None = None  # None: token ids are left to the actor's check
    max_n: int = 8  # the slots of a stage: every choice of a request decodes at once
    messages: MessageBudget = MessageBudget()  # a conversation's turns and template characters
    tool_family: str = GENERIC  # the format a forced call is written in (worker/tool_formats.py)


def limits_for(*, vocab_size: int, max_seqs: int, max_context: int, longest_token_bytes: int,
               tool_family: str = GENERIC) -> Limits:
    """A model's limits: every turn of a conversation is at least a token of the context (its role's header, in
    any template we know), and its text at most the context's tokens of the longest token's characters each."""
    budget = MessageBudget(max_messages=min(MAX_MESSAGES, max_context), max_chars=max_context * longest_token_bytes)
    return Limits(vocab_size=vocab_size, max_n=max_seqs, messages=budget, tool_family=tool_family)


@attrs.frozen
class ApiRequest:
    """One parsed request: chat `messages`, or completion `prompts` (each text or token ids)."""

    chat: bool
    model: str
    messages: tuple[dict, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    n: int = 1  # choices per prompt
    max_tokens: int | None = None  # None: up to the end of the context; 0: the prompt's logprobs only (echo)
    sampling: Sampling = Sampling()  # its seed is the first choice's; choice j of a prompt draws from seed + j
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False  # completions: the prompt is part of the text (and of the logprobs, where asked)
    logprobs: int | None = None  # each token's logprob and this many alternatives; None: no logprobs
    skip_special_tokens: bool = True  # control tokens are left out of the text
    include_stop_str_in_output: bool = False
    cache_salt: str = ""  # vLLM's: the prefix cache is shared only among requests with the same salt
    tools: ToolRequest | None = None  # chat: the functions the model may call, and how it may


def parse_request(body, *, chat: bool, seed_if_unset: int, limits: Limits = Limits()) -> ApiRequest:
    """Parse and check a request body; raises ApiError naming the parameter. `seed_if_unset` seeds the
    sampler when the client sets no seed (OpenAI does not promise determinism without one)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = field(body, "model", str, required=True)
    _refuse_unsupported(body)
    n = field(body, "n", int, default=1)
    if not 1 <= n <= limits.max_n:
        raise ApiError(400, f"n: {n} is outside 1..{limits.max_n} (the sequences a stage decodes at once)",
                       param="n", code="invalid_value")
    stream = bool(field(body, "stream", bool, default=False))
    include_usage = _include_usage(body, stream)
    echo = not chat and bool(field(body, "echo", bool, default=False))
    logprobs = _logprobs(body, chat)
    max_tokens = _max_tokens(body, chat, echo)
    sampling = _sampling(body, seed_if_unset, limits.vocab_size)
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens: {sampling.min_tokens} is more than max_tokens {max_tokens}",
                       param="min_tokens", code="invalid_value")
    tools = tool_request(body, chat=chat)
    sampling = attrs.evolve(sampling, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                            grammar=_grammar(body, tools, limits.tool_family))
    request = ApiRequest(chat=chat, model=model, n=n, max_tokens=max_tokens, sampling=sampling, stop=_stop(body),
                         stream=stream, include_usage=include_usage, echo=echo, logprobs=logprobs,
                         return_token_ids=bool(field(body, "return_token_ids", bool, default=False)),
                         skip_special_tokens=bool(field(body, "skip_special_tokens", bool, default=True)),
                         include_stop_str_in_output=bool(field(body, "include_stop_str_in_output", bool,
                                                              default=False)),
                         cache_salt=_cache_salt(body), tools=tools)
    if chat:
        return attrs.evolve(request, messages=messages(body, limits.messages))
    prompts = _prompts(body, limits.vocab_size)
    if len(prompts) * n > MAX_PROMPTS:
        raise ApiError(400, f"n: {n} choices for each of {len(prompts)} prompts, more than the {MAX_PROMPTS} choices "
                            f"a request may have", param="n", code="invalid_value")
    return attrs.evolve(request, prompts=prompts)


def _cache_salt(body: dict) -> str:
    salt = field(body, "cache_salt", str, default=None)
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt: {len(salt)} characters, outside 1..{MAX_CACHE_SALT_CHARS}",
                       param="cache_salt", code="invalid_value")
    return checked_text(salt or "", "cache_salt")  # the prefix cache hashes its UTF-8


def _refuse_unsupported(body: dict) -> None:
    unsupported = {"suffix": (None, ""), "best_of": (None, 1), "prompt_logprobs": (None,)}
    for key, harmless in unsupported.items():
        if key in body and body[key] not in harmless:
            raise ApiError(400, f"{key}: not supported by this server", param=key, code="unsupported_parameter")


def _include_usage(body: dict, stream: bool) -> bool:
    options = field(body, "stream_options", dict, default=None)
    if options is None:
        return False
    if not stream:  # OpenAI's answer too: the options of a stream that is not one
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options",
                       code="invalid_value")
    return bool(field(options, "include_usage", bool, default=False, name="stream_options.include_usage"))


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token, or None for no logprobs: completions' `logprobs` is that number, chat's is a
    switch with `top_logprobs` beside it."""
    if not chat:
        return _ranged_int(body, "logprobs", 0, MAX_LOGPROBS)
    top = _ranged_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not field(body, "logprobs", bool, default=False):
        if top is not None:
            raise ApiError(400, "top_logprobs: needs logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        return None
    return top or 0


def _ranged_int(body: dict, key: str, lo: int, hi: int, default: int | None = None) -> int | None:
    value = field(body, key, int, default=default)
    if value is not None and not lo <= value <= hi:
        raise ApiError(400, f"{key}: {value} is outside {lo}..{hi}", param=key, code="invalid_value")
    return value


def _max_tokens(body: dict, chat: bool, echo: bool) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = field(body, name, int, default=None)
    if value is None:
        return None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if value < (0 if echo else 1):
        raise ApiError(400, f"{name}: {value} is less than {0 if echo else 1}" + ("" if echo else
                            " (0 is for echo: the prompt's logprobs alone)"), param=name, code="invalid_value")
    return value


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = float(field(body, key, float, default=default))
    inside = (lo < value if open_lo else lo <= value) and value <= hi  # NaN is outside every range
    if not (inside and math.isfinite(value)):
        raise ApiError(400, f"{key}: {value} is outside {'(' if open_lo else '['}{lo:g}, {hi:g}]", param=key,
                       code="invalid_value")
    return value


def _sampling(body: dict, seed_if_unset: int, vocab_size: int | None) -> Sampling:
    seed = field(body, "seed", int, default=seed_if_unset)
    if not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"seed: {seed} is outside 0..{MAX_SEED}", param="seed", code="invalid_value")
    top_k = field(body, "top_k", int, default=0)
    if top_k < -1:
        raise ApiError(400, f"top_k: {top_k} is less than -1 (-1 or 0: every token)", param="top_k",
                       code="invalid_value")
    return Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True), seed=seed, top_k=max(top_k, 0),
                    min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                    repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, open_lo=True),
                    presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                    logit_bias=_logit_bias(body, vocab_size),
                    min_tokens=_ranged_int(body, "min_tokens", 0, MAX_SEED, default=0),
                    ignore_eos=bool(field(body, "ignore_eos", bool, default=False)),
                    stop_token_ids=_stop_token_ids(body, vocab_size))


def _token_id(value, name: str, vocab_size: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (vocab_size and value >= vocab_size):
        top = f"0..{vocab_size - 1}" if vocab_size else "a non-negative integer"
        raise ApiError(400, f"{name}: {shown(value)} is not a token id ({top})", param=name.split("[")[0],
                       code="invalid_value")
    return value


def _key_id(key: str):
    """A logit_bias key as the id its ASCII digits spell, or the key itself (no id) to refuse: no more digits
    than an id could have, as int() past 4300 raises, and isdecimal() takes other scripts' digits too."""
    return int(key) if key.isascii() and key.isdecimal() and len(key) <= len(str(MAX_SEED)) else key


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a JSON string) to a bias in -100..100, added to that token's logit."""
    bias = field(body, "logit_bias", dict, default={})
    out = []
    for key, value in bias.items():
        where = f"logit_bias[{shown(key)}]"
        token = _token_id(_key_id(key), where, vocab_size)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"{where}: {shown(value)} is not a number in -100..100", param="logit_bias",
                           code="invalid_value")
        out.append((token, float(value)))
    return tuple(sorted(out))


def _stop_token_ids(body: dict, vocab_size: int | None) -> tuple[int, ...]:
    ids = field(body, "stop_token_ids", list, default=[])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids: {len(ids)} ids, more than {MAX_STOP_TOKEN_IDS}",
                       param="stop_token_ids", code="invalid_value")
    return tuple(_token_id(t, f"stop_token_ids[{i}]", vocab_size) for i, t in enumerate(ids))


def _grammar(body: dict, tools: ToolRequest | None, family: str) -> str:
    """What constrains the answer: a forced tool call, or the response_format (not both: a call is not the
    response_format's document, and under auto the model must be free to write either)."""
    response_format = _response_format(body)
    if tools is not None and tools.parsed and response_format:
        raise ApiError(400, "response_format: with tools, only tool_choice none leaves the answer to the "
                            "response_format", param="response_format", code="invalid_value")
    return tools.grammar(family) if tools is not None and tools.forced else response_format


def _response_format(body: dict) -> str:
    """Constrained decoding's grammar (worker/grammar.py), as the canonical text the last stage compiles;
    "" for plain text."""
    fmt = field(body, "response_format", dict, default=None)
    if fmt is None:
        return ""
    try:
        return canonical_format(fmt)
    except GrammarError as exc:  # its message names the part: response_format.json_schema.schema: ...
        raise ApiError(400, str(exc), param="response_format", code="invalid_value") from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = field(body, "stop", (str, list), default=())
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: a string or up to {MAX_STOPS} non-empty strings", param="stop",
                       code="invalid_value")
    for s in stops:
        checked_text(s, "stop")
    if (longest := max(map(len, stops), default=0)) > MAX_STOP_CHARS:
        raise ApiError(400, f"stop: {longest} characters, more than the {MAX_STOP_CHARS} a stop string may have",
                       param="stop", code="invalid_value")
    return stops


def _text(prompt: str, param: str) -> str:
    """A prompt's text; an empty one is refused (vLLM's answer too): the actor would read no tokens as no prompt."""
    if not prompt:
        raise ApiError(400, f"{param} is empty: a completion continues at least one token", param="prompt",
                       code="invalid_value")
    return checked_text(prompt, param)


def _prompts(body: dict, vocab_size: int | None) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four forms: a string, an array of token ids, or an array of either."""
    prompt = field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, str):
        return (_text(prompt, "prompt"),)
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return (_ids(prompt, "prompt", vocab_size),)
    if not prompt or len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: {len(prompt)} prompts; give 1..{MAX_PROMPTS}", param="prompt",
                       code="invalid_value")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(_text(p, f"prompt[{i}]"))
        elif isinstance(p, list) and p:
            out.append(_ids(p, f"prompt[{i}]", vocab_size))
        else:
            raise ApiError(400, f"prompt[{i}]: expected a string or a non-empty array of token ids", param="prompt",
                           code="invalid_value")
    return tuple(out)


def _ids(ids: list, name: str, vocab_size: int | None) -> tuple[int, ...]:
    return tuple(_token_id(t, f"{name}[{i}]", vocab_size) for i, t in enumerate(ids))
