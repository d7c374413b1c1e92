"""What crosses the network between the runner and the nodes: attrs types, one strict cattrs converter,
and the activation framing (JSON metadata beside raw float32 hidden bytes, no base64).

Anything unknown or malformed is refused whole with a message naming the field; nothing is half-applied.
"""
from __future__ import annotations

import json
import struct

import attrs
import cattrs
import cattrs.v
from cattrs.preconf.json import make_converter

from worker.sampling import GREEDY, Sampling

MAX_TOKENS_LIMIT = 1 << 16


class WireError(ValueError):
    """A message that cannot be accepted; the text names the field."""


@attrs.frozen
class InferenceRequest:
    request_id: str
    prompt: str
    max_tokens: int = 64
    sampling: Sampling = GREEDY
    chat: bool = True
    reply_to: str | None = None  # base URL to POST the response to; None: the exit node keeps it

    def __attrs_post_init__(self):
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise WireError(f"max_tokens: {self.max_tokens} is outside 1..{MAX_TOKENS_LIMIT}")
        if not self.request_id:
            raise WireError("request_id: empty")


@attrs.frozen
class RequestStart:
    """What the last stage needs to know about a request; travels with the prefill activation."""

    max_tokens: int
    sampling: Sampling
    prompt_token_ids: tuple[int, ...]


@attrs.frozen
class ActivationMeta:
    request_id: str
    position: int
    seq_len: int
    is_prefill: bool
    reply_to: str | None
    stage_ms: tuple[float, ...] = ()  # compute ms of each stage so far, for this step
    start: RequestStart | None = None  # on prefill only

    def __attrs_post_init__(self):
        if self.position < 0 or self.seq_len < 1:
            raise WireError(f"position {self.position} / seq_len {self.seq_len}: need position >= 0, seq_len >= 1")
        if self.is_prefill != (self.start is not None):
            raise WireError("start: present exactly when is_prefill is true")


@attrs.frozen
class Activation:
    meta: ActivationMeta
    hidden: bytes  # float32, (seq_len, hidden_dim), little-endian


@attrs.frozen
class NextToken:
    request_id: str
    token_id: int
    position: int  # where token_id is fed back in
    done: bool
    reply_to: str | None = None


@attrs.frozen
class InferenceResponse:
    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    stage_compute_ms: tuple[float, ...] = ()  # total compute per stage over the request
    decode_s: float = 0.0  # first token sampled to last, on the last stage's clock
    error: str | None = None
    failed_stage: int | None = None


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
    hidden = body[_META_LEN.size + n:]
    want = meta.seq_len * hidden_dim * 4
    if len(hidden) != want:
        raise WireError(f"hidden: {len(hidden)} bytes, expected seq_len {meta.seq_len} x hidden_dim "
                        f"{hidden_dim} x 4 (float32) = {want}")
    return Activation(meta, bytes(hidden))
