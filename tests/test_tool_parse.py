"""Model output read back into tool calls (node/api/tool_parse.py), on outputs written as each family's models
write them (Qwen2.5 and Hermes 3 for hermes, Llama 3.2 for llama3_json, Mistral 7B Instruct v0.3 for mistral:
written after their templates and vLLM's parsers, as none of those models is here; SmolLM2 through our prompt
for generic, some of them its own answers recorded): every case gives the same answer whole, one character at a time,
and cut at random; content is released at once but for what may begin a call."""
import json
import random

import pytest

from node.api.tool_parse import Call, Content, ToolParser, parse_whole
from worker.tool_formats import GENERIC, HERMES, LLAMA3_JSON, MISTRAL

NAMES = ("get_weather", "get_time")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
LONDON = '{"name": "get_weather", "arguments": {"city": "London"}}'
QWEN_PARIS = f"<tool_call>\n{PARIS}\n</tool_call>"
QWEN_LONDON = f"<tool_call>\n{LONDON}\n</tool_call>"
SMOL_CALL = ('<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "sky": '
             '"cloudy"}}]\n</tool_call>')
LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'


def call(index, name="get_weather", **arguments):
    return Call(index, name, json.dumps(arguments, ensure_ascii=False))


PARIS_CALL, LONDON_CALL = call(0, city="Paris", unit="celsius"), call(1, city="London")


def verbatim(text):
    """A case whose output is all content, exactly as written."""
    return text, text, []


