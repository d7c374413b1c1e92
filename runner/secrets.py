"""ppsmoke's secrets: the cluster token, the clients' API keys and the vast.ai key, from flags, files and
the environment (a flag wins over its variable), checked before any node starts."""
from __future__ import annotations

import argparse

import attrs

from node.config.credentials import check_keys, read_key_file, split_keys
from node.config.sources import ConfigError


@attrs.frozen
class Secrets:
    token: str | None = attrs.field(repr=False)  # the cluster token; None: a random one per run
    api_keys: tuple[str, ...] = attrs.field(repr=False)  # the clients' keys; none: a random one, printed
    vast_api_key: str | None = attrs.field(repr=False)  # --vastai only


def secrets_of(args: argparse.Namespace, env: dict[str, str]) -> Secrets:
    """The run's secrets from flags, files and the environment (a flag wins over its variable). Raises
    ConfigError naming the flag or variable at fault, never a secret's value."""
    token = _token(args, env)
    keys = [key for text in (args.api_key or [env.get("PP_API_KEY") or ""])
            for key in split_keys(text, "--api-key" if args.api_key else "PP_API_KEY")]
    key_file, label = (args.api_key_file, "--api-key-file") if args.api_key_file else (
        (env.get("PP_API_KEY_FILE") or "").strip(), "PP_API_KEY_FILE")
    if key_file:
        keys += read_key_file(key_file, label)
    api_keys = check_keys(keys, token, label="--api-key")
    return Secrets(token, api_keys, _vast_api_key(args, env) if args.vastai else None)


def _token(args, env) -> str | None:
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--token-file {str(args.token_file)!r}: cannot read it: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        if not token or "\n" in token:
            raise ConfigError(f"--token-file {str(args.token_file)!r}: expected one line, the token")
        return token
    if args.token is not None:
        if not args.token.strip():
            raise ConfigError("--token is empty")
        return args.token.strip()
    return (env.get("PP_CLUSTER_TOKEN") or "").strip() or None


def _vast_api_key(args, env) -> str:
    """--api-key was vast.ai's key before it was the clients' (as vLLM's --api-key is): a run that gives one but
    no vast.ai key is refused rather than guessed at."""
    key = (args.vast_api_key or env.get("VAST_API_KEY") or "").strip()
    if key:
        return key
    if args.api_key:
        raise ConfigError("--api-key is the clients' API key now; give the vast.ai key as --vast-api-key "
                          "or VAST_API_KEY")
    raise ConfigError("--vastai needs your vast.ai API key: --vast-api-key or VAST_API_KEY")
