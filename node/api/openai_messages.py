"""OpenAI's chat `messages` at pp-entry: roles, text content, and tool-call history (assistant `tool_calls`
answered by `tool` messages), checked as OpenAI checks them and put in the shape Hugging Face chat templates
take (transformers' convention). Whether the model's template renders tool calls is worker/tokens/chat.py's.

What rendering and tokenizing a conversation costs is bounded here, before any of it, because a body's size
does not show it (9,000 empty messages are 297 KB, and 0.87 s of template and tokenizer): at most
`max_messages` turns (MessageBudget), and at most `max_chars` characters of template input in all (contents,
names, tool-call ids, names and arguments' text), the characters the context could hold. Tool calls are
bounded by the turns: each is answered by a tool message of its own.
"""
from __future__ import annotations

import json
import math

import attrs

from node.api.openai_fields import ApiError, checked_text, field

MAX_MESSAGES = 2048  # OpenAI's own cap on a chat's messages
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_ARGUMENTS_DEPTH = 64  # a tool call's arguments nest no deeper: a template's tojson recurses through them
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


@attrs.define
class MessageBudget:
    """What a conversation may ask of the template and the tokenizer; `chars` counts what it has spent."""

    max_messages: int = MAX_MESSAGES
    max_chars: int | None = None  # None: the tokenizing side's own check (node/api/openai_api.py) alone
    chars: int = 0

    def spend(self, text: str) -> str:
        self.chars += len(text)
        if self.max_chars is not None and self.chars > self.max_chars:
            raise ApiError(400, f"messages: more than {self.max_chars} characters of contents, names and tool "
                                f"calls, more than the model's context could hold", param="messages",
                           code="context_length_exceeded")
        return text


def messages(body: dict, budget: MessageBudget | None = None) -> tuple[dict, ...]:
    """The conversation in the shape Hugging Face chat templates take (transformers' convention), its tool-call
    history checked as OpenAI checks it: each of an assistant turn's `tool_calls` is answered by a `tool`
    message naming its id before any other turn comes. Past the budget's turns or characters is refused
    before the rest is read."""
    budget = MessageBudget() if budget is None else attrs.evolve(budget, chars=0)
    turns = field(body, "messages", list, required=True)
    if not turns:
        raise ApiError(400, "messages: empty", param="messages", code="invalid_value")
    if len(turns) > budget.max_messages:
        raise ApiError(400, f"messages: {len(turns)} messages, more than the {budget.max_messages} a conversation "
                            f"may have here", param="messages", code="invalid_value")
    out, unanswered = [], {}  # unanswered: tool call id -> where the last assistant turn made it
    for n, m in enumerate(turns):
        name = f"messages[{n}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{name}: expected an object", param=name, code="invalid_type")
        role = field(m, "role", str, required=True, name=f"{name}.role")
        if role not in ROLES:
            raise ApiError(400, f"{name}.role: {role!r} is not one of {', '.join(ROLES)}", param=f"{name}.role",
                           code="invalid_value")
        if role != "tool":
            _all_answered(unanswered, before=name)
        out.append(_message(m, name, ROLES[role], unanswered, budget))
    _all_answered(unanswered, before="the end of messages")
    return tuple(out)


def _message(m: dict, name: str, role: str, unanswered: dict[str, str], budget: MessageBudget) -> dict:
    """One turn: {"role", "content"}, with "tool_calls" (content may then be null: "") or "tool_call_id"."""
    if m.get("tool_calls") is not None and role != "assistant":
        raise ApiError(400, f"{name}.tool_calls: only assistant messages make tool calls", param=f"{name}.tool_calls",
                       code="invalid_value")
    message = {"role": role}
    if role == "assistant" and m.get("tool_calls") is not None:
        message["content"] = "" if m.get("content") is None else budget.spend(_content(m, name))
        message["tool_calls"] = _tool_calls(m, name, budget)
        unanswered.update((c["id"], f"{name}.tool_calls[{k}]") for k, c in enumerate(message["tool_calls"]))
    else:
        message["content"] = budget.spend(_content(m, name))
    if role == "tool":
        message["tool_call_id"] = call_id = budget.spend(field(m, "tool_call_id", str, required=True,
                                                               name=f"{name}.tool_call_id"))
        if unanswered.pop(call_id, None) is None:
            raise ApiError(400, f"{name}.tool_call_id: {call_id!r} is not an unanswered tool call of the assistant "
                                f"message before it", param=f"{name}.tool_call_id", code="invalid_value")
    if m.get("name") is not None:
        message["name"] = budget.spend(checked_text(field(m, "name", str, name=f"{name}.name"), f"{name}.name"))
    return message