# (case id, family, output, content, calls, parallel)
CASES = [
    # hermes: Qwen2.5 and Hermes 3
    ("hermes-single-call", HERMES, QWEN_PARIS, "", [PARIS_CALL], True),
    ("hermes-two-calls", HERMES, f"{QWEN_PARIS}\n{QWEN_LONDON}", "", [PARIS_CALL, LONDON_CALL], True),
    ("hermes-text-before-a-call-stays-content", HERMES,
     f"I'll check the weather in Paris for you.\n{QWEN_PARIS}", "I'll check the weather in Paris for you.\n",
     [PARIS_CALL], True),
    ("hermes-text-after-a-call-stays-content", HERMES, f"{QWEN_PARIS}\nAnything else?", "\nAnything else?",
     [PARIS_CALL], True),
    ("hermes-text-between-calls-stays-content", HERMES, f"{QWEN_PARIS}\nAnd London:\n{QWEN_LONDON}\n",
     "\nAnd London:\n", [PARIS_CALL, LONDON_CALL], True),
    ("hermes-plain-text", HERMES, *verbatim("The capital of France is Paris.\n\nIt has 2.1 million people."), True),
    ("hermes-3-writes-arguments-first", HERMES,
     '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', "",
     [call(0, city="Paris")], True),
    ("hermes-arguments-as-a-json-string", HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "",
     [call(0, city="Paris")], True),
    ("hermes-unicode-arguments-unescaped", HERMES,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", "note": "北京"}}</tool_call>', "",
     [call(0, city="Zürich", note="北京")], True),
    ("hermes-unclosed-but-whole-call-counts-at-the-end", HERMES, f"<tool_call>\n{PARIS}\n", "", [PARIS_CALL], True),
    ("hermes-broken-json-is-content", HERMES,
     *verbatim('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'), True),
    ("hermes-cut-off-call-is-content", HERMES,
     *verbatim('Let me look.\n<tool_call>\n{"name": "get_weather", "argu'), True),
    ("hermes-cut-off-in-the-closing-tag-is-content", HERMES, *verbatim(f"<tool_call>\n{PARIS}\n</tool_"), True),
    ("hermes-unknown-function-is-content", HERMES,
     *verbatim('<tool_call>\n{"name": "get_stock_price", "arguments": {"ticker": "AAPL"}}\n</tool_call>'), True),
    ("hermes-arguments-not-an-object-is-content", HERMES,
     *verbatim('<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>'), True),
    ("hermes-arguments-string-not-an-object-is-content", HERMES,
     *verbatim('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'), True),
    ("hermes-missing-arguments-is-content", HERMES, *verbatim('<tool_call>{"name": "get_time"}</tool_call>'), True),
    ("hermes-nan-is-content", HERMES,
     *verbatim('<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>'), True),
    ("hermes-an-array-is-content", HERMES, *verbatim(f"<tool_call>[{PARIS}]</tool_call>"), True),
    ("hermes-malformed-then-valid", HERMES, f"<tool_call>{{oops</tool_call>\n{QWEN_LONDON}",
     "<tool_call>{oops</tool_call>\n", [call(0, city="London")], True),
    ("hermes-valid-then-malformed", HERMES, f"{QWEN_PARIS}\n<tool_call>{{oops</tool_call>",
     "\n<tool_call>{oops</tool_call>", [PARIS_CALL], True),
    ("hermes-look-alike-markers-are-content", HERMES,
     *verbatim("Wrap it in <tool> or <tools>, not <tool_cal>; a < b and </tool_call> alone. <tool_c"), True),
    ("hermes-parallel-off-keeps-the-first-call", HERMES, f"{QWEN_PARIS}\n{QWEN_LONDON}\n", "", [PARIS_CALL],
     False),
    ("hermes-parallel-off-keeps-malformed-content", HERMES,
     f"{QWEN_PARIS}\n<tool_call>nope</tool_call>\n{QWEN_LONDON}", "\n<tool_call>nope</tool_call>\n",
     [PARIS_CALL], False),
    ("hermes-whitespace-alone-is-content", HERMES, *verbatim("\n \n"), True),
    ("hermes-too-deep-is-content", HERMES, *verbatim("<tool_call>" + "[" * 100_000 + "</tool_call>"), True),
    # generic: SmolLM2 told our format in the system prompt; the first three are its own answers, recorded
    # (greedy, ppsmoke.py --seed -n 2 --serve): under auto after a tool's result it called again, adding a key
    # the schema did not have (auto parses, only forced calls are schema-checked), once with text after
    ("generic-recorded-smollm2-call", GENERIC, SMOL_CALL, "",
     [call(0, city="Paris", unit="celsius", sky="cloudy")], True),
    ("generic-recorded-smollm2-call-then-text", GENERIC, SMOL_CALL + "\n\nThe weather", "\n\nThe weather",
     [call(0, city="Paris", unit="celsius", sky="cloudy")], True),
    ("generic-recorded-smollm2-echoes-a-result", GENERIC,
     *verbatim('<tool_response>\n{"temp": 18, "unit": "celsius", "sky": "cloudy"}'), True),
    ("generic-single-call-in-an-array", GENERIC, f"<tool_call>\n[{PARIS}]\n</tool_call>", "", [PARIS_CALL], True),
    ("generic-single-object", GENERIC, QWEN_PARIS, "", [PARIS_CALL], True),
    ("generic-two-calls-in-an-array", GENERIC, f"<tool_call>\n[{PARIS}, {LONDON}]\n</tool_call>", "",
     [PARIS_CALL, LONDON_CALL], True),
    ("generic-two-tags", GENERIC, f"{QWEN_PARIS}\n{QWEN_LONDON}", "", [PARIS_CALL, LONDON_CALL], True),
    ("generic-text-before-a-call-stays-content", GENERIC, f"Checking.\n<tool_call>[{PARIS}]</tool_call>",
     "Checking.\n", [PARIS_CALL], True),
    ("generic-text-after-a-call-stays-content", GENERIC, f"<tool_call>[{PARIS}]</tool_call> Done.", " Done.",
     [PARIS_CALL], True),
    ("generic-plain-text", GENERIC, *verbatim("Hello! How can I help you today?"), True),
    ("generic-empty-array-is-content", GENERIC, *verbatim("<tool_call>\n[]\n</tool_call>"), True),
    ("generic-one-bad-element-makes-the-array-content", GENERIC,
     *verbatim(f'<tool_call>\n[{PARIS}, {{"name": "get_stock_price", "arguments": {{}}}}]\n</tool_call>'), True),
    ("generic-cut-off-array-is-content", GENERIC, *verbatim(f"<tool_call>\n[{PARIS}, {{\"name\": \"get_"), True),
    ("generic-look-alike-marker-is-content", GENERIC, *verbatim("<tool_call_id> is a field; <tool_ca"), True),
    ("generic-parallel-off-keeps-the-first-call", GENERIC, f"<tool_call>\n[{PARIS}, {LONDON}]\n</tool_call>", "",
     [PARIS_CALL], False),
    # mistral: Mistral 7B Instruct v0.3
    ("mistral-single-call", MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [call(0, city="Paris")], True),
    ("mistral-space-after-the-marker", MISTRAL, f"[TOOL_CALLS] [{PARIS}]", "", [PARIS_CALL], True),
    ("mistral-two-calls", MISTRAL, f"[TOOL_CALLS][{PARIS}, {LONDON}]", "", [PARIS_CALL, LONDON_CALL], True),
    ("mistral-text-before-a-call-stays-content", MISTRAL, f"Let me check that for you. [TOOL_CALLS][{PARIS}]",
     "Let me check that for you. ", [PARIS_CALL], True),
    ("mistral-text-after-the-array-makes-it-content", MISTRAL,
     *verbatim(f"[TOOL_CALLS][{PARIS}]\n\nThe weather in Paris is"), True),
    ("mistral-arguments-as-a-json-string", MISTRAL,
     '[TOOL_CALLS][{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}]', "",
     [call(0, "get_time", timezone="UTC")], True),
    ("mistral-plain-text", MISTRAL, *verbatim("Paris is sunny today, around 21 degrees."), True),
    ("mistral-broken-json-is-content", MISTRAL, *verbatim('[TOOL_CALLS][{"name": "get_weather", "arguments": {'),
     True),
    ("mistral-unknown-function-is-content", MISTRAL,
     *verbatim('[TOOL_CALLS][{"name": "search_web", "arguments": {"q": "Paris"}}]'), True),
    ("mistral-arguments-not-an-object-is-content", MISTRAL,
     *verbatim('[TOOL_CALLS][{"name": "get_weather", "arguments": 42}]'), True),
    ("mistral-an-object-not-an-array-is-content", MISTRAL, *verbatim(f"[TOOL_CALLS]{PARIS}"), True),
    ("mistral-look-alike-markers-are-content", MISTRAL, *verbatim("A list [1, 2] and [TOOLS] and [TOOL_CALL"), True),
    ("mistral-parallel-off-keeps-the-first-call", MISTRAL, f"[TOOL_CALLS][{PARIS}, {LONDON}]", "", [PARIS_CALL],
     False),
    # llama3_json: Llama 3.2
    ("llama-single-call", LLAMA3_JSON, LLAMA_PARIS, "", [call(0, city="Paris")], True),
    ("llama-python-tag-and-whitespace", LLAMA3_JSON, f"\n\n<|python_tag|>{LLAMA_PARIS}\n", "",
     [call(0, city="Paris")], True),
    ("llama-two-calls", LLAMA3_JSON, f"{LLAMA_PARIS}; {LLAMA_TIME}", "",
     [call(0, city="Paris"), call(1, "get_time", timezone="Europe/Paris")], True),
    ("llama-arguments-for-parameters", LLAMA3_JSON, f"{PARIS};{LLAMA_TIME}", "",
     [PARIS_CALL, call(1, "get_time", timezone="Europe/Paris")], True),
    ("llama-text-before-a-call-is-all-content", LLAMA3_JSON, *verbatim(f"I will call a function. {LLAMA_PARIS}"),
     True),
    ("llama-text-after-a-call-makes-it-content", LLAMA3_JSON, *verbatim(f"{LLAMA_PARIS} That should do it."), True),
    ("llama-plain-text", LLAMA3_JSON, *verbatim("  The weather in Paris is sunny."), True),
    ("llama-broken-json-is-content", LLAMA3_JSON, *verbatim('{"name": "get_weather", "parameters": {"city": "P'),
     True),
    ("llama-unknown-function-is-content", LLAMA3_JSON,
     *verbatim('<|python_tag|>{"name": "brave_search", "parameters": {"query": "Paris"}}'), True),
    ("llama-parameters-not-an-object-is-content", LLAMA3_JSON,
     *verbatim('\n{"name": "get_weather", "parameters": "Paris"}'), True),
    ("llama-one-bad-call-makes-all-content", LLAMA3_JSON, *verbatim(f'{LLAMA_PARIS}; {{"name": "get_weather"}}'),
     True),
    ("llama-braces-that-are-not-a-call", LLAMA3_JSON, *verbatim("{curly braces} make a set in Python."), True),
    ("llama-python-code-is-content", LLAMA3_JSON, *verbatim('<|python_tag|>print("hi")'), True),
    ("llama-look-alike-tags-are-content", LLAMA3_JSON, *verbatim("<|python is a snake|> and <|python_ta"), True),
    ("llama-parallel-off-keeps-the-first-call", LLAMA3_JSON, f"{LLAMA_PARIS}; {LLAMA_TIME}", "",
     [call(0, city="Paris")], False),
]


