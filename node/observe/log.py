"""Structured logging: one JSON object per line on stderr, so that logs of many nodes can be merged and filtered.

    event(log, "peer_joined", peer="stage1-3cf0b8b2", addr="http://10.0.0.6:8000")
    -> {"ts": "2025-01-02T03:04:05.678Z", "level": "INFO", "node": "stage0-1a2b3c4d", "logger": "pp.node",
        "event": "peer_joined", "peer": "stage1-3cf0b8b2", "addr": "http://10.0.0.6:8000"}

Nothing here knows about secrets: log `node.config.settings.loggable(config)` (or the config itself, whose
repr hides the cluster token), never the token.
"""
from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterable
from typing import TextIO

# Loggers that get the JSON handler: our own "pp" and the modules' `logging.getLogger(__name__)` trees.
DEFAULT_LOGGERS = ("pp", "node", "worker")
# The fields go into the LogRecord as this one attribute, so that a field called "msg", "args" or "name"
# cannot clash with the LogRecord's own attributes (logging refuses those in `extra`).
_FIELDS_ATTR = "pp_fields"
_BASE_KEYS = ("ts", "level", "node", "logger", "event")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (ISO-8601 UTC), level, node, logger, event, then the event's fields."""

    def __init__(self, node_id: str):
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": _iso_utc(record.created), "level": record.levelname, "node": self.node_id,
            "logger": record.name, "event": record.getMessage()}
        for key, value in getattr(record, _FIELDS_ATTR, {}).items():
            # A field named like a base key is kept under a prefix rather than overwrite it.
            line[f"field_{key}" if key in _BASE_KEYS else key] = _jsonable(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=repr, allow_nan=False)


def _iso_utc(created: float) -> str:
    stamp = datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(value: object) -> object:
    """`value` if JSON can carry it as it is (anything inside it that JSON lacks becomes its repr), else its repr.

    The fallback covers what `default=repr` cannot: non-string dict keys, cycles, NaN and infinities (which
    json would write as the non-JSON `NaN`).
    """
    try:
        json.dumps(value, default=repr, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


def setup_logging(level: str, *, node_id: str, stream: TextIO | None = None,
                  loggers: Iterable[str] = DEFAULT_LOGGERS) -> None:
    """Send `loggers` (and their children) at `level` and above to `stream` (default stderr) as JSON lines.

    Calling it again replaces the handler it installed before. The loggers stop propagating to the root
    logger, so that a root handler (logging.basicConfig, a library's) does not print each event a second time.
    """
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(node_id))
    for name in loggers:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h.formatter, JsonFormatter)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False


def event(logger: logging.Logger, name: str, /, **fields: object) -> None:
    """Log event `name` at INFO with `fields` (any names: "name", "msg" and "level" are fields too)."""
    _emit(logger, logging.INFO, name, fields)


def warn_event(logger: logging.Logger, name: str, /, **fields: object) -> None:
    _emit(logger, logging.WARNING, name, fields)


def error_event(logger: logging.Logger, name: str, /, **fields: object) -> None:
    """Log at ERROR; inside an `except` block, prefer `logger.exception(name, extra=as_extra(...))` for the
    traceback."""
    _emit(logger, logging.ERROR, name, fields)


def as_extra(**fields: object) -> dict[str, object]:
    """`fields` packed for a plain logging call's `extra=`, e.g. `log.exception("stage_failed", extra=...)`."""
    return {_FIELDS_ATTR: fields}


def _emit(logger: logging.Logger, level: int, name: str, fields: dict[str, object]) -> None:
    # stacklevel=3: the record's file and line are the caller's, not this module's.
    logger.log(level, "%s", name, extra={_FIELDS_ATTR: fields}, stacklevel=3)
