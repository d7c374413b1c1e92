"""pp-entry's chat page (`GET /`, no key: it holds no secret) and the live view of the pipeline it reads
(`GET /v1/pipeline`, with a client API key like every call the page makes; the view asks the other stages for
their hop figures as a member, over TLS: nothing of the cluster's reaches the page). The page is one self-contained file,
node/api/static/chat.html: no build step, nothing fetched from elsewhere (the machines may have no internet)."""
from __future__ import annotations

import base64
import hashlib
import re
from html import escape as html_escape
from pathlib import Path

import httpx
from quart import Response, jsonify

from node.api.entry import Entry
from node.api.pipeline_view import HopFigures, pipeline_view
from node.transport.app import STILL_LOADING

PAGE = Path(__file__).resolve().parent / "static" / "chat.html"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def page_headers(html: str) -> dict[str, str]:
    """The page's security headers: a Content-Security-Policy that lets it do only what it does — run its own
    inline script and style (allowed by their hashes, so nothing injected runs), call this origin's API —
    and be framed by nobody; no MIME sniffing; no referrer."""
    allowed = {"script": [], "style": []}
    for kind, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        allowed[kind].append(f"'sha256-{digest}'")
    script, style = (" ".join(allowed[kind]) or "'none'" for kind in ("script", "style"))
    policy = ["default-src 'none'", f"script-src {script}", f"style-src {style}", "connect-src 'self'",
              "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"]
    return {"Content-Security-Policy": "; ".join(policy), "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}


def add_chat_page(app, node: Entry, *, http: httpx.AsyncClient, model_name: str) -> None:
    """`http` asks the other stages for their hop figures, as a member (its certificate): an HTTP/1.1 client
    (node/api/pipeline_view.py says why)."""
    html = PAGE.read_text().replace("{{MODEL}}", html_escape(model_name, quote=True))
    headers = page_headers(html)
    hops = HopFigures(http)

    @app.get("/")
    async def chat_page():
        return Response(html, content_type="text/html; charset=utf-8", headers=headers)

    @app.get("/v1/pipeline")
    async def pipeline():
        if node.loading or node.swim is None:  # membership runs before the weights load: no swim, no view
            return jsonify({"error": STILL_LOADING}), 503
        return jsonify(await pipeline_view(node, hops))
