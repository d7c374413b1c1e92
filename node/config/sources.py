"""Where a setting's raw value comes from (its flag, else its environment variable) and the checks every kind of
setting shares: whole numbers, counts, 0/1 switches. Each message names the flag or variable the value came from."""
from __future__ import annotations

from collections.abc import Mapping

import attrs


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable or flag it came from."""


@attrs.frozen
class Sources:
    flags: Mapping[str, object] = attrs.field(repr=False)  # they may hold client API keys
    environ: Mapping[str, str] = attrs.field(repr=False)  # it holds the cluster token
    env_of_flag: Mapping[str, str] = attrs.field(repr=False)  # the variable each flag stands for

    def get(self, flag: str) -> tuple[object | None, str]:
        """The raw value for `flag` (flag first, then its variable) and the name to blame in errors."""
        value = self.flags[flag.removeprefix("--").replace("-", "_")]
        if value is not None:
            return value, flag
        env = self.env_of_flag[flag]
        return self.environ.get(env), env


def whole_number(raw: str, label: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{label}={raw!r} is not a whole number") from None


def required_int(src: Sources, flag: str) -> int:
    raw, label = src.get(flag)
    if raw is None or not raw.strip():
        raise ConfigError(f"{src.env_of_flag[flag]} is not set (or pass {flag})")
    return whole_number(raw, label)


def text(src: Sources, flag: str) -> str:
    raw, _ = src.get(flag)
    return (raw or "").strip()


def count(src: Sources, flag: str, default: int, *, lowest: int) -> int:
    raw, label = src.get(flag)
    if raw is None or not raw.strip():
        return default
    value = whole_number(raw, label)
    if value < lowest:
        raise ConfigError(f"{label}={value} must be at least {lowest}")
    return value


def switch(src: Sources, flag: str) -> bool:
    raw, label = src.get(flag)
    raw = (raw or "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{label}={raw!r}: use 1 or 0")
    return raw == "1"


def env_switch(environ: Mapping[str, str], name: str) -> bool:
    """A 0/1 setting that has a variable and no flag."""
    raw = (environ.get(name) or "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}={raw!r}: use 1 or 0")
    return raw == "1"
