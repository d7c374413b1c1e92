"""A forced tool call as the grammar text a request carries (`Sampling.grammar`): tool_choice "required" or
a named function, checked at the API and compiled at the last stage (worker/grammar.py), so the arguments
always parse and match their schema.

The text is {"family", "parallel", "tools": [{"name", "schema"}], "type": "tool_calls"}: the envelope's keys
sorted, each schema in its own key order (the order the model must write its properties in). The grammar
itself is worker/tool_formats.py's forced_lark.
"""
from __future__ import annotations

import json

import llguidance

from worker.grammar import TOOL_CALLS, GrammarError, byte_matcher
from worker.tool_formats import FAMILIES, forced_lark


def canonical_tool_calls(family: str, tools: list[tuple[str, str]], parallel: bool) -> str:
    """The grammar text forcing a call of one of `tools` (name, its schema's JSON text as checked by
    worker/grammar.py's checked_schema) in `family`'s format; with `parallel`, one or more calls. A grammar the
    library will not take is a GrammarError."""
    if family not in FAMILIES or not tools:
        raise GrammarError(f"tool_calls: want a family of {FAMILIES} and at least one tool")
    listed = ",".join('{"name":' + json.dumps(name, ensure_ascii=False) + ',"schema":' + schema + "}"
                      for name, schema in tools)
    text = (f'{{"family":{json.dumps(family)},"parallel":{json.dumps(parallel)},"tools":[{listed}],'
            f'"type":"{TOOL_CALLS}"}}')
    matcher = byte_matcher(llguidance.LLMatcher.grammar_from_lark(forced_lark(family, tools, parallel, {})))
    if matcher.is_error():
        raise GrammarError(f"tools: the forced call's grammar: {matcher.get_error()}")
    return text
