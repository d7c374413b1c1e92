"""Membership's routes: the SWIM messages between members (node/membership/swim.py), and the member list."""
from __future__ import annotations

from typing import Protocol

from quart import Response, jsonify, request
from quart_trio import QuartTrio

from roles.actions import Refused

from node.membership import gossip
from node.membership.swim import Swim, WrongTargetError
from node.transport import wire

GOSSIP_MAX_BODY = 1 << 19  # a gossip message of gossip.MAX_ENTRIES member records is about 64 KiB


class GossipDispatcher(Protocol):
    """Whose membership the gossip routes serve: a stage node or the runner."""

    swim: Swim | None  # None until membership runs: a 503


def add_gossip_routes(app: QuartTrio, member: GossipDispatcher) -> None:
    @app.get("/v1/members")
    async def members():
        return jsonify({"members": wire.converter.unstructure(list(_swim(member).members().values()))})

    @app.post("/swim/ping")
    async def ping():
        msg = wire.decode(gossip.Ping, await _gossip_body())
        try:
            ack = await _swim(member).on_ping(msg)
        except WrongTargetError as exc:
            raise Refused(409, str(exc)) from None
        return Response(wire.encode(ack), content_type="application/json")

    @app.post("/swim/ping-req")
    async def ping_req():
        msg = wire.decode(gossip.PingReq, await _gossip_body())
        answer = await _swim(member).on_ping_req(msg)
        key = "ack" if isinstance(answer, gossip.Ack) else "nack"
        return jsonify({key: wire.converter.unstructure(answer)})

    @app.post("/swim/sync")
    async def sync():
        msg = wire.decode(gossip.Sync, await _gossip_body())
        return Response(wire.encode(_swim(member).on_sync(msg)), content_type="application/json")


async def _gossip_body() -> bytes:
    """A gossip message's body, refused (413) past GOSSIP_MAX_BODY as it arrives: decoding costs about 30 µs a
    member record on the event loop, and the app's body limit (what a prompt may need) would let a token holder
    send hundreds of thousands, refused only once decoded."""
    too_large = Refused(413, f"a gossip message is at most {GOSSIP_MAX_BODY} bytes")
    if (request.content_length or 0) > GOSSIP_MAX_BODY:
        raise too_large
    body = bytearray()
    async for chunk in request.body:
        body += chunk
        if len(body) > GOSSIP_MAX_BODY:
            raise too_large
    return bytes(body)


def _swim(member: GossipDispatcher) -> Swim:
    if member.swim is None:
        raise Refused(503, "membership is not running yet")
    return member.swim
