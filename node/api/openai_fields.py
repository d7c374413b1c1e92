"""OpenAI's wire format at pp-entry, its common ground: the error every refusal is, the body read as JSON
within a bound, and one field of it checked for its type, or a text for being text.

Errors are `{"error": {"message", "type", "param", "code"}}` with OpenAI's string codes; a body that is not
UTF-8 JSON (or is nested past what the parser recurses into) is one of them too, a 400.

Every value of a parsed body is one the rest of the system can take, whichever field it is in, known or not:
each string is text (JSON's \\ud800 escapes can spell a lone surrogate, which no encoder takes: one in a
cache_salt once failed deep in stage 0's prefix cache), and each number finite (1e400 parses as inf, and
Python reads NaN and Infinity, which JSON does not have). Both are checked once, here, naming the field; a
body can only hold either where its text shows a \\ud.. escape or its parser met such a number, so a plain body
is not walked. Integers are bounded where they are read: `field` refuses one past MAX_INT.
"""
from __future__ import annotations

import json
import math

BODY_SLACK_BYTES = 256 * 1024  # a body's JSON around its text: roles, parameters, stop strings, escaped
MAX_INT = 2 ** 64 - 1  # no parameter takes more (seed's range is 0..2**64 - 1); past it is out of range
_SHOWN_CHARS = 80  # of a value quoted back in an error


class ApiError(Exception):
    """A refusal in OpenAI's shape; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def body_limit(max_context: int, longest_token_bytes: int) -> int:
    """The most bytes a request body may have: its text can spell at most `max_context` tokens of at most
    `longest_token_bytes` bytes each, JSON writes a byte in at most 6 (\\u0001) and a token id in at most 12
    (digits and a comma), and the rest of the body is BODY_SLACK_BYTES."""
    return BODY_SLACK_BYTES + max_context * max(6 * longest_token_bytes, 12)


def parse_body(raw: bytes):
    """A request body as JSON, or an ApiError 400 saying what is wrong with it: not UTF-8, not JSON,
    nested deeper than the parser recurses (its C scanner raises RecursionError there, long before the
    stack is at risk), or a value that is not text or not a finite number (checked_values). CPU work in
    proportion to the body: call it in a worker thread."""
    nonfinite = []  # the number literals that parse as inf or NaN

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            nonfinite.append(literal)
        return value
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_float=number, parse_constant=number)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not UTF-8: {exc.reason} at byte {exc.start}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply to parse", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's 4300-digit limit
        raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if nonfinite or "\\ud" in text or "\\uD" in text:  # strict UTF-8 has no surrogates: only an escape makes one
        checked_values(body)
    return body


def checked_values(body) -> None:
    """Refuse (400, naming the field) a string in `body`, a key or a value, that is not text, or a number that is
    not finite: the first met, walking without recursion."""
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            checked_text(value, where or "body")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ApiError(400, f"{where or 'body'}: {value} is not a finite number", param=_param(where),
                           code="invalid_value")
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = _key_path(where, key)
                checked_text(key, inner)
                stack.append((item, inner))
        elif isinstance(value, list):
            stack += [(item, f"{where}[{i}]") for i, item in enumerate(value)]


def _key_path(where: str, key: str) -> str:
    if key.isidentifier() and key.isascii():
        return f"{where}.{key}" if where else key
    return f"{where}[{ascii(key)}]"  # ascii(): a key that is no text must still print


def _param(where: str) -> str | None:
    return where or None


def field(body: dict, key: str, kind, *, default=None, required: bool = False, name: str | None = None):
    name = name or key
    if key not in body or body[key] is None:
        if required:
            raise ApiError(400, f"{name}: required", param=name, code="missing_required_parameter")
        return default
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    numeric = float in kinds and isinstance(value, int)
    if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or numeric):
        want = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true or false",
                            dict: "an object", list: "an array"}[k] for k in kinds)
        raise ApiError(400, f"{name}: expected {want}, got {type(value).__name__} {shown(value)}", param=name,
                       code="invalid_type")
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT <= value <= MAX_INT:
        raise ApiError(400, f"{name}: an integer of {len(str(abs(value)))} digits is out of range", param=name,
                       code="invalid_value")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name}: {value} is not a finite number", param=name, code="invalid_value")
    return value


def shown(value) -> str:
    """A value as an error quotes it: its repr, cut to _SHOWN_CHARS (a client's megabyte is not echoed)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** _SHOWN_CHARS else f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def checked_text(text: str, name: str) -> str:
    """Text the rest of the system can encode: JSON's \\ud800-style escapes can make a lone surrogate, which
    is no character."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{name}: a lone surrogate (\\u{ord(text[exc.start]):04x}) at character "
                                f"{exc.start} is not text", param=_param(name), code="invalid_value") from None
    return text
