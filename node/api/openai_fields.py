"""OpenAI's wire format at pp-entry, its common ground: the error every refusal is, the body read as JSON
within a bound, and one field of it checked for its type, or a text for being text.

Errors are `{"error": {"message", "type", "param", "code"}}` with OpenAI's string codes; a body that is not
UTF-8 JSON (or is nested past what the parser recurses into) is one of them too, a 400.
"""
from __future__ import annotations

import json

BODY_SLACK_BYTES = 256 * 1024  # a body's JSON around its text: roles, parameters, stop strings, escaped


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
    """A request body as JSON, or an ApiError 400 saying what is wrong with it: not UTF-8, not JSON, or
    nested deeper than the parser recurses (its C scanner raises RecursionError there, long before the
    stack is at risk)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not UTF-8: {exc.reason} at byte {exc.start}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply to parse", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's 4300-digit limit
        raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None


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
        raise ApiError(400, f"{name}: expected {want}, got {type(value).__name__} {value!r}", param=name,
                       code="invalid_type")
    return value


def checked_text(text: str, name: str) -> str:
    """Text to tokenize: JSON's \\ud800-style escapes can make a lone surrogate, which is no character."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{name}: a lone surrogate (\\u{ord(text[exc.start]):04x}) at character "
                                f"{exc.start} is not text", param=name, code="invalid_value") from None
    return text
