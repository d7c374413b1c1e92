"""pp serves no WebSocket: an upgrade to one is refused with a 4xx before the app sees it, logs no traceback, and
the node serves on (issue 33's second audit, finding 3), on an in-process cluster over real HTTP/1.1."""
import logging

import httpx
import trio

from cluster import API_KEY, TOKEN, start_cluster

UPGRADE = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
KEY = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


async def _status_of(url: str, head: str) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head.encode())
        answer = b""
        with trio.fail_after(10):
            while b"\r\n" not in answer and (chunk := await stream.receive_some(4096)):
                answer += chunk
    return answer.split(b"\r\n", 1)[0]


PATHS = [("/nope", None), ("/health", None), ("/", None), ("/v1/chat/completions", API_KEY),
         ("/v1/chat/completions", None), ("/v1/inference", TOKEN), ("/v1/pipeline", API_KEY)]


async def test_a_websocket_upgrade_is_refused_without_a_traceback_and_the_node_serves_on(nursery, tmp_path, caplog):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    with caplog.at_level(logging.INFO):
        for path, credential in PATHS:
            auth = f"Authorization: Bearer {credential}\r\n" if credential else ""
            for extra in (KEY, ""):  # with and without a Sec-WebSocket-Key
                status = await _status_of(urls[0], f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}{UPGRADE}{extra}\r\n")
                assert status.startswith(b"HTTP/1.1 4"), (path, credential, extra, status)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(urls[0] + "/health")).status_code == 200
    nursery.cancel_scope.cancel()
