"""Test helper: a tiny-model GGUF file, and an HTTP server that serves files with byte ranges."""
from __future__ import annotations

import http.server
import re
import threading

import attrs

from ggufmake import write_llama_gguf
from tokfiles import byte_vocab, gguf_fields
from worker.weights.tiny import TinySource
from worker.weights.contract import BLOCK_TENSORS


def write_gguf(path, config):
    """llama.cpp's tensor order: rope_freqs, embedding, blocks in order, output norm (and head)."""
    source = TinySource(config)
    order = ["token_embd.weight", *(f"blk.{i}.{t}.weight" for i in range(config.n_layers) for t in BLOCK_TENSORS),
             "output_norm.weight", "output.weight"]
    weights = {n: source.load(n) for n in order if n in source.names()}
    write_llama_gguf(path, config, weights, **gguf_fields(byte_vocab()))
    return path


@attrs.frozen
class Served:
    method: str
    path: str
    status: int
    first: int  # first byte of the body in the file
    nbytes: int  # body bytes written


class RangeServer:
    """Serves files over HTTP/1.1 with HEAD and single `Range: bytes=a-b` GETs, logging each request.

    `fault` breaks responses for bodies starting at or after byte `fault_from`: "ignore_range"
    (200 with the whole file), "truncate" (Content-Length, half the body, close), "unframed"
    (no Content-Length, half the body, close), "resize" (another total size), "retag" (another ETag).
    """

    def __init__(self, files: dict):
        self.files = {path: p.read_bytes() for path, p in files.items()}
        self.fault, self.fault_from = None, 0
        self.log: list[Served] = []
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def gets(self) -> list[Served]:
        return [s for s in self.log if s.method == "GET"]

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self):
                server.respond(self, head=True)

            def do_GET(self):
                server.respond(self, head=False)

            def log_message(self, *args):
                pass

        return Handler

    def respond(self, h, *, head: bool):
        body = self.files.get(h.path)
        if body is None:
            h.send_error(404, "File not found")
            self.log.append(Served(h.command, h.path, 404, 0, 0))
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range", ""))
        first = int(m[1]) if m else 0
        fault = self.fault if first >= self.fault_from else None
        status = 206 if m and fault != "ignore_range" else 200
        last = min(int(m[2]), len(body) - 1) if status == 206 else len(body) - 1
        payload = body[first:last + 1]
        if fault in ("truncate", "unframed"):
            payload = payload[:len(payload) // 2]
        # logged before anything is sent: the client may have the headers (and the test go on) before
        # this thread runs another line
        self.log.append(Served(h.command, h.path, status, first, 0 if head else len(payload)))
        h.send_response(status)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", '"v2"' if fault == "retag" else '"v1"')
        if status == 206:
            total = len(body) + 4096 if fault == "resize" else len(body)
            h.send_header("Content-Range", f"bytes {first}-{last}/{total}")
        if fault == "unframed":
            h.send_header("Connection", "close")
        else:
            h.send_header("Content-Length", str(len(body[first:last + 1])))
        h.end_headers()
        if fault in ("truncate", "unframed"):
            h.close_connection = True
        if not head:
            try:
                h.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # a client refusing the body hangs up
                h.close_connection = True