def _all_answered(unanswered: dict[str, str], *, before: str) -> None:
    if unanswered:
        call_id, where = next(iter(unanswered.items()))
        raise ApiError(400, f"{where}.id: no tool message answers {call_id!r} before {before}", param=f"{where}.id",
                       code="invalid_value")


def _tool_calls(message: dict, name: str, budget: MessageBudget) -> list[dict]:
    """An assistant turn's tool calls, as transformers' templates take them: each {"id", "type": "function",
    "function": {"name", "arguments"}}, with the arguments' JSON text parsed into the object it spells. No more
    than a conversation's turns: each is answered by a tool message."""
    calls = field(message, "tool_calls", list, name=f"{name}.tool_calls")
    if not calls:
        raise ApiError(400, f"{name}.tool_calls: empty; leave it out of a turn that calls no tool",
                       param=f"{name}.tool_calls", code="invalid_value")
    if len(calls) > budget.max_messages:
        raise ApiError(400, f"{name}.tool_calls: {len(calls)} calls, more than the {budget.max_messages} messages "
                            f"that could answer them", param=f"{name}.tool_calls", code="invalid_value")
    out, first = [], {}
    for k, call in enumerate(calls):
        where = f"{name}.tool_calls[{k}]"
        out.append(_tool_call(call, where, budget))
        if (seen := first.setdefault(out[-1]["id"], k)) != k:
            raise ApiError(400, f"{where}.id: {out[-1]['id']!r} is the id of tool_calls[{seen}] too",
                           param=f"{where}.id", code="invalid_value")
    return out


def _tool_call(call, where: str, budget: MessageBudget) -> dict:
    if not isinstance(call, dict):
        raise ApiError(400, f"{where}: expected an object", param=where, code="invalid_type")
    call_id = budget.spend(_name(call, "id", where))
    if (kind := field(call, "type", str, required=True, name=f"{where}.type")) != "function":
        raise ApiError(400, f"{where}.type: {kind!r} is not 'function'", param=f"{where}.type", code="invalid_value")
    function = field(call, "function", dict, required=True, name=f"{where}.function")
    return {"id": call_id, "type": "function",
            "function": {"name": budget.spend(_name(function, "name", f"{where}.function")),
                         "arguments": _arguments(function, f"{where}.function.arguments", budget)}}


def _name(obj: dict, key: str, where: str) -> str:
    name = f"{where}.{key}"
    if not (value := checked_text(field(obj, key, str, required=True, name=name), name)):
        raise ApiError(400, f"{name}: empty", param=name, code="invalid_value")
    return value


def _arguments(function: dict, name: str, budget: MessageBudget) -> dict:
    """A tool call's arguments: OpenAI sends a JSON text, transformers' templates want the object (JSON's
    NaN and Infinity, which JSON does not have, are refused, as is a number that overflows to one and a lone
    surrogate in any string)."""
    text = budget.spend(field(function, "arguments", str, required=True, name=name))
    too_deep = ApiError(400, f"{name}: nested deeper than {MAX_ARGUMENTS_DEPTH} levels", param=name,
                        code="invalid_value")
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:  # nested past what the parser recurses into
        raise too_deep from None
    except ValueError as exc:
        raise ApiError(400, f"{name}: not JSON: {exc}", param=name, code="invalid_value") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{name}: want a JSON object, not {_JSON_KINDS[type(value)]}", param=name,
                       code="invalid_value")
    if _json_depth(value, name) > MAX_ARGUMENTS_DEPTH:
        raise too_deep
    return value


def _not_json(word: str):
    raise ValueError(f"{word} is not JSON")


def _finite(literal: str) -> float:
    if not math.isfinite(value := float(literal)):  # 1e400: json reads it as inf, which tojson writes as Infinity
        raise ValueError(f"{literal[:40]} is not a finite number")
    return value


def _json_depth(value, name: str) -> int:
    """How many objects and arrays deep `value` (parsed JSON) nests; each string in it, keys too, must be
    text (checked_text)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            checked_text(value, name)
        elif isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in ([*value, *value.values()] if isinstance(value, dict) else value)]
    return deepest


def _content(message: dict, name: str) -> str:
    """Text content: a string, or an array of text parts (other parts are refused)."""
    content = field(message, "content", (str, list), required=True, name=f"{name}.content")
    if isinstance(content, str):
        return checked_text(content, f"{name}.content")
    texts = []
    for n, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{name}.content[{n}]: only text parts are supported", param=f"{name}.content",
                           code="invalid_value")
        texts.append(part["text"])
    return checked_text("".join(texts), f"{name}.content")
