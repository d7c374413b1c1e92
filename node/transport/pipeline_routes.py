"""The pipeline's messages, served by a stage and by the runner alike: the JSON messages and the activations
posted one by one, each handed to the dispatcher and answered at once (a hop never waits for downstream
compute), and the long poll for a response kept here for an asker that cannot be reached."""
from __future__ import annotations

from typing import Protocol

from quart import Response, jsonify, request
from quart_trio import QuartTrio

from node.transport import wire
from node.transport.routes import Traffic, still_loading

MAX_WAIT_S = 30.0  # longest long poll; proxies drop idle requests not much later
JSON_MESSAGES = [("/v1/inference", wire.InferenceRequest), ("/v1/next-token", wire.NextTokens),
                 ("/v1/end", wire.EndRequest), ("/v1/cancel", wire.CancelRequest),
                 ("/v1/response", wire.InferenceResponse)]


class PipelineDispatcher(Protocol):
    """What the pipeline routes hand messages to: a stage node or the runner."""

    loading: bool  # True until messages for the model can be admitted (the runner never takes them): still_loading()
    hidden_dim: int | None  # the activations' width, once not loading

    def deliver(self, message, *, source: str | None = None, sent_at: float | None = None) -> None: ...
    # admit and enqueue, or raise Refused; `source` (the sending stage) and `sent_at` (its clock) time the hop

    async def wait_response(self, request_id: str, wait_s: float): ...  # a kept response or None


def add_pipeline_routes(app: QuartTrio, dispatcher: PipelineDispatcher) -> None:
    for path, kind in JSON_MESSAGES:
        app.add_url_rule(path, endpoint=path, view_func=_json_endpoint(dispatcher, kind), methods=["POST"])

    @app.post("/v1/activation")
    async def activation():
        if dispatcher.loading:
            raise still_loading()
        body = await request.get_data()
        Traffic.of().body_bytes[request.path] += len(body)
        act = wire.decode_activation(body, dispatcher.hidden_dim)
        dispatcher.deliver(act, **_sender())
        return jsonify({"accepted": [s.request_id for s in act.meta.segments]}), 202

    @app.get("/v1/response/<request_id>")
    async def kept_response(request_id: str):
        """Long poll for a response kept here because its asker cannot be reached (behind NAT)."""
        try:
            wait_s = min(max(float(request.args.get("wait", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            raise wire.WireError("wait: expected a number of seconds") from None
        response = await dispatcher.wait_response(request_id, wait_s)
        if response is None:
            return Response(b"", status=204)  # a bytes body: quart wraps a missing one with asyncio
        return Response(wire.encode(response), content_type="application/json")


def _json_endpoint(dispatcher: PipelineDispatcher, kind: type):
    async def endpoint():
        body = await request.get_data()
        Traffic.of().body_bytes[request.path] += len(body)
        message = wire.decode(kind, body)
        dispatcher.deliver(message, **_sender())
        return jsonify({"accepted": True}), 202
    return endpoint


def _sender() -> dict:
    """Who sent a pipeline POST and when, if a stage did (headers SENT_FROM, SENT_AT): for the hop figures."""
    source, sent_at = request.headers.get(wire.SENT_FROM), request.headers.get(wire.SENT_AT)
    try:
        return {"source": source, "sent_at": float(sent_at)} if source and sent_at else {}
    except ValueError:
        raise wire.WireError(f"{wire.SENT_AT}: expected a number, got {sent_at!r}") from None
