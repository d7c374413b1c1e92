"""A replacement never races its predecessor for a port: `ppsmoke.py --seed --serve --port P` with stage 0 frozen
(SIGSTOP) until gossip declares it dead. The frozen process still holds P; the runner stops it and waits for P
to be free, and the replacement serves on P. Real processes on the stub model, about half a minute."""
import os
import re
import signal
import socket

import httpx
import pytest

from served import serving
from test_smoke_seed import wait_for_line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_stage_0_frozen_on_its_fixed_port_is_stopped_and_its_replacement_serves_on_that_port():
    port = free_port()
    with serving(["--model", "stub", "--port", str(port)], stages=2) as served:
        pid = int(re.search(rf"stage 0/1 listening at https://127.0.0.1:{port} \(pid (\d+)\)", served.booted).group(1))
        os.kill(pid, signal.SIGSTOP)  # frozen: declared dead in seconds, yet it holds the port until it is killed
        after = "".join(wait_for_line(served.proc.stderr, "stage 0 replaced in", 120))
        assert "replacement 1 failed" not in after and "Address already in use" not in after, after
        assert f"pid {pid} still holds 127.0.0.1:{port}" in after and "SIGKILL" in after, after
        assert not pid_alive(pid)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200
