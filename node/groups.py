"""Reading trio's exception groups: a nursery wraps even a lone failure in a group."""
from __future__ import annotations

import contextlib

import trio


def leaves(exc: BaseException):
    """Every exception inside `exc`, groups opened."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


@contextlib.contextmanager
def unwrapped(*kinds: type[BaseException]):
    """Raise a `kinds` error out of a nursery's exception group as itself, for callers to catch."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = next((e for e in leaves(group) if isinstance(e, kinds) and not isinstance(e, trio.Cancelled)), None)
        if found is None:
            raise
        raise found from None
