"""Everything a request carries is checked at the API's edge (issue 33): every string, in any field, known or
not, is text the rest of the system can encode; every number is finite and in range; each refusal is a 400 in
OpenAI's shape naming the field. The audit's cache_salt with a lone surrogate passed these checks and wedged
stage 0's prefix cache; a 5,000-digit logit_bias key and a schema's 10**30 bound were 500s."""
import json

import pytest

from node.api.openai_fields import ApiError, parse_body
from node.api.openai_wire import Limits, parse_request

CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]'
PROMPT = '{"model": "m", "prompt": "hi"'
TOOL_TURNS = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
              '"tool_calls": [{"id": %s, "type": "function", "function": {"name": %s, "arguments": %s}}]}, '
              '{"role": "tool", "tool_call_id": %s, "content": %s, "name": %s}]}')
SCHEMA = ', "response_format": {"type": "json_schema", "json_schema": {"name": %s, "schema": %s}}}'
LONE = '"a\\ud800b"'  # JSON's escape of a lone (high) surrogate: json.loads makes a str no encoder takes


def refusal(raw: str, chat: bool = True) -> ApiError:
    """The ApiError the API's edge raises for a raw body: parse_body, then parse_request."""
    with pytest.raises(ApiError) as info:
        parse_request(parse_body(raw.encode()), chat=chat, seed_if_unset=0, limits=Limits(vocab_size=100, max_n=4))
    assert info.value.status == 400 and set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    json.dumps(info.value.body()).encode("utf-8")  # the answer itself must be sendable
    return info.value


def tool_turns(call_id='"c1"', name='"f"', arguments='"{}"', answers='"c1"', content='"ok"', who='"t"') -> str:
    return TOOL_TURNS % (call_id, name, arguments, answers, content, who)


@pytest.mark.parametrize("raw,param", [
    (CHAT + f', "cache_salt": {LONE}}}', "cache_salt"),
    (f'{{"model": {LONE}, "prompt": "hi"}}', "model"),
    (CHAT + f', "stop": [{LONE}]}}', "stop[0]"),
    (CHAT + f', "user": {LONE}}}', "user"),  # a field the server ignores is still no text
    (CHAT + f', {LONE}: 1}}', "['a\\ud800b']"),  # nor is a key
    (CHAT + f', "logit_bias": {{{LONE}: 1}}}}', "logit_bias['a\\ud800b']"),
    (CHAT + SCHEMA % (LONE, '{"type": "object"}'), "response_format.json_schema.name"),
    (CHAT + SCHEMA % ('"n"', f'{{"type": "object", "properties": {{{LONE}: {{}}}}}}'),
     "response_format.json_schema.schema.properties['a\\ud800b']"),
    (f'{{"model": "m", "messages": [{{"role": "user", "content": {LONE}}}]}}', "messages[0].content"),
    (f'{{"model": "m", "messages": [{{"role": "user", "content": "x", "name": {LONE}}}]}}', "messages[0].name"),
    (f'{{"model": "m", "messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}]}}',
     "messages[0].content[0].text"),
    (tool_turns(call_id=LONE), "messages[1].tool_calls[0].id"),
    (tool_turns(name=LONE), "messages[1].tool_calls[0].function.name"),
    (tool_turns(answers=LONE), "messages[2].tool_call_id"),
    (f'{{"model": "m", "prompt": ["ok", {LONE}]}}', "prompt[1]"),
])
def test_a_lone_surrogate_in_any_field_is_refused_naming_the_field(raw, param):
    error = refusal(raw, chat='"prompt"' not in raw)
    assert (error.param, error.code) == (param, "invalid_value") and "surrogate" in error.message


def test_a_surrogate_pair_is_a_character_and_is_taken():
    body = parse_body((CHAT + ', "cache_salt": "\\ud83d\\ude00", "stop": "\\uD83D\\uDE00"}').encode())
    api = parse_request(body, chat=True, seed_if_unset=0)
    assert api.cache_salt == api.stop[0] == "\U0001F600"


