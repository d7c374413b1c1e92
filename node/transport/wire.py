"""How messages cross the network between the runner and the nodes: one strict cattrs converter and the
activation framing (JSON metadata beside raw float32 hidden bytes, no base64). The message types
themselves live in roles/messages.py, where the stage actors use them too.

Anything unknown or malformed is refused whole with a message naming the field; nothing is half-applied.
"""
from __future__ import annotations

import json
import struct

import cattrs
import cattrs.v
from cattrs.preconf.json import make_converter

from roles.messages import (
    MAX_TOKENS_LIMIT, Activation, ActivationMeta, CancelRequest, EndReason, EndRequest, InferenceRequest,
    InferenceResponse, NextTokens, RequestStart, SegmentMeta, Token, WireError)

__all__ = [  # the message types are re-exported: they are the wire's vocabulary
    "MAX_TOKENS_LIMIT", "Activation", "ActivationMeta", "CancelRequest", "EndReason", "EndRequest",
    "InferenceRequest", "InferenceResponse", "NextTokens", "RequestStart", "SegmentMeta", "Token", "WireError",
    "SENT_AT", "SENT_FROM", "body_of", "checked_activation", "converter", "decode", "encode", "encode_activation",
    "decode_activation"]

def _strict(kind: type, name: str):
    def check(value, _):
        # bool is an int in Python; JSON true is not a number here
        if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
            raise WireError(f"expected {name}, got {type(value).__name__} {value!r}")
        return value
    return check


def _make_converter() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(float, lambda v, _: float(_strict((int, float), "a number")(v, _)))
    return conv


converter = _make_converter()


def _format(exc: BaseException, type_) -> str:
    if isinstance(exc, (WireError, ValueError)) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def _describe(exc: Exception) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="body", format_exception=_format))
    return str(exc)


def decode(kind: type, data: bytes | str | dict):
    """Parse JSON (or an already-parsed dict) into `kind`, or raise WireError naming the field."""
    try:
        raw = json.loads(data) if isinstance(data, (bytes, str)) else data
        if not isinstance(raw, dict):
            raise WireError(f"body: expected a JSON object, got {type(raw).__name__}")
        return converter.structure(raw, kind)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"body is not JSON: {exc}") from None
    except (cattrs.BaseValidationError, WireError, ValueError, TypeError) as exc:
        raise WireError(_describe(exc)) from None


def encode(message) -> bytes:
    return json.dumps(converter.unstructure(message), separators=(",", ":")).encode()


_META_LEN = struct.Struct(">I")
SENT_FROM, SENT_AT = "X-PP-From", "X-PP-Sent-At"  # headers of a stage's POSTs: who sent it, and when
_PATHS = {InferenceRequest: "/v1/inference", NextTokens: "/v1/next-token", EndRequest: "/v1/end",
          CancelRequest: "/v1/cancel", InferenceResponse: "/v1/response"}


def body_of(message) -> tuple[str, bytes, str]:
    """A message as a POST: the endpoint for its type, the body, its content type."""
    if isinstance(message, Activation):
        return "/v1/activation", encode_activation(message), "application/octet-stream"
    return _PATHS[type(message)], encode(message), "application/json"


def encode_activation(act: Activation) -> bytes:
    """[u32 big-endian metadata length][metadata JSON][hidden bytes]."""
    meta = encode(act.meta)
    return _META_LEN.pack(len(meta)) + meta + act.hidden


def decode_activation(body: bytes, hidden_dim: int) -> Activation:
    if len(body) < _META_LEN.size:
        raise WireError("activation body shorter than its 4-byte metadata length")
    (n,) = _META_LEN.unpack_from(body)
    if n > len(body) - _META_LEN.size:
        raise WireError(f"activation metadata length {n} runs past the body ({len(body)} bytes)")
    meta = decode(ActivationMeta, body[_META_LEN.size:_META_LEN.size + n])
    return checked_activation(meta, bytes(body[_META_LEN.size + n:]), hidden_dim)


def checked_activation(meta: ActivationMeta, hidden: bytes, hidden_dim: int) -> Activation:
    """`meta`'s activation, refused (WireError) unless `hidden` holds its rows of hidden_dim float32s exactly:
    the one check of an activation's size, on a POST and on a link stream (frames.py) alike."""
    want = meta.rows * hidden_dim * 4
    if len(hidden) != want:
        raise WireError(f"hidden: {len(hidden)} bytes, expected {meta.rows} rows (the segments' seq_len) x "
                        f"hidden_dim {hidden_dim} x 4 (float32) = {want}")
    return Activation(meta, hidden)
