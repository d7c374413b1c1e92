"""runner/ports.py: before a replacement on a fixed port starts, the old process is stopped and the port is free.
The decision as a table; the driver against real processes that hold a port (real time, a second or two)."""
import socket
import subprocess
import sys

import pytest
import trio

from runner.ports import PortHeld, Step, next_step, port_is_free, stop_and_free_port

START, WAIT, KILL, FAIL = Step.START, Step.WAIT, Step.KILL, Step.FAIL


@pytest.mark.parametrize("exited,port_free,killed,waited_s,want", [
    (True, True, False, 0.0, START),  # gone and free: start at once
    (True, True, True, 12.0, START),
    (False, True, False, 1.0, WAIT),  # its socket may be closed, but a running process may still listen again
    (False, False, False, 1.0, WAIT),  # within the grace period after SIGTERM
    (False, False, False, 5.0, KILL),  # grace over
    (True, False, False, 5.0, KILL),  # exited, yet the port is taken (a child of its own?): same bound
    (False, False, True, 14.9, WAIT),  # SIGKILL sent: the kernel frees its sockets as it reaps it
    (True, False, True, 14.9, WAIT),
    (True, False, True, 15.0, FAIL),  # still taken 10 s after SIGKILL: someone else holds it
    (False, False, True, 15.0, FAIL),
])
def test_a_replacement_starts_only_once_its_predecessor_is_gone_and_the_port_free_within_a_bound(
        exited, port_free, killed, waited_s, want):
    assert next_step(exited=exited, port_free=port_free, killed=killed, waited_s=waited_s, grace_s=5.0,
                     free_after_kill_s=10.0) is want


HOLDER = """
import signal, socket, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
if sys.argv[2] == "ignores-sigterm":  # frozen, or too busy to act on it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:  # winds down for a while, still listening, then exits
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.6), sys.exit(0)))
print("listening", flush=True)
time.sleep(60)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def holding(nursery: trio.Nursery, port: int, how: str) -> trio.Process:
    """A process that listens on `port` (a stage's node, as far as its port goes), once it does."""
    process = await nursery.start(lambda task_status: trio.run_process(
        [sys.executable, "-c", HOLDER, str(port), how], stdout=subprocess.PIPE, check=False,
        task_status=task_status))
    said = b""
    while not said.endswith(b"\n"):
        said += await process.stdout.receive_some()
    assert said == b"listening\n"
    assert not port_is_free("127.0.0.1", port)
    return process


@pytest.mark.parametrize("how,killed", [("winds-down", False), ("ignores-sigterm", True)])
async def test_a_process_still_holding_the_port_is_stopped_and_the_port_free_before_the_call_returns(
        nursery, how, killed):
    port, lines = free_port(), []
    process = await holding(nursery, port, how)
    took_s = await stop_and_free_port(process, "127.0.0.1", port, grace_s=1.0, progress=lines.append)
    assert process.returncode is not None and port_is_free("127.0.0.1", port)
    assert took_s >= (1.0 if killed else 0.5)  # it did wait: the holder kept the port that long
    assert ["SIGKILL" in line for line in lines] == ([True] if killed else [])


async def test_a_port_someone_else_holds_fails_the_replacement_naming_the_port(nursery):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        process = await nursery.start(lambda task_status: trio.run_process(
            [sys.executable, "-c", "pass"], check=False, task_status=task_status))
        await process.wait()  # the old holder is gone; the port is not free all the same
        with pytest.raises(PortHeld, match=f"port 127.0.0.1:{port} is still taken \\(another process\\)"):
            await stop_and_free_port(process, "127.0.0.1", port, grace_s=0.2, free_after_kill_s=0.3,
                                     progress=lambda line: None)
