"""Chat templates: a conversation rendered to the text a model was trained on, the way Hugging Face
transformers renders it (`apply_chat_template`), so a model's own template gives the ids it expects.

As in transformers (src/transformers/utils/chat_template_utils.py): a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks and the loop-controls extension; `tojson` that does not escape HTML;
`raise_exception(message)` and `strftime_now(format)` as globals; the tokenizer's special tokens
(`bos_token`, `eos_token`) and `add_generation_prompt` as variables. The rendered text starts with the
BOS token when the template writes it, so it is encoded without adding another.

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
import jinja2.sandbox

from ..errors import WorkerError

# Meta-Llama-3-8B-Instruct's template (its tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

ROLES = ("system", "user", "assistant")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise WorkerError(f"the model's chat template does not parse: {exc}") from None


def render(source: str, messages: list[dict], *, bos_token: str, eos_token: str,
           add_generation_prompt: bool = True, **extra) -> str:
    """The conversation as the template writes it. A template's own refusals (raise_exception, e.g.
    "roles must alternate") and malformed messages are WorkerErrors naming the problem."""
    check_messages(messages)
    try:
        return compile_template(source).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                               add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as exc:
        raise WorkerError(f"the model's chat template refused the conversation: {exc}") from None


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise WorkerError("messages: empty")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise WorkerError(f"messages[{n}]: want a role ({', '.join(ROLES)}) and text content")
