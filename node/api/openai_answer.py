"""OpenAI's wire format at pp-entry, answers: what a request produced so far (one Choice per prompt and
`n`), drawn as the whole response (`stream: false`), as stream chunks, and the usage. Logprobs take
OpenAI's two shapes: completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset), with
`echo` the prompt's tokens first (the first has no logprob: nothing comes before it), and chat's list of
{token, logprob, bytes, top_logprobs}.

Tool calls take OpenAI's shape: `message.tool_calls` whole, and streamed as `delta.tool_calls` by `index`,
each call's id, type and name first, then its arguments. A choice whose text is read for calls has a
ToolParser (node/api/tool_parse.py); its content is what the parser leaves as text.

Extension, as vLLM spells it: `return_token_ids` adds each choice's prompt and answer token ids (and the
stages' timings, pp's own).
"""
from __future__ import annotations

import secrets
import time
from typing import Callable

import attrs

from worker.contract import TokenLogprob

from node.api.openai_wire import ApiRequest
from node.api.tool_parse import Call, Content, ToolParser

Entries = list[tuple[int, "TokenLogprob | None"]]  # (token id, its logprob where known) per position


@attrs.define
class Choice:
    """One answer of a request: its prompt (one of `prompts`, or the chat), and what came back so far."""

    index: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_text: str = ""  # what `echo` puts before the answer
    token_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # the answer's tokens, where asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # echo with logprobs: the prompt's tokens from the second
    text_offset: int = 0  # completions' logprobs: characters of the choice's text their offsets have covered
    timings: dict | None = None
    parser: ToolParser | None = None  # where the request has tools the model may call
    tool_calls: list[dict] = attrs.field(factory=list)  # as OpenAI writes them: {"id", "type", "function"}

    def read(self, text: str, *, over: bool) -> list[Content | Call]:
        """New answer text, as content and tool calls (`over`: the answer ends here); both are kept."""
        if self.parser is None:
            self.text += text
            return [Content(text)] if text else []
        events = self.parser.push(text) + (self.parser.finish() if over else [])
        for event in events:
            if isinstance(event, Call):
                self.tool_calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                                        "function": {"name": event.name, "arguments": event.arguments}})
            else:
                self.text += event.text
        return events

    def prompt_entries(self) -> Entries:
        first = [(self.prompt_token_ids[0], None)] if self.prompt_token_ids else []
        return first + [(lp.token_id, lp) for lp in self.prompt_logprobs]


@attrs.define
class Completion:
    """A request's choices; `token_bytes(id)` is a token's bytes (control tokens' text included), for the
    logprobs' token strings."""

    request: ApiRequest
    request_id: str
    choices: list[Choice]
    token_bytes: Callable[[int], bytes]
    created: int = attrs.field(factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.request.chat else "cmpl-") + self.request_id

    def usage(self) -> dict:
        """Each prompt counted once however many choices it has, as OpenAI counts `n`."""
        p = sum(len(c.prompt_token_ids) for c in self.choices if c.index % self.request.n == 0)
        n = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model}

    def response(self) -> dict:
        """The whole answer, for `stream: false`."""
        choices = []
        for c in self.choices:
            entries = (c.prompt_entries() if self.request.echo else []) + [(lp.token_id, lp) for lp in c.logprobs]
            choice = {"index": c.index, "logprobs": self._logprobs(entries, c, 0),
                      "finish_reason": c.finish_reason}
            if self.request.chat:
                choice["message"] = {"role": "assistant", "content": c.text or None if c.tool_calls else c.text,
                                     "refusal": None}
                if c.tool_calls:
                    choice["message"]["tool_calls"] = c.tool_calls
            else:
                choice["text"] = (c.prompt_text if self.request.echo else "") + c.text
            choices.append(self._extended(choice, c, c.token_ids))
        body = {**self._head("chat.completion" if self.request.chat else "text_completion"), "choices": choices,
                "usage": self.usage()}
        return self._body_extended(body, self.choices[0], prompt=True)

    def chunk(self, c: Choice, text: str, token_ids: list[int], entries: Entries, *, first: bool = False,
              finish: bool = False) -> dict:
        """One streamed event of choice `c`: new text and its tokens' logprobs (the chat's first event also
        says the role), or its finish."""
        choice = {"index": c.index, "logprobs": self._logprobs(entries, c, c.text_offset) if entries else None,
                  "finish_reason": c.finish_reason if finish else None}
        if self.request.chat:
            choice["delta"] = {} if finish else {"content": text} | ({"role": "assistant"} if first else {})
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice["text"] = text
            body = {**self._head("text_completion"), "choices": [choice]}
        if self.request.include_usage:
            body["usage"] = None
        self._extended(choice, c, token_ids, prompt=first)
        return self._body_extended(body, c, prompt=first)

    def chunks(self, c: Choice, events: list[Content | Call], token_ids: list[int], entries: Entries) -> list[dict]:
        """A piece's stream events: its content and calls in order, its tokens' logprobs (and ids) on the first
        content chunk, or on a chunk of their own where it begins with a call or holds no text."""
        out = []
        if (entries or self.request.return_token_ids) and not (events and isinstance(events[0], Content)):
            out.append(self.chunk(c, "", token_ids, entries))
            token_ids, entries = [], []
        for event in events:
            if isinstance(event, Call):
                out += self._call_chunks(c, event)
            elif event.text or entries or token_ids:
                out.append(self.chunk(c, event.text, token_ids, entries))
                token_ids, entries = [], []
        return out

    def _call_chunks(self, c: Choice, call: Call) -> list[dict]:
        """A call streamed as OpenAI streams one: its id, type and name, then its arguments."""
        head = {"index": call.index, "id": c.tool_calls[call.index]["id"], "type": "function",
                "function": {"name": call.name, "arguments": ""}}
        return [self._delta(c, {"tool_calls": [head]}),
                self._delta(c, {"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})]

    def _delta(self, c: Choice, delta: dict) -> dict:
        body = {**self._head("chat.completion.chunk"),
                "choices": [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]}
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        head = self._head("chat.completion.chunk" if self.request.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage()}

    # -- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, entries: Entries, c: Choice, offset: int) -> dict | None:
        if self.request.logprobs is None:
            return None
        if self.request.chat:
            return {"content": [self._chat_logprob(lp) for _, lp in entries if lp is not None], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in entries:
            text = self._text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {self._text(i): v for i, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        c.text_offset = offset
        return out

    def _chat_logprob(self, lp: TokenLogprob) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return {**one(lp.token_id, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}

    def _text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- extensions --------------------------------------------------------------------------
    def _extended(self, choice: dict, c: Choice, token_ids: list[int], *, prompt: bool = True) -> dict:
        if self.request.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt:
                choice["prompt_token_ids"] = list(c.prompt_token_ids)
        return choice

    def _body_extended(self, body: dict, c: Choice, *, prompt: bool) -> dict:
        """A choice's prompt ids and timings on the body too, where pp's own tools read them (the whole
        answer's: the first choice's)."""
        if self.request.return_token_ids:
            if prompt:
                body["prompt_token_ids"] = list(c.prompt_token_ids)
            if c.timings is not None:
                body["pp_timings"] = c.timings
        return body
