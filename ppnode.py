#!/usr/bin/env python3
"""ppnode.py — run one pipeline stage: an HTTP/2 node holding a contiguous slice of a Llama model.

Configuration comes from the environment and flags (`python ppnode.py --help`). Once listening the
node prints one line `PP_GPU_NODE_ADDR=<advertised url>` on stdout; logs go to stderr, one JSON
object per line. SIGTERM or Ctrl-C stops it. Exit codes: 0 stopped, 1 the model could not be fetched,
2 a bad setting, a model file that is no usable model (one line naming the file and what is wrong) or a
port it cannot listen on, 3 the cluster declared it dead or gave its stage to
another node (it was frozen or cut off too long) — it steps aside rather than serve a stale slice.

With --standby (PP_STANDBY=1) the node is a warm spare (node/standby.py): it loads every stage but the first,
prints `PP_STANDBY_READY`, and waits for its runner's line `take <stage>` on stdin before it listens.
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # before the imports below, which are a part of a node's boot (bench/boot.py)

import functools
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from node.config.parse import parse_config
from node.observe.log import error_event, event, setup_logging
from node.transport.app import ListenError
from node.main import ModelLoadError, ModelRefused, Replaced, run_node
from node.standby import TakeRefused, run_standby


EXIT_REPLACED = 3  # the cluster gave this stage to another node (see node.main.Replaced)
STANDBY_READY = "PP_STANDBY_READY"  # a standby's line once its slices are loaded (runner/children.py reads it)


def announce(url: str, *, imported: float) -> None:
    print(f"PP_GPU_NODE_ADDR={url}", flush=True)
    # logged once listening: a node refused before that says one line only
    event(logging.getLogger("pp.node"), "imported", seconds=round(imported - STARTED, 3))


async def serve_until_signalled(config, imported: float) -> None:
    listening = functools.partial(announce, imported=imported)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
        lines_in, lines = trio.open_memory_channel(1) if config.standby else (None, None)
        if config.exit_on_stdin_eof:
            nursery.start_soon(_read_stdin, nursery.cancel_scope, lines_in)
        if config.standby:
            await run_standby(config, lines, on_ready=announce_standby, on_listening=listening)
        else:
            await run_node(config, on_listening=listening)
        nursery.cancel_scope.cancel()


def announce_standby() -> None:
    print(STANDBY_READY, flush=True)


async def _read_stdin(scope: trio.CancelScope, lines: trio.MemorySendChannel | None) -> None:
    """The local runner holds the other end of our stdin; if it dies, even by SIGKILL, we read EOF. A
    standby's runner also names on it the stage to take (node/standby.py): each line goes to `lines`."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buffer = b""
    async with stdin:
        while chunk := await stdin.receive_some():
            buffer += chunk
            while lines is not None and b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                await lines.send(line.decode(errors="replace"))
    scope.cancel()


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    imported = time.monotonic()
    config = parse_config(os.environ, sys.argv[1:] if argv is None else argv, home=Path.home())
    setup_logging(config.log_level, node_id=config.node_id)
    try:
        trio.run(serve_until_signalled, config, imported)
    except BaseExceptionGroup as group:
        refused, _ = group.split((ListenError, ModelRefused, TakeRefused))
        if refused is not None:  # a bad --port/--bind or model: argparse's convention, one line
            print(f"ppnode.py: error: {_first(refused)}", file=sys.stderr)
            return 2
        matched, _ = group.split((ModelLoadError, Replaced))
        if matched is None:
            raise
        matched = _first(matched)
        kind = "replaced" if isinstance(matched, Replaced) else "model_load_failed"
        error_event(logging.getLogger("pp.node"), kind, error=str(matched))
        return EXIT_REPLACED if isinstance(matched, Replaced) else 1
    return 0


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):  # nested nurseries nest the groups
        group = group.exceptions[0]
    return group


if __name__ == "__main__":
    sys.exit(main())
