"""Chat templates: a conversation rendered to the text a model was trained on, the way Hugging Face
transformers renders it (`apply_chat_template`), so a model's own template gives the ids it expects.

As in transformers (src/transformers/utils/chat_template_utils.py): a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks and the loop-controls extension; `tojson` that does not escape HTML;
`raise_exception(message)` and `strftime_now(format)` as globals; the tokenizer's special tokens
(`bos_token`, `eos_token`) and `add_generation_prompt` as variables. The rendered text starts with the
BOS token when the template writes it, so it is encoded without adding another.

Tool-call history (assistant turns with `tool_calls`, `tool` turns with their results) goes through a template
only where the template renders it: the template must name `tool_calls` for calls and the `tool` role for
results (read from jinja2's syntax tree, not the source's text), and what it renders must show each call's
function name and each result's text.
A template without tool support — SmolLM2-135M-Instruct's, Llama 3's fallback below — refuses such a
conversation naming the first turn it would lose, rather than render a prompt that silently drops it.

Rendering is bounded whatever the conversation: what a template writes is read as it is written and refused
past render_limit(messages) characters (a fixed allowance, a per-turn one, and a multiple of the input), so a
template that loops over its input cannot run away with it; jinja2's sandbox caps range() itself. The API
bounds the input (node/api/openai_messages.py) and renders in a worker thread.

Where templates come from: `tokenizer.chat_template` in GGUF metadata, `chat_template` in a Hugging Face
`tokenizer_config.json` (or a `chat_template.jinja` beside it). Models that carry none — the built-in
ones among them — use Llama 3's instruct template.
"""
from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from ..errors import WorkerError

# Meta-Llama-3-8B-Instruct's template (its tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

ROLES = ("system", "user", "assistant", "tool")
RENDER_BASE_CHARS = 64 * 1024  # a template's own text: a long system preamble, tool instructions
RENDER_TURN_CHARS = 1024  # per turn: role headers, separators
RENDER_INPUT_FACTOR = 4  # per character of input: tojson's indents and escapes write more than one


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise WorkerError(f"the model's chat template does not parse: {exc}") from None


@functools.lru_cache(maxsize=16)
def spelled_names(source: str) -> frozenset[str]:
    """Every attribute name and string constant in a template (which parses): `message.tool_calls`,
    `'tool_calls' in message`, `message['tool_calls']` and `message.role == 'tool'` each spell theirs; text
    outside the template's tags (`<|im_start|>tool`) spells none."""
    tree = _environment().parse(source)
    return frozenset({node.attr for node in tree.find_all(jinja2.nodes.Getattr)}
                     | {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)})


@functools.lru_cache(maxsize=16)
def variables(source: str) -> frozenset[str]:
    """The variables a template (which parses) reads from its caller: `tools` where it takes tools."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))


def render(source: str, messages: list[dict], *, bos_token: str, eos_token: str,
           add_generation_prompt: bool = True, **extra) -> str:
    """The conversation as the template writes it. A template's own refusals (raise_exception, e.g.
    "roles must alternate"), malformed messages and tool turns the template does not render are WorkerErrors
    naming the problem."""
    check_messages(messages)
    template = compile_template(source)
    tool_turns = list(_tool_turns(messages))
    for n, what, spelled, _ in tool_turns:
        if spelled not in spelled_names(source):
            raise _not_rendered(what, n)
    try:
        text = _bounded(template.generate(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                          add_generation_prompt=add_generation_prompt, **extra),
                        render_limit(messages) + RENDER_INPUT_FACTOR * len(json.dumps(extra, default=str)))
    except jinja2.TemplateError as exc:
        raise WorkerError(f"the model's chat template refused the conversation: {exc}") from None
    for n, what, _, shown in tool_turns:
        if not all(_shows(text, s) for s in shown):
            raise _not_rendered(what, n)
    return text


def render_limit(messages: list[dict]) -> int:
    """The most characters a template may write for `messages` (checked by check_messages)."""
    written = len(json.dumps(messages, ensure_ascii=False, default=str))  # the input, in one C pass
    return RENDER_BASE_CHARS + RENDER_TURN_CHARS * len(messages) + RENDER_INPUT_FACTOR * written


def _bounded(pieces, limit: int) -> str:
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > limit:
            pieces.close()
            raise WorkerError(f"the model's chat template wrote more than {limit} characters for this conversation")
        out.append(piece)
    return "".join(out)


def _tool_turns(messages: list[dict]):
    """(index, what it holds, the name a template handling it spells, texts its rendering must show) for each
    turn with tool calls (their function names) or a tool's result (its text)."""
    for n, m in enumerate(messages):
        if m.get("tool_calls"):
            yield n, "tool calls", "tool_calls", [call["function"]["name"] for call in m["tool_calls"]]
        elif m["role"] == "tool":
            yield n, "tool results", "tool", [m["content"].strip()]


def _shows(text: str, value: str) -> bool:
    """`value` is in `text` as it is, or as a JSON string (`tojson`) writes it."""
    return value in text or json.dumps(value, ensure_ascii=False)[1:-1] in text


def _not_rendered(what: str, n: int) -> WorkerError:
    return WorkerError(f"this model's chat template does not render {what} (messages[{n}])")


def check_messages(messages: list[dict]) -> None:
    """Each turn a role and text content; a tool result names the call it answers, and tool calls (an
    assistant's) are each a function's name and its arguments (an object, or its JSON text)."""
    if not messages:
        raise WorkerError("messages: empty")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise WorkerError(f"messages[{n}]: want a role ({', '.join(ROLES)}) and text content")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise WorkerError(f"messages[{n}]: a tool result wants the tool_call_id it answers")
        if "tool_calls" in m and (m["role"] != "assistant" or not _well_formed(m["tool_calls"])):
            raise WorkerError(f"messages[{n}]: tool_calls want an assistant turn and a list of calls, each a "
                              f"function's name and arguments")


def _well_formed(calls) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(f := c.get("function"), dict) and isinstance(f.get("name"), str)
        and isinstance(f.get("arguments"), (dict, str)) for c in calls)
