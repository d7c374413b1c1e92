"""Slow tier: function calling on the real default model (SmolLM2-135M-Instruct, whose template has no tool
support: the generic prompt and format) served at N = 2, through the official openai client and LangChain."""
import pytest
from pydantic import BaseModel, Field

import tool_checks
from served import serving
from worker.weights.fetch import DEFAULT_MODEL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    with serving(["--model", DEFAULT_MODEL, "--max-seqs", "4"], stages=2, ready_s=400) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def test_the_named_function_is_called_with_arguments_its_schema_allows(client):
    call = tool_checks.named_call(client, DEFAULT_MODEL, temperature=0).choices[0].message.tool_calls[0]
    assert "Paris" in call.function.arguments  # not only valid: the model filled it from the question


def test_required_calls_one_of_two_tools(client):
    tool_checks.required_call(client, DEFAULT_MODEL, temperature=0)


def test_the_call_streamed_joins_into_the_whole_answer_s(client):
    streamed = tool_checks.streamed_call(client, DEFAULT_MODEL, temperature=0)
    whole = tool_checks.named_call(client, DEFAULT_MODEL, temperature=0).choices[0].message.tool_calls[0]
    assert (streamed["name"], streamed["arguments"]) == (whole.function.name, whole.function.arguments)


def test_the_tool_s_result_sent_back_gets_an_answer(client):
    tool_checks.answer_after_result(client, DEFAULT_MODEL, temperature=0)


def test_auto_and_none_are_accepted(client):
    tool_checks.auto_and_none(client, DEFAULT_MODEL, temperature=0)


def test_langchain_bind_tools_returns_a_parsed_tool_call(served):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=served.base_url, api_key=served.api_key, model=DEFAULT_MODEL, temperature=0,
                     max_tokens=96)
    message = llm.bind_tools([tool_checks.WEATHER, tool_checks.TIME], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("celsius", "fahrenheit") and call["id"]
    assert "city" in call["args"]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")


def test_langchain_structured_output_by_function_calling_returns_the_object(served):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=served.base_url, api_key=served.api_key, model=DEFAULT_MODEL, temperature=0,
                     max_tokens=64)
    person = llm.with_structured_output(Person, method="function_calling").invoke(
        "Alice is 30 years old. Extract the person.")
    assert person == Person(name="Alice", age=30)