def streamed(family, pieces, parallel):
    parser = ToolParser(family, NAMES, parallel=parallel)
    events = [e for piece in pieces for e in parser.push(piece)] + parser.finish()
    return "".join(e.text for e in events if isinstance(e, Content)), [e for e in events if isinstance(e, Call)]


def cut(text, at):
    at = sorted(at)
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)])]


@pytest.mark.parametrize("family,text,content,calls,parallel", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_output_gives_its_content_and_calls(family, text, content, calls, parallel):
    assert parse_whole(family, text, NAMES, parallel=parallel) == (content, calls)


@pytest.mark.parametrize("family,text,content,calls,parallel", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_streamed_in_any_pieces_an_output_gives_what_it_gives_whole(family, text, content, calls, parallel):
    if len(text) < 2000:  # the 100,000-deep case: a few cuts tell as much
        assert streamed(family, list(text), parallel) == (content, calls)
    rng = random.Random(f"{family}:{text}")
    for _ in range(8):
        at = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))
        assert streamed(family, cut(text, at), parallel) == (content, calls)


def test_text_that_cannot_begin_a_call_is_released_at_once():
    parser = ToolParser(HERMES, NAMES)
    assert parser.push("Hello") == [Content("Hello")]
    assert parser.push(" ") == [Content(" ")]  # whitespace in a stretch that has text flows with it
    assert parser.push("world, 2 < 3. ") == [Content("world, 2 < 3. ")]


