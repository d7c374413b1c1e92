"""A model's output read back into OpenAI tool calls as it streams, in the family's own format
(worker/tool_formats.py): content text is released as soon as it cannot be the start of a call, and a call
only once it is complete and valid. Pure: no I/O, and what comes out never depends on how the output was cut
into pieces (parse_whole is push of the whole text, then finish).

What each family's calls look like, and where they may come:
  hermes       `<tool_call>` {"name", "arguments"} `</tool_call>`, anywhere, as many as the model likes; one
               never closed counts at the end if what follows its tag is a whole valid call.
  generic      the same tags, holding one such object or a non-empty array of them.
  mistral      `[TOOL_CALLS]` anywhere, then a JSON array of {"name", "arguments"} up to the end.
  llama3_json  at the very start only (after whitespace): `<|python_tag|>` or not, then {"name",
               "parameters"} objects joined by `;`, up to the end.
"arguments" may be an object or a JSON string spelling one (some models write it so), in every family.

A call that does not parse, has the wrong shape, or names a function the request did not offer is content,
exactly as the model wrote it, markers and all: a region (one tag's payload, a mistral array, llama's whole
run of objects) is all calls or all content. Whitespace-only content next to calls is no content at all: a
stretch of it waits for the text after it and goes with it, or is dropped when a call comes (and at the end
of an answer that made one). With `parallel` off, only the first valid call is returned, as vLLM does.

Work is linear in the output: a marker is looked for in the new piece and the short tail held back before it,
and each call region is parsed once, when it closes or at the end.
"""
from __future__ import annotations

import json
import re
from typing import Iterable

import attrs

from worker.tool_formats import (FAMILIES, GENERIC, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_TOOL_CALLS, PYTHON_TAG,
                                 TOOL_CALL_CLOSE, TOOL_CALL_OPEN)

_CONTENT, _CALL, _START, _PLAIN = "content", "call", "start", "plain"  # _START, _PLAIN: llama3_json's own
_OPENING = {HERMES: TOOL_CALL_OPEN, GENERIC: TOOL_CALL_OPEN, MISTRAL: MISTRAL_TOOL_CALLS}
_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's four whitespace characters, no more


@attrs.frozen
class Content:
    """Text that is the answer's content."""

    text: str


@attrs.frozen
class Call:
    """One complete, valid tool call; `index` counts the calls returned in this answer from 0."""

    index: int
    name: str
    arguments: str  # the arguments object as JSON text: json.dumps(obj, ensure_ascii=False)


class ToolParser:
    """One answer's output in, content and tool calls out: `push` each new piece, then `finish` once.

    In content mode the text is released at once but for a tail that may begin the family's opening marker
    (for llama3_json, only at the start of the output); from the marker on, the call region is held whole until
    it closes (hermes, generic) or the output ends (mistral, llama3_json), then returned as calls or as the
    content it was. Whitespace-only content waits, as the module says."""

    def __init__(self, family: str, names: Iterable[str], *, parallel: bool = True):
        if family not in FAMILIES:
            raise ValueError(f"tool-call family {family!r} is not one of {', '.join(FAMILIES)}")
        self.family, self.names, self.parallel = family, frozenset(names), parallel
        self._mode = _START if family == LLAMA3_JSON else _CONTENT
        self._tail = ""  # content mode: what may begin the opening marker, not yet content
        self._region: list[str] = []  # call mode: the region's raw text so far, its marker included
        self._close_tail = ""  # call mode (hermes, generic): the payload's last characters, before the new piece
        self._space: list[str] = []  # whitespace-only content of the stretch since the last call
        self._texty = False  # whether that stretch has had other content, so that its whitespace flows too
        self._calls = 0
        self._out: list[Content | Call] = []

    def push(self, text: str) -> list[Content | Call]:
        """A new piece of the model's output: what can be told of it now, content and whole calls."""
        self._out = []
        while text:
            text = self._step(text)
        return _merged(self._out)

    def finish(self) -> list[Content | Call]:
        """The output is over: a region still open is parsed as it stands, and what was held back goes out."""
        self._out = []
        if self._mode == _CALL:
            self._close()
        elif self._tail:  # the output ended partway into what looked like a marker: it was content
            self._content(self._tail)
        self._tail = ""
        if not self._calls and self._space:  # an answer with no call keeps its whitespace
            self._out.append(Content("".join(self._space)))
        self._space = []
        return _merged(self._out)

    def _step(self, text: str) -> str:
        """Read from the start of `text`, up to where the mode changes; the rest is returned unread."""
        if self._mode == _START:
            return self._start(text)
        if self._mode == _PLAIN:
            self._content(text)
            return ""
        if self._mode == _CALL:
            return self._in_call(text)
        marker = _OPENING[self.family]
        window = self._tail + text  # the tail is shorter than the marker: the search stays local
        at = window.find(marker)
        if at < 0:
            keep = _marker_start(window, marker)
            self._content(window[:len(window) - keep])
            self._tail = window[len(window) - keep:]
            return ""
        self._content(window[:at])
        self._mode, self._tail, self._region, self._close_tail = _CALL, "", [marker], ""
        return window[at + len(marker):]

    def _start(self, text: str) -> str:
        """llama3_json before its first non-whitespace: a call region if the output opens with `{` or the
        python tag, all content otherwise."""
        if not self._tail:
            rest = text.lstrip()
            self._content(text[:len(text) - len(rest)])
            text = rest
            if not text:
                return ""
        window = self._tail + text
        if window.startswith(("{", PYTHON_TAG)):
            self._mode, self._tail, self._region = _CALL, "", [window]
        elif PYTHON_TAG.startswith(window):
            self._tail = window
        else:
            self._mode, self._tail = _PLAIN, ""
            self._content(window)
        return ""

    def _in_call(self, text: str) -> str:
        """Call mode: hermes and generic close at their tag; the other families' regions run to the end."""
        if self.family not in (HERMES, GENERIC):
            self._region.append(text)
            return ""
        window = self._close_tail + text
        at = window.find(TOOL_CALL_CLOSE)
        if at < 0:
            self._region.append(text)
            self._close_tail = window[-(len(TOOL_CALL_CLOSE) - 1):]
            return ""
        end = at + len(TOOL_CALL_CLOSE) - len(self._close_tail)  # in `text`, just past the tag
        self._region.append(text[:end])
        self._close()
        return text[end:]

    def _close(self) -> None:
        """The region is complete (or the output is over): its calls, or its raw text as content."""
        raw, self._region, self._close_tail, self._mode = "".join(self._region), [], "", _CONTENT
        calls = _region_calls(self.family, raw, self.names)
        if calls is None:
            self._content(raw)
            return
        for name, arguments in calls:
            if self.parallel or not self._calls:
                self._out.append(Call(self._calls, name, arguments))
                self._calls += 1
        self._space, self._texty = [], False  # the whitespace before a call goes, and a new stretch begins

    def _content(self, text: str) -> None:
        """Text known to be content: out now, unless it is whitespace in a stretch that has had nothing else."""
        if not text:
            return
        if not self._texty:
            if text.isspace():
                self._space.append(text)
                return
            text, self._space, self._texty = "".join(self._space) + text, [], True
        self._out.append(Content(text))


