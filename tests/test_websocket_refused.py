"""pp serves no WebSocket: an upgrade to one is refused with a 4xx before the app sees it, logs no traceback, and
the node serves on (issue 33's second audit, finding 3), on an in-process cluster over real HTTP/1.1."""
import logging

import httpx
import trio

from cluster import API_KEY, MEMBER_TLS, TOKEN, api, start_cluster
from node.transport.tls import CLUSTER_SNI

UPGRADE = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
KEY = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
MEMBER = object()  # no header, on a connection that showed a member's certificate


async def _status_of(url: str, head: str, member: bool = False) -> bytes:
    host, port = url.split("://", 1)[-1].rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))  # stage 0's port takes plain HTTP/1.1
    if member:
        context = MEMBER_TLS.client_context()
        context.set_alpn_protocols(["http/1.1"])  # an upgrade is HTTP/1.1's (offered h2, the node picks it)
        stream = trio.SSLStream(stream, context, server_hostname=CLUSTER_SNI)
    async with stream:
        await stream.send_all(head.encode())
        answer = b""
        with trio.fail_after(10):
            while b"\r\n" not in answer and (chunk := await stream.receive_some(4096)):
                answer += chunk
    return answer.split(b"\r\n", 1)[0]


PATHS = [("/nope", None), ("/health", None), ("/", None), ("/v1/chat/completions", API_KEY),
         ("/v1/chat/completions", None), ("/v1/inference", TOKEN), ("/v1/inference", MEMBER), ("/v1/pipeline", API_KEY)]


async def test_a_websocket_upgrade_is_refused_without_a_traceback_and_the_node_serves_on(nursery, tmp_path, caplog):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    with caplog.at_level(logging.INFO):
        for path, credential in PATHS:
            auth = f"Authorization: Bearer {credential}\r\n" if credential not in (None, MEMBER) else ""
            for extra in (KEY, ""):  # with and without a Sec-WebSocket-Key
                status = await _status_of(urls[0], f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}{UPGRADE}{extra}\r\n",
                                          member=credential is MEMBER)
                assert status.startswith(b"HTTP/1.1 4"), (path, credential, extra, status)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(api(urls[0]) + "/health")).status_code == 200
    nursery.cancel_scope.cancel()
