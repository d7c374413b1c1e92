"""Local node processes, each owned by the runner's nursery: started in order, supervised, and on
cancellation stopped with SIGTERM, then SIGKILL after a grace period. A child that exits on its own
while the runner still needs it is a failure that names its stage and shows the end of its log."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import attrs
import trio

ADDR_PREFIX = "PP_GPU_NODE_ADDR="


class StageExited(RuntimeError):
    def __init__(self, stage: int, returncode: int | None, log_tail: str):
        super().__init__(f"stage {stage} exited with code {returncode}; the end of its log:\n{log_tail}")
        self.stage, self.returncode, self.log_tail = stage, returncode, log_tail


@attrs.frozen
class Child:
    stage: int
    process: trio.Process
    url: str
    log_path: Path
    exited: trio.Event = attrs.field(factory=trio.Event, eq=False)  # set when the process has ended


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty)"


def terminate_then_kill(grace_s: float):
    """trio.run_process's deliver_cancel: SIGTERM, then SIGKILL if still there after grace_s."""
    async def deliver(process: trio.Process) -> None:
        process.terminate()
        with trio.move_on_after(grace_s):
            await process.wait()
            return
        process.kill()
    return deliver


async def run_child(stage: int, env: dict[str, str], log_path: Path, *, grace_s: float = 5.0,
                    supervised: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `ppnode.py` for `stage`; reports a Child once it printed its address; raises StageExited
    if it ever ends on its own — unless `supervised` and it had started: then it sets the Child's
    `exited` and returns (whoever supervises it replaces it)."""
    command = [sys.executable, str(Path(__file__).resolve().parent.parent / "ppnode.py")]
    with open(log_path, "wb") as log:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(functools.partial(
                trio.run_process, command, env=env, stdout=subprocess.PIPE, stderr=log, check=False,
                # our end of its stdin is a lifeline: if the runner dies, even by SIGKILL, the node reads EOF
                stdin=subprocess.PIPE, start_new_session=True,  # and Ctrl-C in a terminal reaches only us
                deliver_cancel=terminate_then_kill(grace_s)))
            url = await _read_address(process)
            child = None if url is None else Child(stage, process, url, log_path)
            if child is not None:
                task_status.started(child)
    if child is not None:
        child.exited.set()
        if supervised:
            return
    raise StageExited(stage, process.returncode, log_tail(log_path))


async def _read_address(process: trio.Process) -> str | None:
    """The URL from the child's `PP_GPU_NODE_ADDR=` line; None if it closed stdout (exited) first."""
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = await process.stdout.receive_some()
            if not chunk:
                return None
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        text = line.decode(errors="replace").strip()
        if text.startswith(ADDR_PREFIX):
            return text[len(ADDR_PREFIX):]


def child_env(base: dict[str, str], *, stage: int, num_stages: int, token: str, model: str, seed: str,
              peer: str | None, max_body: int | None = None, api_keys: tuple[str, ...] = ()) -> dict[str, str]:
    """A node's environment: `base` with its stage, the cluster token and the clients' keys (`api_keys`, none:
    the node serves no client) set here, never on its command line, where every local user could read them.
    The runner's own vast.ai key, and key files it has read already, are not passed on."""
    env = {**base, "STAGE": str(stage), "NUM_STAGES": str(num_stages), "PP_CLUSTER_TOKEN": token, "MODEL": model,
           "SEED_ADDR": seed, "PP_PORT": "0", "PP_BIND": "127.0.0.1", "PYTHONUNBUFFERED": "1",
           "PP_STDIN_LIFELINE": "1"}
    for name in ("PEER_DIRECT", "PP_API_KEY", "PP_API_KEY_FILE", "VAST_API_KEY"):
        env.pop(name, None)
    if peer:
        env["PEER_DIRECT"] = peer
    if api_keys:
        env["PP_API_KEY"] = ",".join(api_keys)
    return env