def test_what_may_begin_a_marker_is_held_until_it_cannot():
    parser = ToolParser(HERMES, NAMES)
    assert parser.push("Hello <tool") == [Content("Hello ")]
    assert parser.push("s are fun") == [Content("<tools are fun")]
    parser = ToolParser(MISTRAL, NAMES)
    assert parser.push("See [TOOL") == [Content("See ")]
    assert parser.push("_CALLS][") == []
    assert parser.finish() == [Content("[TOOL_CALLS][")]


def test_a_call_is_returned_as_soon_as_its_tag_closes():
    parser = ToolParser(HERMES, NAMES)
    assert parser.push(f"Sure.\n<tool_call>\n{PARIS}\n</tool_") == [Content("Sure.\n")]
    assert parser.push("call>\n") == [PARIS_CALL]
    assert parser.push(QWEN_LONDON) == [LONDON_CALL]
    assert parser.finish() == []  # the "\n" between the calls is no content


def test_mistral_and_llama_calls_wait_for_the_end():
    parser = ToolParser(MISTRAL, NAMES)
    assert parser.push(f"[TOOL_CALLS][{PARIS}]") == []
    assert parser.finish() == [PARIS_CALL]
    parser = ToolParser(LLAMA3_JSON, NAMES)
    assert parser.push(LLAMA_PARIS) == []
    assert parser.finish() == [call(0, city="Paris")]


def test_llama_text_that_cannot_begin_a_call_streams_through():
    parser = ToolParser(LLAMA3_JSON, NAMES)
    assert parser.push("\n") == []  # whitespace waits for what follows it
    assert parser.push("<|py") == []
    assert parser.push("thon") == []
    assert parser.push("ic!") == [Content("\n<|pythonic!")]
    assert parser.push(' {"name": "get_time"') == [Content(' {"name": "get_time"')]  # not at the start


def test_whitespace_alone_waits_and_goes_with_a_call():
    parser = ToolParser(HERMES, NAMES)
    assert parser.push("\n\n") == []
    assert parser.push(QWEN_PARIS) == [PARIS_CALL]
    assert parser.push("\n") == []
    assert parser.push("Done") == [Content("\nDone")]


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError):
        ToolParser("chatml", NAMES)
