"""The vast.ai stand-in's instances and their "containers": a real node process per instance, started with
the environment vast.ai would give it, its mapped ports served by loopback TCP forwarders, and its output
kept as the instance's log."""
from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from runner.children import terminate_then_kill
from tools.standin_offers import LOOPBACK

log = logging.getLogger("pp.vastai_standin")
REPO = Path(__file__).resolve().parent.parent
LOG_CAP_BYTES = 1 << 20


# ---- the container: env, port mappings (pure) ----

def split_env(env: Mapping[str, object]) -> tuple[dict[str, str], list[int]]:
    """vast's env object: "K": "V" pairs are variables; "-p 8000:8000": "1" keys map TCP ports (UDP
    mappings and other docker options such as "-h name" are accepted and ignored here)."""
    plain, ports = {}, []
    for key, value in env.items():
        if not key.startswith("-"):
            plain[key] = str(value)
            continue
        flag, _, spec = key.partition(" ")
        internal, _, proto = spec.rpartition(":")[2].partition("/")
        if flag == "-p" and proto in ("", "tcp") and internal.isdigit():
            ports.append(int(internal))
    return plain, ports


def container_env(base: Mapping[str, str], plain: Mapping[str, str], *, node_port: int,
                  public: Mapping[int, int]) -> dict[str, str]:
    """The node's environment: ours (standing in for the image's), the create call's variables, and what
    vast.ai adds. The node listens on its own free `node_port`, since instances here share one machine;
    `public` maps each internal port to its forwarder, and the node's nominal PP_PORT maps to it too."""
    env = {k: v for k, v in base.items() if not k.startswith("VAST_TCP_PORT_") and k != "PUBLIC_IPADDR"}
    env.update(plain)
    env.update({f"VAST_TCP_PORT_{port}": str(forward) for port, forward in public.items()})
    nominal = plain.get("PP_PORT", "8000").strip()
    if nominal.isdigit() and int(nominal) in public:
        env[f"VAST_TCP_PORT_{node_port}"] = str(public[int(nominal)])
    env.update(PUBLIC_IPADDR=LOOPBACK, PP_BIND=LOOPBACK, PP_PORT=str(node_port),
               PYTHONUNBUFFERED="1", PP_STDIN_LIFELINE="1")  # if we are SIGKILLed, the node reads EOF and exits
    return env


def free_port() -> int:
    # Someone could take the port before the node binds it; on one test machine that risk is negligible.
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


# ---- instances ----

_CUR_STATE = {"created": "stopped", "loading": "running", "running": "running", "exited": "stopped"}


@attrs.define(eq=False)
class Instance:
    id: int
    ordinal: int            # 1 for the first instance created, 2 for the second, ...
    offer: dict
    body: dict
    start_date: float
    actual_status: str = "created"
    status_msg: str = "Creating container"
    ports: dict = attrs.Factory(dict)
    pid: int | None = None
    node_port: int | None = None
    log: bytearray = attrs.Factory(bytearray)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    done: trio.Event = attrs.Factory(trio.Event)

    def to_json(self) -> dict:
        row = {k: v for k, v in self.offer.items() if k not in ("id", "rentable", "rented", "bundle_id")}
        env = self.body.get("env") or {}
        row.update(
            id=self.id, actual_status=self.actual_status, intended_status="running", next_state="running",
            cur_state=_CUR_STATE[self.actual_status], status_msg=self.status_msg, public_ipaddr=LOOPBACK,
            ports=dict(self.ports), ssh_host=LOOPBACK, ssh_port=None, start_date=self.start_date,
            extra_env=[[k, str(v)] for k, v in env.items() if not k.startswith("-")], label=self.body.get("label"),
            image_uuid=self.body.get("image"), image_runtype=self.body.get("runtype"), onstart=self.body.get("onstart"),
            image_args=self.body.get("args") or [], disk_space=self.body.get("disk") or 10, gpu_util=None,
            disk_usage=None, disk_util=None, volume_info=None, template_id=None, template_name=None)
        return row


# ---- the container process and its port forwarders ----

async def run_container(inst: Instance, node_command: Sequence[str], *, grace_s: float,
                        die_after_s: float | None) -> None:
    """Run `inst`'s node process behind its port forwarders until it exits; `die_after_s` is an injected
    fault: kill the process that long after it starts running."""
    plain, mapped = split_env(inst.body.get("env") or {})
    node_port = free_port()
    nominal = plain.get("PP_PORT", "8000").strip()
    async with trio.open_nursery() as nursery:
        public = {p: await nursery.start(_serve_forward, node_port if str(p) == nominal else free_port())
                  for p in mapped}
        env = container_env(os.environ, plain, node_port=node_port, public=public)
        process = await nursery.start(functools.partial(
            trio.run_process, list(node_command), env=env, cwd=str(REPO), check=False,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, deliver_cancel=terminate_then_kill(grace_s)))
        inst.pid, inst.node_port, inst.ports = process.pid, node_port, _port_json(public)
        inst.actual_status, inst.status_msg = "running", "success, running"
        if die_after_s is not None:
            nursery.start_soon(_kill_after, process, die_after_s)
        async with process.stdin, process.stdout:
            await _capture(process.stdout, inst.log)
            await process.wait()
        inst.actual_status, inst.ports = "exited", {}
        inst.status_msg = f"Container exited with code {process.returncode}"
        log.info("instance %d: %s", inst.id, inst.status_msg)
        nursery.cancel_scope.cancel()  # its port mappings go with it


def mark_running_without_process(inst: Instance) -> None:
    """The --no-spawn stand-in for run_container: "running" with made-up port mappings, nothing behind them."""
    _, mapped = split_env(inst.body.get("env") or {})
    inst.ports = _port_json({p: 40000 + 10 * inst.ordinal + k for k, p in enumerate(mapped)})
    inst.actual_status, inst.status_msg = "running", "success, running (no process)"


def _port_json(public: Mapping[int, int]) -> dict:
    return {f"{p}/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(f)}] for p, f in public.items()}


async def _kill_after(process: trio.Process, delay_s: float) -> None:
    await trio.sleep(delay_s)
    process.kill()  # an injected fault: the host loses the container


async def _capture(stream: trio.abc.ReceiveStream, buffer: bytearray) -> None:
    async for chunk in stream:
        buffer += chunk
        del buffer[:max(len(buffer) - LOG_CAP_BYTES, 0)]


async def _serve_forward(target_port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A container port mapping: a free loopback port whose connections are piped to `target_port`."""
    listeners = await trio.open_tcp_listeners(0, host=LOOPBACK)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(functools.partial(_forward, target_port=target_port), listeners)


async def _forward(client: trio.SocketStream, *, target_port: int) -> None:
    try:
        upstream = await trio.open_tcp_stream(LOOPBACK, target_port)
    except OSError:
        return  # nothing listens inside (yet): the client sees the connection close, as with docker's proxy
    async with upstream, trio.open_nursery() as nursery:
        nursery.start_soon(_pump, client, upstream, nursery.cancel_scope)
        nursery.start_soon(_pump, upstream, client, nursery.cancel_scope)


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, both: trio.CancelScope) -> None:
    try:
        async for chunk in source:
            await sink.send_all(chunk)
        await sink.send_eof()  # a half-close passes through; the other direction may still be talking
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        both.cancel()  # one side reset: a proxy drops the whole connection

