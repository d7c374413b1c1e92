"""pp-entry's chat page (`GET /`, no key: it holds no secret) and the live view of the pipeline it reads
(`GET /v1/pipeline`, with a client API key like every call the page makes; the view asks the other stages for
their hop figures with the cluster token, which stays here). The page is one self-contained file,
node/static/chat.html: no build step, nothing fetched from elsewhere (the machines may have no internet)."""
from __future__ import annotations

from html import escape as html_escape
from pathlib import Path

from quart import Response, jsonify

from .pipeline_view import pipeline_view

PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


def add_chat_page(app, node, *, token: str, model_name: str) -> None:
    html = PAGE.read_text().replace("{{MODEL}}", html_escape(model_name, quote=True))

    @app.get("/")
    async def chat_page():
        return Response(html, content_type="text/html; charset=utf-8")

    @app.get("/v1/pipeline")
    async def pipeline():
        if node.worker is None or node.swim is None:
            return jsonify({"error": "stage 0 is still loading its weights"}), 503
        return jsonify(await pipeline_view(node, node.client.http, token))