def parse_whole(family: str, text: str, names: Iterable[str], *, parallel: bool = True) -> tuple[str, list[Call]]:
    """The whole output at once: (content text joined, calls); equals push(text) + finish()."""
    parser = ToolParser(family, names, parallel=parallel)
    events = parser.push(text) + parser.finish()
    return "".join(e.text for e in events if isinstance(e, Content)), [e for e in events if isinstance(e, Call)]


def _merged(events: list[Content | Call]) -> list[Content | Call]:
    """Neighbouring contents as one."""
    out: list[Content | Call] = []
    for e in events:
        if out and isinstance(e, Content) and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _region_calls(family: str, raw: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """A region's calls as (name, arguments' JSON text), or None where any of it is malformed. Never raises on
    what the model wrote: too deep a nesting (RecursionError) is malformed too."""
    try:
        if family == LLAMA3_JSON:
            objects = _llama_objects(raw[len(PYTHON_TAG):] if raw.startswith(PYTHON_TAG) else raw)
        elif family == MISTRAL:
            objects = _loads(raw[len(MISTRAL_TOOL_CALLS):])
        else:
            payload = raw[len(TOOL_CALL_OPEN):]
            payload = payload[:-len(TOOL_CALL_CLOSE)] if payload.endswith(TOOL_CALL_CLOSE) else payload
            objects = _loads(payload)
            objects = objects if family == GENERIC and isinstance(objects, list) else [objects]
        if not isinstance(objects, list) or not objects:
            return None
        calls = [_call(o, names, "parameters" if family == LLAMA3_JSON else "arguments") for o in objects]
    except (ValueError, RecursionError):
        return None
    return None if None in calls else calls


def _llama_objects(text: str) -> list | None:
    """llama3_json's run of JSON values joined by `;` (whitespace around them allowed), or None if anything
    else is there."""
    decoder, objects, at = json.JSONDecoder(parse_constant=_refuse_constant), [], 0
    while True:
        value, at = decoder.raw_decode(text, _JSON_SPACE.match(text, at).end())
        objects.append(value)
        at = _JSON_SPACE.match(text, at).end()
        if at == len(text):
            return objects
        if text[at] != ";":
            return None
        at += 1


def _call(value, names: frozenset[str], key: str) -> tuple[str, str] | None:
    """One call object's (name, arguments' JSON text), or None if it is not a valid call of one of `names`.
    llama3_json's "parameters" may be spelled "arguments"."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or name not in names:
        return None
    key = key if key in value else "arguments"
    if key not in value:
        return None
    arguments = value[key]
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _loads(text: str):
    return json.loads(text, parse_constant=_refuse_constant)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: Python's json takes them, JSON does not
