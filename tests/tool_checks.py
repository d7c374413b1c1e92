"""What the official openai client must get from pp's function calling, as checks any served cluster can be put
through: the built-in tiny model in the default suite (random weights: only the grammar makes its calls
valid), SmolLM2 in the slow tier."""
from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
# one small enough for the tiny model's 512 bytes of context beside the generic prompt and its answer
TINY = ({"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"], "additionalProperties": False}}},)
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]},
                                                    "seconds": {"type": "boolean"}},
                   "required": ["zone", "seconds"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FULL = (WEATHER, TIME)  # the first is the one tool_choice names


def valid(tool: dict, name: str, arguments: str) -> bool:
    """A call of `tool` with arguments its schema allows (the subset these tools use: object, required,
    additionalProperties false, enum, string maxLength, integer bounds, boolean)."""
    schema, args = tool["function"]["parameters"], json.loads(arguments)
    if name != tool["function"]["name"] or not isinstance(args, dict) or not set(schema["required"]) <= set(args):
        return False
    return all(key in schema["properties"] and _fits(schema["properties"][key], value) for key, value in args.items())


def _fits(schema: dict, value) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return kind == "boolean" and isinstance(value, bool)


def _name(tools) -> str:
    return tools[0]["function"]["name"]


def _named(tools) -> dict:
    return {"type": "function", "function": {"name": _name(tools)}}


def valid_call(tools: list[dict], name: str, arguments: str) -> bool:
    return any(valid(t, name, arguments) for t in tools)


def named_call(client, model: str, tools=FULL, **kw):
    """A call of the function tool_choice names: schema-valid, finish_reason tool_calls, no content."""
    answer = client.chat.completions.create(model=model, messages=ASK, tools=list(tools), tool_choice=_named(tools),
                                            **{"max_tokens": 96, **kw})
    choice = answer.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == _name(tools)
    assert valid(tools[0], call.function.name, call.function.arguments), call.function.arguments
    return answer


def required_call(client, model: str, tools=FULL, **kw):
    """tool_choice required with two tools, one call allowed: a valid call of either."""
    answer = client.chat.completions.create(model=model, messages=ASK, tools=list(tools), tool_choice="required",
                                            parallel_tool_calls=False, **{"max_tokens": 96, **kw})
    [call] = answer.choices[0].message.tool_calls
    assert valid_call(list(tools), call.function.name, call.function.arguments), call.function.arguments
    assert answer.choices[0].finish_reason == "tool_calls"
    return call


def streamed_call(client, model: str, tools=FULL, **kw) -> dict:
    """The named call streamed: deltas by index, id, type and name first, then pieces of arguments that join
    into the call a whole answer gives."""
    stream = client.chat.completions.create(model=model, messages=ASK, tools=list(tools), tool_choice=_named(tools),
                                            stream=True, **{"max_tokens": 96, **kw})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, delta
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert valid(tools[0], calls[0]["name"], calls[0]["arguments"]), calls[0]
    return calls[0]


def answer_after_result(client, model: str, tools=FULL, **kw):
    """The call and its result sent back by tool_call_id: the model answers in text, calling nothing."""
    called = named_call(client, model, tools, **kw).choices[0].message
    result = {"role": "tool", "tool_call_id": called.tool_calls[0].id,
              "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy"})}
    conversation = [*ASK, called.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(model=model, messages=conversation, tools=list(tools),
                                            tool_choice="none", **{**kw, "max_tokens": 48})
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason in ("stop", "length")
    return choice.message.content


def auto_and_none(client, model: str, tools=FULL, **kw) -> None:
    """auto and none are taken; none never calls."""
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model=model, messages=ASK, tools=list(tools), tool_choice=choice,
                                                **{**kw, "max_tokens": 24})
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if choice == "none":
            assert answer.choices[0].message.tool_calls is None
