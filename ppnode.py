#!/usr/bin/env python3
"""ppnode.py — run one pipeline stage: an HTTP/2 node holding a contiguous slice of a Llama model.

Configuration comes from the environment and flags (`python ppnode.py --help`). Once listening the
node prints one line `PP_GPU_NODE_ADDR=<advertised url>` on stdout; logs go to stderr, one JSON
object per line. SIGTERM or Ctrl-C stops it.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import trio

from node.config import parse_config
from node.log import setup_logging
from node.main import run_node


def announce(url: str) -> None:
    print(f"PP_GPU_NODE_ADDR={url}", flush=True)


async def serve_until_signalled(config) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
        await run_node(config, on_listening=announce)


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    config = parse_config(os.environ, sys.argv[1:] if argv is None else argv, home=Path.home())
    setup_logging(config.log_level, node_id=config.node_id)
    trio.run(serve_until_signalled, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
