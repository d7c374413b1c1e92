"""OpenAI's wire format at the entry: parameters parsed or refused by name, and streamed text that never
breaks a character or shows a stop string."""
import copy
import json

import pytest

from chat_fixtures import OPENAI_TOOL_CONVERSATION, TOOL_CONVERSATION
from node.api.openai_wire import MAX_ARGUMENTS_DEPTH, ApiError, ApiRequest, Completion, TextStream, parse_request
from worker.sampling import Sampling

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body, chat=True):
    return parse_request(body, chat=chat, seed_if_unset=7)


def test_a_minimal_chat_request_takes_openai_s_defaults():
    r = parse(CHAT)
    assert r == ApiRequest(chat=True, model="m", messages=({"role": "user", "content": "hi"},), max_tokens=None,
                           sampling=Sampling(temperature=1.0, top_p=1.0, seed=7))


def test_unknown_parameters_are_ignored_and_known_ones_are_read():
    r = parse({**CHAT, "frequency_penalty": 0.5, "user": "x", "max_completion_tokens": 9, "max_tokens": 3,
               "temperature": 0, "top_p": 0.5, "seed": 3, "stop": ["a", "bb"], "stream": True,
               "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert (r.max_tokens, r.sampling, r.stop, r.stream, r.include_usage, r.return_token_ids) == (
        9, Sampling(0.0, 0.5, 3), ("a", "bb"), True, True, True)


def test_chat_content_may_be_text_parts_and_developer_is_a_system_turn():
    r = parse({**CHAT, "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}]})
    assert r.messages == ({"role": "system", "content": "ab"},)


@pytest.mark.parametrize("prompt,want", [("hi", "hi"), (["hi"], "hi"), ([1, 2], (1, 2)), ([[3]], (3,))])
def test_a_completion_prompt_is_text_or_token_ids(prompt, want):
    r = parse({"model": "m", "prompt": prompt}, chat=False)
    assert r.prompt == want and r.max_tokens == 16  # OpenAI's completions default


@pytest.mark.parametrize("body,param,code", [
    ({**CHAT, "temperature": "hot"}, "temperature", "invalid_type"),
    ({**CHAT, "temperature": 3}, "temperature", "invalid_value"),
    ({**CHAT, "top_p": 0}, "top_p", "invalid_value"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({**CHAT, "stream": "yes"}, "stream", "invalid_type"),
    ({**CHAT, "n": 2}, "n", "invalid_value"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({**CHAT, "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"messages": CHAT["messages"]}, "model", "missing_required_parameter"),
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "invalid_value"),
])
def test_a_bad_parameter_is_refused_naming_it(body, param, code):
    with pytest.raises(ApiError) as info:
        parse(body)
    e = info.value
    assert e.status == 400 and e.body() == {"error": {"message": e.message, "type": "invalid_request_error",
                                                      "param": param, "code": code}}
    assert param.split("[")[0] in e.message


def test_tool_call_history_takes_the_shape_hugging_face_templates_expect():
    # null or absent content beside tool_calls is "", arguments' JSON text is the object it spells, a `name` stays
    assert list(parse({"model": "m", "messages": OPENAI_TOOL_CONVERSATION}).messages) == TOOL_CONVERSATION


def test_tool_call_arguments_may_nest_as_deep_as_max_arguments_depth():
    arguments = '{"a": ' * MAX_ARGUMENTS_DEPTH + "[]" + "}" * MAX_ARGUMENTS_DEPTH  # the array is one level more
    with pytest.raises(ApiError, match=f"nested deeper than {MAX_ARGUMENTS_DEPTH} levels"):
        parse({"model": "m", "messages": with_change(1, set_function(0, arguments=arguments))})
    shallower = arguments.replace("[]", "1")
    parsed = parse({"model": "m", "messages": with_change(1, set_function(0, arguments=shallower))})
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == json.loads(shallower)


def with_change(n: int, change) -> list[dict]:
    """OPENAI_TOOL_CONVERSATION with its message n changed by `change` (or put in its place, if not callable)."""
    messages = copy.deepcopy(OPENAI_TOOL_CONVERSATION)
    if callable(change):
        change(messages[n])
    else:
        messages[n:n + 1] = change
    return messages


def set_call(k: int, **fields):
    return lambda m: m["tool_calls"][k].update(fields)


def set_function(k: int, **fields):
    return lambda m: m["tool_calls"][k]["function"].update(fields)


CALLS = "messages[1].tool_calls"


@pytest.mark.parametrize("messages,param,code", [
    (with_change(1, set_function(0, name=None)), f"{CALLS}[0].function.name", "missing_required_parameter"),
    (with_change(1, set_function(0, name="")), f"{CALLS}[0].function.name", "invalid_value"),
    (with_change(1, set_function(0, name=7)), f"{CALLS}[0].function.name", "invalid_type"),
    (with_change(1, set_function(0, arguments=None)), f"{CALLS}[0].function.arguments", "missing_required_parameter"),
    (with_change(1, set_function(0, arguments={"city": "Paris"})), f"{CALLS}[0].function.arguments",
     "invalid_type"),  # OpenAI sends the JSON text
    (with_change(1, set_function(1, arguments='{"city": ')), f"{CALLS}[1].function.arguments", "invalid_value"),
    (with_change(1, set_function(0, arguments='["Paris"]')), f"{CALLS}[0].function.arguments", "invalid_value"),
    (with_change(1, set_function(0, arguments='{"t": NaN}')), f"{CALLS}[0].function.arguments", "invalid_value"),
    (with_change(1, set_function(0, arguments='{"\\ud800": 1}')), f"{CALLS}[0].function.arguments",
     "invalid_value"),
    (with_change(1, set_function(0, arguments="[" * 100_000)), f"{CALLS}[0].function.arguments", "invalid_value"),
    (with_change(1, set_call(0, function="get_weather")), f"{CALLS}[0].function", "invalid_type"),
    (with_change(1, set_call(0, type="custom")), f"{CALLS}[0].type", "invalid_value"),
    (with_change(1, set_call(0, type=None)), f"{CALLS}[0].type", "missing_required_parameter"),
    (with_change(1, set_call(0, id=None)), f"{CALLS}[0].id", "missing_required_parameter"),
    (with_change(1, set_call(1, id="call_1")), f"{CALLS}[1].id", "invalid_value"),  # two calls, one id
    (with_change(1, lambda m: m["tool_calls"].__setitem__(0, "get_weather")), f"{CALLS}[0]", "invalid_type"),
    (with_change(1, lambda m: m.update(tool_calls={})), CALLS, "invalid_type"),
    (with_change(1, lambda m: m.update(tool_calls=[])), CALLS, "invalid_value"),
    (with_change(1, lambda m: m.update(tool_calls=None)), "messages[1].content", "missing_required_parameter"),
    (with_change(0, lambda m: m.update(tool_calls=OPENAI_TOOL_CONVERSATION[1]["tool_calls"])),
     "messages[0].tool_calls", "invalid_value"),  # only an assistant calls tools
    (with_change(0, lambda m: m.update(name=["ana"])), "messages[0].name", "invalid_type"),
    (with_change(2, lambda m: m.pop("tool_call_id")), "messages[2].tool_call_id", "missing_required_parameter"),
    (with_change(2, lambda m: m.update(content=None)), "messages[2].content", "missing_required_parameter"),
    (with_change(3, lambda m: m.update(tool_call_id="call_9")), "messages[3].tool_call_id", "invalid_value"),
    (with_change(3, lambda m: m.update(tool_call_id="call_1")), "messages[3].tool_call_id", "invalid_value"),
    (with_change(1, [OPENAI_TOOL_CONVERSATION[2]]), "messages[1].tool_call_id", "invalid_value"),  # answers nothing
    (with_change(3, [{"role": "user", "content": "and?"}]), f"{CALLS}[1].id", "invalid_value"),  # call_2 unanswered
    (with_change(5, []), "messages[4].tool_calls[0].id", "invalid_value"),  # ends before call_3 is answered
])
def test_a_malformed_tool_call_history_is_refused_naming_the_field(messages, param, code):
    with pytest.raises(ApiError) as info:
        parse({"model": "m", "messages": messages})
    e = info.value
    assert (e.status, e.param, e.code) == (400, param, code) and e.message.startswith(f"{param}: ")


def test_several_completion_prompts_are_refused():
    with pytest.raises(ApiError, match="one prompt only"):
        parse({"model": "m", "prompt": ["a", "b"]}, chat=False)


def test_a_character_split_across_tokens_is_sent_whole():
    stream = TextStream()
    data = "Grüß 🙂".encode()
    pieces = [stream.push(data[i:i + 1]) for i in range(len(data))] + [stream.flush()]
    assert "".join(pieces) == "Grüß 🙂" and all("\ufffd" not in p for p in pieces)
    assert pieces[data.index("ü".encode())] == ""  # its first byte alone sends nothing


@pytest.mark.parametrize("chunks,stops,want", [
    (["Hello", " wor", "ld. Bye"], ("world",), "Hello "),
    (["ab", "c--", "-d"], ("---",), "abc"),
    (["Hello", " wo", "nderful"], ("world",), "Hello wonderful"),  # held back, then released
    (["x-", "y"], ("--", "-y"), "x"),  # the earliest stop wins
])
def test_text_stops_before_a_stop_string_even_across_tokens(chunks, stops, want):
    stream = TextStream(stops)
    out = "".join(stream.push(c.encode()) for c in chunks) + stream.flush()
    assert out == want and stream.stopped == (want != "".join(chunks))


def test_a_stream_chunk_and_the_whole_answer_have_openai_s_shape():
    c = Completion(ApiRequest(chat=True, model="m", include_usage=True), "r1", (1, 2, 3), created=5)
    assert c.chunk("", [], first=True) == {
        "id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 5, "model": "m", "usage": None,
        "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "delta": {"content": "", "role": "assistant"}}]}
    c.token_ids, c.text, c.finish_reason = [7, 8], "ok", "stop"
    assert c.chunk("", [], finish=True)["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                                          "delta": {}}
    assert c.usage_chunk()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert c.response()["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "ok", "refusal": None}}]
