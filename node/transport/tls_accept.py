"""A node's port takes TLS (node/transport/tls.py), and on stage 0's API port plain HTTP too: which one a connection
speaks is read from its first byte (a TLS record of a handshake is 0x16; no HTTP request starts so).

A connection that shows a certificate of the cluster's CA is a member's: it is registered under its (host, port),
as hypercorn names the connection, and node/transport/app.py and stream_guard.py ask the registry rather than any
header. One that speaks plain HTTP to a port that carries only cluster traffic, or fails its handshake, is closed
without an HTTP byte, and a line says from where and why (the first few of a flood, then one in a thousand)."""
from __future__ import annotations

import collections
import logging
import ssl

import attrs
import trio

from node.transport.tls import member_id

TLS_HANDSHAKE_RECORD = 0x16
HANDSHAKE_S = 10.0  # a half-open handshake holds a parked task and a socket no longer than this
LOGGED = 20  # refusals of one kind logged before they are counted only (one in a thousand after)

log = logging.getLogger("pp.hypercorn")


@attrs.define
class ServerTls:
    """What a node's listener needs for TLS: its context, whether plain HTTP is served beside it (the client
    surface of stage 0's API; the cluster's routes refuse it), and the registry of members' connections."""

    context: ssl.SSLContext
    plaintext: bool = False
    members: dict[tuple, str] = attrs.Factory(dict)  # connection (host, port) -> the node id its certificate names
    refused: collections.Counter[str] = attrs.Factory(collections.Counter)


def is_member(members: dict[tuple, str], connection) -> bool:
    """Whether a connection, (host, port) as hypercorn names it, showed a member's certificate (ServerTls.members)."""
    return connection is not None and tuple(connection) in members


async def accept(stream, tls: ServerTls, peer: str, first: bytes):
    """The stream to serve a connection on (TLS, or `stream` itself where plain HTTP is served), with the member
    its certificate names (or None); (None, None) where it was refused and closed."""
    if first[:1] != bytes([TLS_HANDSHAKE_RECORD]):
        if tls.plaintext:
            return stream, None
        _refuse(tls, "plaintext", peer, "it spoke plain HTTP: this port speaks TLS only (members, and clients with "
                                        "an https:// address)")
        await trio.aclose_forcefully(stream)
        return None, None
    secured = trio.SSLStream(stream, tls.context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(HANDSHAKE_S):
            await secured.do_handshake()
    except trio.TooSlowError:
        _refuse(tls, "handshake_timeout", peer, f"its TLS handshake took more than {HANDSHAKE_S:g} s")
        await trio.aclose_forcefully(stream)
        return None, None
    except trio.BrokenResourceError as exc:
        _refuse(tls, "handshake", peer, f"its TLS handshake failed: {_why(exc)}")
        await trio.aclose_forcefully(stream)
        return None, None
    return secured, member_id(secured.getpeercert())


def _why(exc: BaseException) -> str:
    """What the handshake's failure says to an operator: a certificate of another CA is a node (or runner) started
    with another PP_CLUSTER_TOKEN."""
    cause = exc.__cause__ or exc.__context__
    text = getattr(cause, "reason", None) or str(cause or exc)
    if "CERTIFICATE" in text.upper() or "UNKNOWN_CA" in text.upper():
        return f"{text}: its certificate is not this cluster's (started with another PP_CLUSTER_TOKEN?)"
    if "EOF" in text.upper():  # the peer hung up once it had this node's certificate: it did not accept it
        return (f"{text}: the peer closed it half way, as one does that does not accept this node's certificate "
                f"(a node or runner started with another PP_CLUSTER_TOKEN?)")
    return text


def _refuse(tls: ServerTls, kind: str, peer: str, why: str) -> None:
    tls.refused[kind] += 1
    n = tls.refused[kind]
    if n <= LOGGED or n % 1000 == 0:
        log.warning("refused a connection from %s: %s (%d such so far)", peer, why, n)
