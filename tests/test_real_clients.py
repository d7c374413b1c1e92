"""Slow tier: real clients against the real default model (SmolLM2-135M-Instruct) served at N = 3, as
evaluation and agent tools use it: LangChain's structured output, vLLM's ignore_eos as load tools send it,
and logprobs that one process computes alike."""
import pytest
from pydantic import BaseModel, Field

from served import serving
from worker.weights.fetch import DEFAULT_MODEL

pytestmark = pytest.mark.slow


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")


@pytest.fixture(scope="module")
def served():
    with serving(["--model", DEFAULT_MODEL, "--max-seqs", "4"], stages=3, ready_s=400) as s:
        yield s


def test_langchain_with_structured_output_returns_a_parsed_object(served):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=served.base_url, api_key=served.api_key, model=DEFAULT_MODEL, temperature=0,
                     max_tokens=64)
    person = llm.with_structured_output(Person).invoke("Alice is 30 years old. Extract the person.")
    assert person == Person(name="Alice", age=30)


def test_ignore_eos_gives_the_length_a_load_tool_asks_for(served):
    client, hello = served.client(), [{"role": "user", "content": "Say hello"}]
    plain = client.chat.completions.create(model=DEFAULT_MODEL, messages=hello, max_tokens=48, temperature=0)
    assert plain.usage.completion_tokens < 48 and plain.choices[0].finish_reason == "stop"  # the model stops early
    forced = client.chat.completions.create(model=DEFAULT_MODEL, messages=hello, max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 48 and forced.choices[0].finish_reason == "length"
    assert forced.choices[0].message.content.startswith(plain.choices[0].message.content)
