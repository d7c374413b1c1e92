"""Tool-call formats: how each model family writes a call, which family a chat template belongs to, and the
grammar that forces a call (tool_choice "required" or a named function) in that family's own format.

The families (vLLM's parser names):
  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one tag per call, anywhere in
               the text (Hermes 2/3, Qwen 2/2.5/3, SmolLM3).
  llama3_json  the whole answer is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
               several joined by `; ` (Llama 3.1/3.2/3.3).
  mistral      `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (Mistral 7B v0.3,
               Mixtral, Nemo).
  generic      ours, for a template with no tool support (SmolLM2's): one `<tool_call>` tag holding a JSON
               array of calls, told to the model in a system prompt (worker/tokens/tool_prompt.py), as
               llama.cpp's server does for such templates.

The parsers that read these back are node/api/tool_parse.py's. Everything here is pure.
"""
from __future__ import annotations

import json

HERMES, LLAMA3_JSON, MISTRAL, GENERIC = "hermes", "llama3_json", "mistral", "generic"
FAMILIES = (HERMES, LLAMA3_JSON, MISTRAL, GENERIC)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # hermes and generic
PYTHON_TAG = "<|python_tag|>"  # llama3_json, optional before the calls
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"  # mistral: a control token in its vocabulary
LLAMA3_SEPARATOR = "; "  # llama3_json: between calls
CONTROL_MARKED = frozenset({LLAMA3_JSON, MISTRAL})  # whose marker is a control token in their vocabularies
# JSON as the families' templates write it (jinja's tojson: ", " and ": ")
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
TEMPLATE, GENERIC_PROMPT = "template", "generic"  # how tools reach the prompt


def family_of(template: str | None, takes: frozenset[str]) -> tuple[str, str]:
    """(the family a chat template's model writes calls in, how tools are rendered): TEMPLATE where the
    template takes `tools` (among the variables it reads: `takes`, worker/tokens/chat.variables) and writes a
    family we know; otherwise the generic format through our own system prompt."""
    if template is None or "tools" not in takes:
        return GENERIC, GENERIC_PROMPT
    if TOOL_CALL_OPEN in template:
        return HERMES, TEMPLATE
    if MISTRAL_TOOL_CALLS in template:
        return MISTRAL, TEMPLATE
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3_JSON, TEMPLATE
    return GENERIC, GENERIC_PROMPT


def call_text(family: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` (name, arguments) as the family writes them: what a forced call's grammar allows, and how the
    generic prompt shows a past turn's calls to the model."""
    if family == LLAMA3_JSON:
        return LLAMA3_SEPARATOR.join(_dumps({"name": n, "parameters": a}) for n, a in calls)
    objects = [_dumps({"name": n, "arguments": a}) for n, a in calls]
    if family == HERMES:
        return "\n".join(f"{TOOL_CALL_OPEN}\n{o}\n{TOOL_CALL_CLOSE}" for o in objects)
    joined = "[" + ITEM_SEPARATOR.join(objects) + "]"
    return MISTRAL_TOOL_CALLS + joined if family == MISTRAL else f"{TOOL_CALL_OPEN}\n{joined}\n{TOOL_CALL_CLOSE}"


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR))


def forced_lark(family: str, tools: list[tuple[str, str]], parallel: bool, specials: dict[str, int]) -> str:
    """llguidance's Lark grammar for a forced call: one call (or, with `parallel`, one or more) of one of
    `tools` (name, its parameters' JSON Schema as JSON text), written as `family` writes calls (call_text).
    The envelope is literal text and each schema its own `%json` document, so a schema's `$ref`s resolve
    against its own root. `specials` maps a control token's text to its id: mistral's marker is that token
    where the vocabulary has it (the model was trained on the token, not on its spelling)."""
    key = "parameters" if family == LLAMA3_JSON else "arguments"
    rules = [f'call_{i}: {_lit("{" + _dumps("name") + KEY_SEPARATOR + _dumps(name) + ITEM_SEPARATOR)}'
             f' {_lit(_dumps(key) + KEY_SEPARATOR)} %json {_with_separators(schema)} {_lit("}")}'
             for i, (name, schema) in enumerate(tools)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))

    def calls(open_: str, between: str, close: str) -> str:  # one call, or one or more with `parallel`
        one = " ".join(filter(None, (_lit(open_) if open_ else "", "call", _lit(close) if close else "")))
        return f"{one} ({_lit(between)} {one})*" if parallel else one
    if family == HERMES:
        start = calls(TOOL_CALL_OPEN + "\n", "\n", "\n" + TOOL_CALL_CLOSE)
    elif family == LLAMA3_JSON:
        start = calls("", LLAMA3_SEPARATOR, "")
    else:
        array = f'{_lit("[")} {calls("", ITEM_SEPARATOR, "")} {_lit("]")}'
        if family == MISTRAL:
            marker = f"<[{specials[MISTRAL_TOOL_CALLS]}]>" if MISTRAL_TOOL_CALLS in specials else _lit(MISTRAL_TOOL_CALLS)
            start = f"{marker} {array}"
        else:
            start = " ".join((_lit(TOOL_CALL_OPEN + "\n"), array, _lit("\n" + TOOL_CALL_CLOSE)))
    return "\n".join(["start: " + start, call, *rules])


def _lit(text: str) -> str:
    return json.dumps(text)  # Lark's string literals take JSON's escapes


def _with_separators(schema_text: str) -> str:
    """The schema with the separators call_text writes and no free whitespace (a small model let loose on
    whitespace spends its tokens on it); the schema's own x-guidance options win."""
    schema = json.loads(schema_text)
    options = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**options, **(schema.get("x-guidance") or {})}}
    return json.dumps(schema, ensure_ascii=False)
