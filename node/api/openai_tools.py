"""OpenAI's function calling at pp-entry, the request side: `tools`, `tool_choice` and `parallel_tool_calls`
checked as OpenAI checks them, and the model's tool format (which family writes calls, and whether its chat
template or our generic prompt tells it of the tools).

- `tools`: at most MAX_TOOLS functions, each a name of 1-64 letters, digits, `_` or `-` (OpenAI's rule),
  unique, an optional description, and `parameters`, a JSON Schema of an object (absent: no parameters),
  checked and compiled as response_format's schemas are (worker/grammar.py's checked_schema).
- `tool_choice`: "none" (no call: tools are not shown to the model), "auto" (the default: the model may call,
  and what it writes is parsed, node/api/tool_parse.py), "required" (a call of one of the tools, forced by
  the grammar) or {"type": "function", "function": {"name"}} (a call of that one, forced).
- `parallel_tool_calls` (default true): false allows one call at most.
"""
from __future__ import annotations

import functools
import json
import re

import attrs

from worker.grammar import GrammarError, checked_schema
from worker.tokens.chat import variables
from worker.tool_formats import FAMILIES, GENERIC_PROMPT, TEMPLATE, family_of
from worker.tool_grammar import canonical_tool_calls

from node.api.openai_fields import ApiError, checked_text, field, shown

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 256 * 1024  # every tool's JSON together: each is compiled, and shown to the model
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "function"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@attrs.frozen
class ToolSetup:
    """How this model is told of tools (`rendering`: its template, or our generic prompt) and which family's
    format its calls are read in (worker/tool_formats.py)."""

    family: str
    rendering: str

    def card(self) -> dict:
        return {"tool_call_parser": self.family, "tool_rendering": self.rendering}


@functools.lru_cache(maxsize=16)  # one template and one parser a node: asked for on every chat request
def tool_setup(template: str | None, parser: str | None) -> ToolSetup:
    """The setup a chat template gives, its family overridden by `--tool-call-parser` where set."""
    takes = variables(template) if template else frozenset()
    family, rendering = family_of(template, takes)
    if parser is not None:
        if parser not in FAMILIES:
            raise ValueError(f"--tool-call-parser: {parser!r} is not one of auto, {', '.join(FAMILIES)}")
        family = parser
        rendering = TEMPLATE if "tools" in takes else GENERIC_PROMPT  # the template tells them, where it can
    return ToolSetup(family, rendering)


@attrs.frozen
class Tool:
    name: str
    description: str | None
    parameters: dict  # the JSON Schema as the client sent it (what the template or prompt shows)
    schema: str  # its JSON text as checked: what the forced call's grammar holds

    def as_template_takes(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@attrs.frozen
class ToolRequest:
    """A request's tools; `choice` is none, auto, required or function (`named` is then the one forced)."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True
    named: str | None = None

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a call is forced among: none for auto and none."""
        if self.choice == REQUIRED:
            return self.tools
        return tuple(t for t in self.tools if self.choice == NAMED and t.name == self.named)

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for calls: always, unless tool_choice is none."""
        return self.choice != NONE

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def grammar(self, family: str) -> str:
        """The grammar text forcing the call (worker/tool_grammar.py), or "" where nothing is forced."""
        if not self.forced:
            return ""
        try:
            return canonical_tool_calls(family, [(t.name, t.schema) for t in self.forced], self.parallel)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param="tools", code="invalid_value") from None


def tool_request(body: dict, *, chat: bool) -> ToolRequest | None:
    """The request's tools, or None where it has none (tool_choice then must be none or absent)."""
    tools = field(body, "tools", list, default=[])
    if tools and not chat:
        raise ApiError(400, "tools: only /v1/chat/completions calls tools", param="tools",
                       code="unsupported_parameter")
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ApiError(400, f"{legacy}: deprecated by OpenAI and not supported here; use tools and tool_choice",
                           param=legacy, code="unsupported_parameter")
    parallel = bool(field(body, "parallel_tool_calls", bool, default=True))
    if not tools:
        if body.get("tool_choice") not in (None, NONE):  # nothing to choose (vLLM: 400 too)
            raise ApiError(400, "tool_choice: needs tools to choose from", param="tool_choice", code="invalid_value")
        return None
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools: {len(tools)} tools, more than {MAX_TOOLS}", param="tools", code="invalid_value")
    if (size := len(json.dumps(tools, ensure_ascii=False))) > MAX_TOOLS_CHARS:
        raise ApiError(400, f"tools: {size} characters of JSON, more than {MAX_TOOLS_CHARS}", param="tools",
                       code="invalid_value")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    seen: dict[str, int] = {}
    for i, t in enumerate(parsed):
        if (first := seen.setdefault(t.name, i)) != i:
            raise ApiError(400, f"tools[{i}].function.name: {t.name!r} is the name of tools[{first}] too",
                           param="tools", code="invalid_value")
    choice, named = _choice(body.get("tool_choice"), seen)
    return ToolRequest(parsed, choice, parallel, named)


def _tool(tool, where: str) -> Tool:
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where}: expected an object", param="tools", code="invalid_type")
    if (kind := field(tool, "type", str, required=True, name=f"{where}.type")) != "function":
        raise ApiError(400, f"{where}.type: {shown(kind)} is not 'function'", param="tools", code="invalid_value")
    function = field(tool, "function", dict, required=True, name=f"{where}.function")
    name = field(function, "name", str, required=True, name=f"{where}.function.name")
    if not _NAME.fullmatch(name):
        raise ApiError(400, f"{where}.function.name: {shown(name)} is not 1-64 letters, digits, '_' or '-'",
                       param="tools", code="invalid_value")
    description = field(function, "description", str, name=f"{where}.function.description")
    field(function, "strict", bool, name=f"{where}.function.strict")  # checked; every schema is enforced anyway
    parameters = field(function, "parameters", dict, default=_NO_PARAMETERS, name=f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":
        raise ApiError(400, f"{where}.function.parameters: a function's parameters are an object's schema, not "
                            f"{shown(parameters.get('type'))}", param="tools", code="invalid_value")
    try:
        schema = checked_schema(parameters, f"{where}.function.parameters")
    except GrammarError as exc:
        raise ApiError(400, str(exc), param="tools", code="invalid_value") from None
    return Tool(name, None if description is None else checked_text(description, f"{where}.function.description"),
                parameters, schema)


def _choice(choice, names: dict[str, int]) -> tuple[str, str | None]:
    if choice is None:
        return AUTO, None
    if isinstance(choice, str):
        if choice not in (NONE, AUTO, REQUIRED):
            raise ApiError(400, f"tool_choice: {shown(choice)} is not none, auto, required or a function",
                           param="tool_choice", code="invalid_value")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise ApiError(400, 'tool_choice: want "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice", code="invalid_value")
    name = field(choice["function"], "name", str, required=True, name="tool_choice.function.name")
    if name not in names:
        raise ApiError(400, f"tool_choice.function.name: {shown(name)} is none of the tools", param="tool_choice",
                       code="invalid_value")
    return NAMED, name
