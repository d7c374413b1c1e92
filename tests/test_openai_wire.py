"""OpenAI's wire format at the entry: parameters parsed or refused by name, and streamed text that never
breaks a character or shows a stop string."""
import pytest

from node.api.openai_wire import ApiError, ApiRequest, Completion, TextStream, parse_request
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
