"""Tools for a chat template that has none (SmolLM2's), as llama.cpp's server does for such templates: the
tools and how to call them go into the system turn, and a conversation's tool-call history becomes turns the
template does render — an assistant's calls as the text it would have written (worker/tool_formats.py's
call_text), and the tools' results as a user turn between `<tool_response>` tags (Hermes' convention), the
results of one turn's calls together. Pure: the conversation in, the conversation the template renders out.
"""
from __future__ import annotations

import json

from worker.tool_formats import call_text

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def with_tools(messages: list[dict], tools: list[dict] | None, family: str, *, parallel: bool = True) -> list[dict]:
    """`messages` (in transformers' shape) with `tools` (function definitions, {"type": "function",
    "function": {...}}, or None: none shown) told in the system turn, and tool-call history written out."""
    out = history(messages, family)
    if not tools:
        return out
    preamble = instructions(tools, family, parallel=parallel)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}, *out[1:]]
    return [{"role": "system", "content": preamble}, *out]


def instructions(tools: list[dict], family: str, *, parallel: bool) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    example = call_text(family, [("function_name", {"argument": "value"})])
    how_many = "one or more functions" if parallel else "one function"
    return (f"You may call these functions:\n<tools>\n{listed}\n</tools>\nTo call {how_many}, answer only "
            f"with:\n{example}\nIf none is needed, answer directly.")


def history(messages: list[dict], family: str) -> list[dict]:
    """Assistant turns with `tool_calls` as text, and each run of `tool` turns as one user turn."""
    out: list[dict] = []
    names: dict[str, str] = {}  # tool call id -> the function it called
    after_result = False  # the last turn written is tool results: the next result joins it
    for m in messages:
        if m.get("tool_calls"):
            calls = [(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in m["tool_calls"]]
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"] if "id" in c)
            text = call_text(family, calls)
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m.get("content") else text})
        elif m["role"] == "tool":
            result = json.dumps({"name": names.get(m.get("tool_call_id"), ""), "content": m["content"]},
                                ensure_ascii=False)
            block = f"{RESPONSE_OPEN}\n{result}\n{RESPONSE_CLOSE}"
            if after_result:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append(m)
        after_result = m["role"] == "tool"
    return out


def _arguments(arguments) -> dict | str:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
