"""OpenAI's wire format at the entry: parameters parsed or refused by name, and streamed text that never
breaks a character or shows a stop string."""
import copy
import json

import pytest

from chat_fixtures import OPENAI_TOOL_CONVERSATION, TOOL_CONVERSATION
from node.api.openai_answer import Choice, Completion
from node.api.openai_fields import ApiError
from node.api.openai_messages import MAX_ARGUMENTS_DEPTH
from node.api.openai_wire import ApiRequest, Limits, parse_request
from node.api.text_stream import TextStream
from worker.contract import Sampling, TokenLogprob

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body, chat=True):
    return parse_request(body, chat=chat, seed_if_unset=7, limits=Limits(vocab_size=100, max_n=4))


def test_a_minimal_chat_request_takes_openai_s_defaults():
    r = parse(CHAT)
    assert r == ApiRequest(chat=True, model="m", messages=({"role": "user", "content": "hi"},), max_tokens=None,
                           sampling=Sampling(temperature=1.0, top_p=1.0, seed=7))


def test_unknown_parameters_are_ignored_and_known_ones_are_read():
    r = parse({**CHAT, "user": "x", "max_completion_tokens": 9, "max_tokens": 3,
               "temperature": 0, "top_p": 0.5, "seed": 3, "stop": ["a", "bb"], "stream": True,
               "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert (r.max_tokens, r.sampling, r.stop, r.stream, r.include_usage, r.return_token_ids) == (
        9, Sampling(0.0, 0.5, 3), ("a", "bb"), True, True, True)


def test_chat_content_may_be_text_parts_and_developer_is_a_system_turn():
    r = parse({**CHAT, "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}]})
    assert r.messages == ({"role": "system", "content": "ab"},)


@pytest.mark.parametrize("prompt,want", [("hi", ("hi",)), (["hi"], ("hi",)), ([1, 2], ((1, 2),)), ([[3]], ((3,),)),
                                         (["a", [4, 5], "b"], ("a", (4, 5), "b"))])
def test_a_completion_prompt_is_text_or_token_ids_or_an_array_of_either(prompt, want):
    r = parse({"model": "m", "prompt": prompt}, chat=False)
    assert r.prompts == want and r.max_tokens == 16  # OpenAI's completions default


@pytest.mark.parametrize("body,param,code", [
    ({**CHAT, "temperature": "hot"}, "temperature", "invalid_type"),
    ({**CHAT, "temperature": 3}, "temperature", "invalid_value"),
    ({**CHAT, "top_p": 0}, "top_p", "invalid_value"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({**CHAT, "stream": "yes"}, "stream", "invalid_type"),
    ({**CHAT, "n": 5}, "n", "invalid_value"),
    ({**CHAT, "n": 0}, "n", "invalid_value"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({**CHAT, "logprobs": 1}, "logprobs", "invalid_type"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice", "invalid_value"),  # no tools to choose from
    ({**CHAT, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),  # deprecated: tools instead
    ({**CHAT, "suffix": "x"}, "suffix", "unsupported_parameter"),
    ({**CHAT, "frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
    ({**CHAT, "presence_penalty": -3}, "presence_penalty", "invalid_value"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({**CHAT, "min_p": 1.5}, "min_p", "invalid_value"),
    ({**CHAT, "top_k": -2}, "top_k", "invalid_value"),
    ({**CHAT, "min_tokens": -1}, "min_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": 3, "min_tokens": 4}, "min_tokens", "invalid_value"),
    ({**CHAT, "ignore_eos": 1}, "ignore_eos", "invalid_type"),
    ({**CHAT, "logit_bias": {"100": 1}}, "logit_bias", "invalid_value"),
    ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({**CHAT, "stop_token_ids": [1, 100]}, "stop_token_ids", "invalid_value"),
    ({**CHAT, "skip_special_tokens": "no"}, "skip_special_tokens", "invalid_type"),
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


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": "p", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "p", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "p", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": [1, 100]}, "prompt"),
    ({"model": "m", "prompt": ["a", []]}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["a"] * 257}, "prompt"),
    ({"model": "m", "prompt": "p", "response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_bad_completion_parameter_is_refused_naming_it(body, param):
    with pytest.raises(ApiError) as info:
        parse(body, chat=False)
    assert (info.value.status, info.value.param) == (400, param) and param in info.value.message


def test_vllm_s_sampling_extensions_are_read_into_the_sampling():
    r = parse({**CHAT, "temperature": 0.5, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": -100, "3": 2.5},
               "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [9, 8], "seed": 1})
    assert r.sampling == Sampling(0.5, 1.0, 1, top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                                  frequency_penalty=-0.5, logit_bias=((3, 2.5), (7, -100.0)), min_tokens=2,
                                  ignore_eos=True, stop_token_ids=(9, 8))
    assert parse({**CHAT, "top_k": -1}).sampling.top_k == 0  # vLLM's -1: every token


@pytest.mark.parametrize("body,chat,logprobs,prompt_logprobs", [
    ({**CHAT, "logprobs": True}, True, 0, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 3}, True, 3, None),
    ({**CHAT, "logprobs": False}, True, None, None),
    ({"model": "m", "prompt": "p", "logprobs": 2}, False, 2, None),
    ({"model": "m", "prompt": "p", "logprobs": 1, "echo": True, "max_tokens": 0}, False, 1, 1),
    ({"model": "m", "prompt": "p", "echo": True}, False, None, None),
])
def test_logprobs_are_asked_of_the_last_stage_only_where_the_client_asks(body, chat, logprobs, prompt_logprobs):
    r = parse(body, chat=chat)
    assert (r.logprobs, r.sampling.logprobs, r.sampling.prompt_logprobs) == (logprobs, logprobs, prompt_logprobs)


def test_the_special_token_and_stop_string_switches_are_read():
    r = parse({**CHAT, "skip_special_tokens": False, "include_stop_str_in_output": True, "n": 3})
    assert (r.skip_special_tokens, r.include_stop_str_in_output, r.n) == (False, True, 3)


def test_a_cache_salt_is_read_and_an_empty_or_huge_one_refused():
    assert (parse(CHAT).cache_salt, parse({**CHAT, "cache_salt": "tenant-7"}).cache_salt) == ("", "tenant-7")
    for salt in ("", "x" * 257):
        with pytest.raises(ApiError) as e:
            parse({**CHAT, "cache_salt": salt})
        assert e.value.param == "cache_salt"


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
    c = Completion(ApiRequest(chat=True, model="m", include_usage=True), "r1", [Choice(0, "r1-0", (1, 2, 3))],
                   lambda t: b"t%d" % t, created=5)
    [choice] = c.choices
    assert c.chunk(choice, "", [], [], first=True) == {
        "id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 5, "model": "m", "usage": None,
        "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "delta": {"content": "", "role": "assistant"}}]}
    choice.token_ids, choice.text, choice.finish_reason = [7, 8], "ok", "stop"
    assert c.chunk(choice, "", [], [], finish=True)["choices"][0] == {"index": 0, "logprobs": None,
                                                                      "finish_reason": "stop", "delta": {}}
    assert c.usage_chunk()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert c.response()["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "ok", "refusal": None}}]


def test_echo_with_logprobs_puts_the_prompt_first_and_its_first_token_has_none():
    api = ApiRequest(chat=False, model="m", prompts=("ab",), echo=True, logprobs=1)
    choice = Choice(0, "r-0", (1, 2), "ab", token_ids=[3], text="c", finish_reason="length",
                    logprobs=[TokenLogprob(3, -0.5, ((3, -0.5),))],
                    prompt_logprobs=(TokenLogprob(2, -1.25, ((4, -0.25),)),))
    c = Completion(api, "r", [choice], lambda t: {1: b"a", 2: b"b", 3: b"c", 4: b"dd"}[t], created=5)
    [out] = c.response()["choices"]
    assert out["text"] == "abc"
    assert out["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -1.25, -0.5],
                               "top_logprobs": [None, {"dd": -0.25}, {"c": -0.5}], "text_offset": [0, 1, 2]}


def test_chat_logprobs_list_each_token_with_its_bytes_and_alternatives():
    api = ApiRequest(chat=True, model="m", logprobs=1)
    choice = Choice(0, "r-0", (1,), token_ids=[3], text="é", logprobs=[TokenLogprob(3, -0.5, ((4, -0.1),))])
    c = Completion(api, "r", [choice], lambda t: {3: "é".encode(), 4: b"x"}[t], created=5)
    assert c.response()["choices"][0]["logprobs"] == {"content": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169],
         "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]}]}], "refusal": None}


def test_usage_counts_each_prompt_once_however_many_choices_it_has():
    api = ApiRequest(chat=False, model="m", prompts=("a", "b"), n=2)
    choices = [Choice(i, f"r-{i}", (1,) * (3 if i < 2 else 5), token_ids=[9] * (i + 1)) for i in range(4)]
    c = Completion(api, "r", choices, lambda t: b"", created=5)
    assert c.usage() == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18}
    assert [x["index"] for x in c.response()["choices"]] == [0, 1, 2, 3]


def test_a_stop_string_is_kept_in_the_text_when_asked():
    stream = TextStream(("wor",), include_stop=True)
    assert stream.push(b"Hello wo") + stream.push(b"rld") == "Hello wor" and stream.stopped
