"""Local node processes, each owned by the runner's nursery: started in order, supervised, and on
cancellation stopped with SIGTERM, then SIGKILL after a grace period. A child that exits on its own
while the runner still needs it is a failure that names its stage and shows the end of its log."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import trio

ADDR_PREFIX = "PP_GPU_NODE_ADDR="
STANDBY_READY = "PP_STANDBY_READY"  # a standby's line once it can take a stage (ppnode.py prints it)


class StageExited(RuntimeError):
    def __init__(self, stage: int | None, returncode: int | None, log_tail: str):
        who = "a standby" if stage is None else f"stage {stage}"
        super().__init__(f"{who} exited with code {returncode}; the end of its log:\n{log_tail}")
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
                    supervised: bool = False, wrapper: tuple[str, ...] = (),
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `ppnode.py` for `stage`; reports a Child once it printed its address; raises StageExited
    if it ever ends on its own — unless `supervised` and it had started: then it sets the Child's
    `exited` and returns (whoever supervises it replaces it). `wrapper`: a command that execs the node's
    (benchmarks hold a stage to a CPU quota from its start: bench/plan.py)."""
    with open(log_path, "wb") as log:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(_node_process, env, log, grace_s, wrapper)
            url = await Lines(process).value_of(ADDR_PREFIX)
            child = None if url is None else Child(stage, process, url, log_path)
            if child is not None:
                task_status.started(child)
    if child is not None:
        child.exited.set()
        if supervised:
            return
    raise StageExited(stage, process.returncode, log_tail(log_path))


@attrs.frozen(eq=False)
class Standby:
    """A warm spare's process (`ppnode.py --standby`, node/standby.py) once it is ready to take a stage."""

    process: trio.Process
    log_path: Path
    lines: Lines
    exited: trio.Event = attrs.field(factory=trio.Event)  # set when the process has ended, taken or not

    async def take(self, stage: int) -> Child:
        """Hand it `stage`: the Child once it listens as that stage's node; StageExited if it ends first."""
        try:
            await self.process.stdin.send_all(f"take {stage}\n".encode())
            url = await self.lines.value_of(ADDR_PREFIX)
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # it ended before it heard us
            url = None
        if url is None:
            await self.exited.wait()
            raise StageExited(stage, self.process.returncode, log_tail(self.log_path))
        return Child(stage, self.process, url, self.log_path, self.exited)


async def run_standby(env: dict[str, str], log_path: Path, *, grace_s: float = 5.0,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `ppnode.py --standby`; reports a Standby once it says it is ready, and returns when the process
    ends (the Standby's `exited` set; a taken one's Child shares it). One that ends before it is ready
    raises StageExited (stage None)."""
    with open(log_path, "wb") as log:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(_node_process, {**env, "PP_STANDBY": "1"}, log, grace_s)
            lines = Lines(process)
            standby = None if await lines.value_of(STANDBY_READY) is None else Standby(process, log_path, lines)
            if standby is not None:
                task_status.started(standby)
    if standby is None:
        raise StageExited(None, process.returncode, log_tail(log_path))
    standby.exited.set()


async def _node_process(env: dict[str, str], log, grace_s: float, wrapper: tuple[str, ...] = (),
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    command = [*wrapper, sys.executable, str(Path(__file__).resolve().parent.parent / "ppnode.py")]
    await trio.run_process(
        command, env=env, stdout=subprocess.PIPE, stderr=log, check=False,
        # our end of its stdin is a lifeline: if the runner dies, even by SIGKILL, the node reads EOF
        stdin=subprocess.PIPE, start_new_session=True,  # and Ctrl-C in a terminal reaches only us
        deliver_cancel=terminate_then_kill(grace_s), task_status=task_status)


class Lines:
    """A node's stdout, line by line."""

    def __init__(self, process: trio.Process):
        self._stdout, self._buffer = process.stdout, b""

    async def value_of(self, prefix: str) -> str | None:
        """What follows `prefix` on the next line that starts with it; None if stdout closed (exited) first."""
        while True:
            while b"\n" not in self._buffer:
                chunk = await self._stdout.receive_some()
                if not chunk:
                    return None
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            text = line.decode(errors="replace").strip()
            if text.startswith(prefix):
                return text[len(prefix):]


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
