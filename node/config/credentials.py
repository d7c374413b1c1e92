"""The secrets: the cluster token (the nodes' own, from the environment only), the clients' API keys (flags,
a variable or a key file) and stage 0's API certificate. A message names a key by its place, never by its value; ppsmoke checks its keys with
the same functions."""
from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path

from node.config.sources import ConfigError, Sources
from node.transport.tls import api_context

TOKEN_ENV = "PP_CLUSTER_TOKEN"
API_KEY_ENV, API_KEY_FILE_ENV, TOKEN_IS_API_KEY_ENV = "PP_API_KEY", "PP_API_KEY_FILE", "PP_TOKEN_IS_API_KEY"

# A key travels in an Authorization header and, from the runner to its nodes, in PP_API_KEY (comma-separated):
# visible ASCII, no spaces, no commas.
KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}


def cluster_token(environ: Mapping[str, str]) -> str:
    # Surrounding whitespace is stripped: `$(cat token-file)` and friends often leave a newline.
    token = (environ.get(TOKEN_ENV) or "").strip()
    if not token:
        raise ConfigError(f"{TOKEN_ENV} is not set: every node of a cluster needs the same secret token, "
                          "given in the environment only")
    return token


def client_api_keys(src: Sources, token: str, *, token_is_api_key: bool) -> tuple[str, ...]:
    """The client API keys: those of --api-key (or PP_API_KEY) and of --api-key-file (or PP_API_KEY_FILE)."""
    raw, label = src.get("--api-key")
    texts = raw if isinstance(raw, list) else [raw or ""]  # a list when given as repeated flags
    keys = [key for text in texts for key in split_keys(text, label)]
    path, path_label = src.get("--api-key-file")
    if path is not None and path.strip():
        keys += read_key_file(path.strip(), path_label)
    return check_keys(keys, token, label="client API keys", token_is_api_key=token_is_api_key)


def split_keys(text: str, label: str) -> list[str]:
    """Comma-separated keys; blanks around them are dropped. A message names the key by position, never by value."""
    keys = [part.strip() for part in text.split(",") if part.strip()]
    for n, key in enumerate(keys, 1):
        if not set(key) <= KEY_CHARS:
            raise ConfigError(f"{label}: key {n} holds a space or a character outside visible ASCII")
    return keys


def read_key_file(path: str, label: str) -> list[str]:
    """One key a line; blank lines are skipped, blanks around a key dropped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{label}={path!r}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not set(key) <= KEY_CHARS:
            raise ConfigError(f"{label}={path!r}: line {n} holds a space, a comma or a character outside "
                              "visible ASCII")
        keys += [key] if key else []
    if not keys:
        raise ConfigError(f"{label}={path!r} holds no key")
    return keys


def check_keys(keys: list[str], token: str | None, *, label: str, token_is_api_key: bool = False) -> tuple[str, ...]:
    """The keys without repeats, refused if one is the cluster token: it would open the cluster to clients."""
    if token is not None and token in keys and not token_is_api_key:
        raise ConfigError(f"{label}: one of them is the cluster token ({TOKEN_ENV}); a client holding it could "
                          f"steer the cluster: give the clients a key of their own (or set "
                          f"{TOKEN_IS_API_KEY_ENV}=1 to let the token open the client surface too)")
    return tuple(dict.fromkeys(keys))


def api_tls(src: Sources) -> tuple[str, str] | None:
    """Stage 0's API certificate and key (--tls-cert, --tls-key): both or neither, loaded once here so that a wrong
    path or a key that does not match fails at boot, named."""
    (cert, cert_label), (key, key_label) = src.get("--tls-cert"), src.get("--tls-key")
    cert, key = (cert or "").strip(), (key or "").strip()
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError(f"{cert_label} and {key_label} go together: give both (a PEM certificate chain and its key)")
    try:
        api_context(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{cert_label}={cert!r}, {key_label}={key!r}: cannot load them: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    return cert, key
