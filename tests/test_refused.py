"""A refused connection is told apart from other failures: nothing listens at the address, so the member that
held it is gone (gossip declares it dead at once: node/membership/swim.py)."""
import socket

import pytest

from cluster import MEMBER_TLS
from node.transport.client import PeerClient, PeerError, connection_refused


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again on leaving: nothing listens there


async def test_a_post_to_a_port_nothing_listens_on_fails_as_refused():
    async with PeerClient(MEMBER_TLS, http2=False) as client:
        with pytest.raises(PeerError) as caught:
            await client.post(f"https://127.0.0.1:{closed_port()}", "/swim/ping", b"{}")
    assert caught.value.refused and caught.value.status is None


def test_only_a_refusal_of_every_attempt_counts():
    refused = ConnectionRefusedError(111, "Connection refused")
    assert connection_refused(OSError("all attempts failed").with_traceback(None)) is False
    group = ExceptionGroup("all attempts failed", [refused, TimeoutError()])
    assert connection_refused(group) is False
    assert connection_refused(ExceptionGroup("all attempts failed", [refused, refused])) is True
    wrapped = OSError("wrapped")
    wrapped.__cause__ = refused
    assert connection_refused(wrapped) is True
