"""A real local cluster for benchmarks: ppnode.py processes and the runner's orchestrator, started as
`ppsmoke.py --seed` starts them, inside the caller's nursery."""
from __future__ import annotations

import functools
import os
import secrets
import tempfile
from pathlib import Path

import trio

from runner.orchestrator import Orchestrator, run_orchestrator
from runner.children import child_env, run_child


async def start_local_cluster(nursery: trio.Nursery, model: str, n: int, *, extra_env: dict[str, str] | None = None,
                              token: str | None = None, api_keys: tuple[str, ...] = ()
                              ) -> tuple[Orchestrator, list[str]]:
    """Start n stages of `model` and wait until pp-entry resolves; returns the orchestrator and stage URLs.
    `api_keys`: the clients' keys (none: the OpenAI API answers 401). Cancel the nursery to stop everything."""
    token, run_dir = token or secrets.token_urlsafe(16), Path(tempfile.mkdtemp(prefix="bench-"))
    orch = await nursery.start(functools.partial(run_orchestrator, token))
    urls, prev = [], None
    for stage in range(n):
        env = child_env({**os.environ, **(extra_env or {})}, stage=stage, num_stages=n, token=token, model=model,
                        seed=orch.url, peer=prev, api_keys=api_keys)
        child = await nursery.start(functools.partial(run_child, stage, env, run_dir / f"stage{stage}.log"))
        urls.append(prev := child.url)
    await orch.converge(n)
    return orch, urls