@pytest.mark.parametrize("raw,param", [
    (CHAT + ', "temperature": 1e400}', "temperature"),
    (CHAT + ', "temperature": NaN}', "temperature"),
    (CHAT + ', "top_p": -Infinity}', "top_p"),
    (CHAT + ', "frequency_penalty": 1e999}', "frequency_penalty"),
    (CHAT + ', "presence_penalty": -1e400}', "presence_penalty"),
    (CHAT + ', "repetition_penalty": Infinity}', "repetition_penalty"),
    (CHAT + ', "min_p": 1e400}', "min_p"),
    (CHAT + ', "seed": 1e400}', "seed"),
    (CHAT + ', "max_tokens": 1e400}', "max_tokens"),
    (CHAT + ', "logit_bias": {"5": 1e400}}', "logit_bias['5']"),
    (CHAT + ', "anything": [1, {"x": -1e400}]}', "anything[1].x"),
    (CHAT + SCHEMA % ('"n"', '{"type": "number", "maximum": 1e400}'), "response_format.json_schema.schema.maximum"),
])
def test_a_number_that_is_not_finite_is_refused_naming_the_field(raw, param):
    error = refusal(raw)
    assert (error.param, error.code) == (param, "invalid_value") and "finite" in error.message


BIG = "9" * 4000  # under Python's 4300-digit limit: json parses it


@pytest.mark.parametrize("raw,param", [
    (CHAT + f', "max_tokens": {BIG}}}', "max_tokens"),
    (CHAT + f', "seed": -{BIG}}}', "seed"),
    (CHAT + f', "n": {BIG}}}', "n"),
    (CHAT + f', "min_tokens": {BIG}}}', "min_tokens"),
    (CHAT + f', "logprobs": true, "top_logprobs": {BIG}}}', "top_logprobs"),
    (PROMPT + f', "logprobs": {BIG}}}', "logprobs"),
    (CHAT + f', "stop_token_ids": [{BIG}]}}', "stop_token_ids"),
    (CHAT + ', "logit_bias": {"' + "1" * 5000 + '": 1}}', "logit_bias"),  # int() of it raised past 4300 digits
    (CHAT + ', "logit_bias": {"\u0661": 1}}', "logit_bias"),  # ARABIC-INDIC ONE: a digit, but no token id
    (CHAT + SCHEMA % ('"n"', '{"type": "integer", "minimum": -%d, "maximum": %d}' % (10 ** 30, 10 ** 30)),
     "response_format"),
    (CHAT + SCHEMA % ('"n"', '{"type": "integer", "minimum": -1e300, "maximum": 1e300}'), "response_format"),
])
def test_an_integer_out_of_range_is_refused_naming_the_field(raw, param):
    error = refusal(raw, chat='"prompt"' not in raw)
    assert error.param == param and error.code in ("invalid_value", "invalid_type")
    assert len(error.message) < 400  # the value is not echoed whole


@pytest.mark.parametrize("raw", [CHAT + ', "cache_salt": "a\\u0000b", "stop": "\\u0001", "user": "\\u001b[2J"}',
                                 f'{{"model": "m", "messages": [{{"role": "user", "content": "nul \\u0000 bell \\u0007"}}]}}'])
def test_control_characters_are_text_and_are_taken(raw):
    """A decision: control characters are refused nowhere at the edge. Nothing downstream breaks on them (the
    tokenizer refuses a byte its vocabulary has no token for, node/api/openai_api.py's tokenized), and a client's
    text may hold them."""
    parse_request(parse_body(raw.encode()), chat=True, seed_if_unset=0)


def test_a_plain_body_is_not_walked(monkeypatch):
    """The walk costs in proportion to the body: only a body whose text shows a \\ud escape, or whose parser
    met a number that is not finite, is walked."""
    from node.api import openai_fields
    walked = []
    monkeypatch.setattr(openai_fields, "checked_values", walked.append)
    parse_body(json.dumps({"model": "m", "prompt": [list(range(100))] * 100, "cache_salt": "é"}).encode())
    assert walked == []
    parse_body(b'{"x": "\\ud83d\\ude00"}')
    assert len(walked) == 1
