"""Function calling through the official openai client against `ppsmoke.py --seed -n 2 --serve` on the
built-in tiny model: its weights are random, so every valid call here is the grammar's doing. Its context is
512 bytes, room for one small tool beside the generic prompt; the full checks, two tools and LangChain run on
SmolLM2 in the slow tier (tests/test_real_clients.py)."""
import httpx
import pytest

import tool_checks
from served import serving

MODEL, TOOLS, ROOM = "tiny", tool_checks.TINY, {"max_tokens": 80}


@pytest.fixture(scope="module")
def served():
    with serving(["--max-seqs", "4"], stages=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def test_a_named_function_is_called_with_arguments_its_schema_allows(client):
    for seed in range(3):
        tool_checks.named_call(client, MODEL, TOOLS, seed=seed, **ROOM)


def test_a_streamed_call_joins_into_the_call_a_whole_answer_gives(client):
    streamed = tool_checks.streamed_call(client, MODEL, TOOLS, temperature=0, **ROOM)
    whole = tool_checks.named_call(client, MODEL, TOOLS, temperature=0, **ROOM).choices[0].message.tool_calls[0]
    assert (streamed["name"], streamed["arguments"]) == (whole.function.name, whole.function.arguments)


def test_the_tool_s_result_sent_back_gets_an_answer(client):
    tool_checks.answer_after_result(client, MODEL, TOOLS, seed=1, **ROOM)


def test_auto_and_none_are_accepted(client):
    tool_checks.auto_and_none(client, MODEL, TOOLS, seed=2)


def test_logprobs_and_several_choices_come_with_forced_calls(client):
    answer = client.chat.completions.create(model=MODEL, messages=tool_checks.ASK, tools=list(TOOLS), n=2,
                                            tool_choice="required", parallel_tool_calls=False, logprobs=True, top_logprobs=2,
                                            seed=3, **ROOM)
    for choice in answer.choices:
        [call] = choice.message.tool_calls
        assert tool_checks.valid(TOOLS[0], call.function.name, call.function.arguments)
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert answer.usage.completion_tokens == sum(len(c.logprobs.content) for c in answer.choices)


def test_the_model_card_says_how_tools_are_told_and_read(client):
    card = client.models.retrieve(MODEL).model_dump()
    assert (card["tool_call_parser"], card["tool_rendering"]) == ("generic", "generic")  # tiny's template has none


def test_a_malformed_tool_is_refused_in_openai_s_shape(served):
    r = httpx.post(served.base_url + "/chat/completions", headers={"Authorization": f"Bearer {served.api_key}"},
                   json={"model": MODEL, "messages": tool_checks.ASK,
                         "tools": [{"type": "function", "function": {"name": "no spaces"}}]})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("tools", "invalid_value")
