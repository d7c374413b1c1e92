"""Where a node listens, how the others reach it, and what its links carry: the port and bind address, the seed
and direct peers, the address it advertises (vast.ai's public mapping included), the body limit, link streams
and injected link faults."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from node.config.sources import ConfigError, Sources, whole_number
from node.transport.faults import Faults, FaultSpecError, parse_faults

if TYPE_CHECKING:
    from node.config.settings import NodeConfig

DEFAULT_PORT = 8000
DEFAULT_BIND = "0.0.0.0"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # a few prefill activations of an 8B model, with room to spare
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK = "127.0.0.1"
SCHEME = "https"  # every member's port speaks TLS (node/transport/tls.py)


def advertised_url(config: NodeConfig, bound_port: int) -> str:
    """The base URL other nodes should use to reach this one, once the listener is bound to `bound_port`."""
    if config.advertise_addr:
        return config.advertise_addr
    if config.public_ip and config.public_port:
        return f"{SCHEME}://{_url_host(config.public_ip)}:{config.public_port}"
    # A wildcard bind is reachable on loopback; without better information that is the only safe guess.
    host = LOOPBACK if config.bind_host in WILDCARD_HOSTS else config.bind_host
    return f"{SCHEME}://{_url_host(host)}:{bound_port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def normalise_url(raw: str, label: str) -> str:
    """A member's address: `host:port` -> `https://host:port`, no trailing slash; refuses anything but a plain
    http(s) base URL. Members speak TLS only, so an http:// address (an older recipe's) is taken as https://."""
    text = raw.strip()
    if "://" not in text:
        text = f"{SCHEME}://" + text
    text = text.rstrip("/")
    if text.lower().startswith("http://"):
        text = f"{SCHEME}://" + text[len("http://"):]
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 -- urlsplit checks the port only when asked
    except ValueError:
        raise ConfigError(f"{label}={raw!r}: the port is not a number in 0..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{label}={raw!r} is not an http(s) address such as http://10.0.0.5:8000")
    if parts.path or parts.query or parts.fragment:
        raise ConfigError(f"{label}={raw!r}: give a base address without a path, e.g. http://10.0.0.5:8000")
    return text


def optional_url(raw: str | None, label: str) -> str | None:
    return normalise_url(raw, label) if raw and raw.strip() else None


def peer_urls(raw: str | list[str] | None, label: str) -> tuple[str, ...]:
    texts = raw if isinstance(raw, list) else [raw or ""]  # a list when given as repeated flags
    entries = [part for text in texts for part in text.split(",") if part.strip()]
    return tuple(normalise_url(entry, label) for entry in entries)


def listen_port(src: Sources) -> int:
    raw, label = src.get("--port")
    if raw is None or not raw.strip():
        return DEFAULT_PORT
    return _port_number(raw, label, lowest=0, note=" (0 = any free port)")


def public_port(environ: Mapping[str, str], port: int) -> int | None:
    """vast.ai's VAST_TCP_PORT_<port>: the public port mapped to the one we listen on."""
    name = f"VAST_TCP_PORT_{port}"
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return _port_number(raw, name, lowest=1)


def _port_number(raw: str, label: str, *, lowest: int, note: str = "") -> int:
    port = whole_number(raw, label)
    if not lowest <= port <= 65535:
        raise ConfigError(f"{label}={port} is outside {lowest}..65535{note}")
    return port


def max_body(environ: Mapping[str, str]) -> int:
    raw = environ.get("PP_MAX_BODY")
    if raw is None or not raw.strip():
        return DEFAULT_MAX_BODY_BYTES
    size = whole_number(raw, "PP_MAX_BODY")
    if size < 1:
        raise ConfigError(f"PP_MAX_BODY={size} must be a positive number of bytes")
    return size


def link_streams(src: Sources) -> bool:
    raw, label = src.get("--links")
    kind = (raw or "stream").strip().lower()
    if kind not in ("stream", "post"):
        raise ConfigError(f"{label}={raw!r}: expected stream or post")
    return kind == "stream"


def link_faults(environ: Mapping[str, str]) -> Faults:
    try:
        return parse_faults(environ.get("PP_FAULTS"))
    except FaultSpecError as exc:
        raise ConfigError(f"PP_FAULTS: {exc}") from None
