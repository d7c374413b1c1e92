"""Nothing crosses the network in clear (issue 55): every connection between members is TLS 1.3 with a certificate
on both ends, under a CA every holder of the cluster token derives alike (node/transport/tls.py); the token is
never sent. A port that carries cluster traffic answers plain HTTP with nothing; stage 0's serves its API in plain
HTTP as well, where the cluster's routes refuse it. A node with another token is refused, and says why."""
import datetime
import functools
import ipaddress
import json
import logging
import socket
import ssl

import h2.config
import h2.connection
import httpx
import attrs
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from quart_trio import QuartTrio

from cluster import API_KEY, MEMBER_TLS, TOKEN, api, client_http, member_http, open_raw, stage_config, start_cluster
import cluster as local
from node.transport import h2_flow, tls, tls_accept
from node.transport.app import serve_app

NOW = datetime.datetime(2026, 12, 8, tzinfo=datetime.timezone.utc)


# --- the CA and the certificates ----------------------------------------------------------------------------------

def test_every_holder_of_a_token_derives_the_same_ca_and_another_token_another():
    a, b, other = tls.authority(TOKEN), tls.authority(TOKEN), tls.authority("another-token")
    assert a.pem == b.pem and a.fingerprint == b.fingerprint
    assert other.pem != a.pem and other.fingerprint != a.fingerprint
    assert TOKEN not in a.pem and a.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_member_s_certificate_names_it_is_short_lived_and_is_signed_by_the_ca():
    ca = tls.authority(TOKEN)
    cert_pem, key_pem = tls.issue(ca, "stage1-3cf0b8b2", NOW)
    cert = x509.load_pem_x509_certificate(cert_pem)
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "stage1-3cf0b8b2"
    assert cert.issuer == ca.cert.subject
    assert cert.not_valid_after_utc - NOW == tls.CERT_LIFETIME and NOW - cert.not_valid_before_utc == tls.CLOCK_SKEW
    cert.verify_directly_issued_by(ca.cert)  # raises if the CA did not sign it
    assert b"PRIVATE KEY" in key_pem


async def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> dict:
    """Both ends of a handshake over a socket pair: the node id the server reads off the client, or each end's error."""
    a, b = trio.socket.socketpair()
    server = trio.SSLStream(trio.SocketStream(a), server_ctx, server_side=True)
    client = trio.SSLStream(trio.SocketStream(b), client_ctx, server_hostname="node")
    out = {}

    async def side(name, stream, raw):
        try:
            await stream.do_handshake()
            if name == "server":
                out["member"] = tls.member_id(stream.getpeercert())
        except trio.BrokenResourceError as exc:
            out[name] = str(exc.__cause__)
            await trio.aclose_forcefully(raw)
    async with trio.open_nursery() as n:
        n.start_soon(side, "server", server, server.transport_stream)
        n.start_soon(side, "client", client, client.transport_stream)
    return out


async def test_members_of_one_cluster_know_each_other_and_a_node_of_another_token_is_refused():
    a, b, stranger = MEMBER_TLS, tls.ClusterTls(TOKEN, "stage1"), tls.ClusterTls("another-token", "stage1")
    assert await handshake(a.server_context(), b.client_context()) == {"member": "stage1"}
    assert "CERTIFICATE_VERIFY_FAILED" in (await handshake(a.server_context(), stranger.client_context()))["client"]
    lax = stranger.client_context()
    lax.verify_mode = ssl.CERT_NONE  # a stranger that checks nothing still shows a certificate the CA did not sign
    assert "CERTIFICATE_VERIFY_FAILED" in (await handshake(a.server_context(), lax))["server"]


async def test_a_renewed_certificate_is_shown_on_the_next_connection():
    member = tls.ClusterTls(TOKEN, "stage2", now=NOW - datetime.timedelta(days=6))
    server = member.server_context()
    before = await peer_serial(server)
    member.renew()
    assert await peer_serial(server) != before


async def peer_serial(server_ctx: ssl.SSLContext) -> int:
    a, b = trio.socket.socketpair()
    s = trio.SSLStream(trio.SocketStream(a), server_ctx, server_side=True)
    c = trio.SSLStream(trio.SocketStream(b), local.ca_context(), server_hostname="node")
    async with trio.open_nursery() as n:
        n.start_soon(s.do_handshake)
        n.start_soon(c.do_handshake)
    return x509.load_der_x509_certificate(c.getpeercert(binary_form=True)).serial_number


# --- a node's port -----------------------------------------------------------------------------------------------

def _app() -> QuartTrio:
    app = QuartTrio("tls")
    app.pp_members = {}

    @app.get("/who")
    async def who():
        from quart import request
        return {"member": app.pp_members.get(tuple(request.scope["client"]))}
    return app


@pytest.fixture
async def port_of(nursery):
    async def start(plaintext: bool) -> tuple[QuartTrio, int]:
        app = _app()
        port = await nursery.start(functools.partial(serve_app, app, "127.0.0.1", 0, tls=MEMBER_TLS.server_context(),
                                                     plaintext=plaintext))
        return app, port
    return start


async def raw_answer(port: int, data: bytes) -> bytes:
    """What a port sends back to `data` before it closes the connection (or 5 s pass)."""
    got = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(data)
        with trio.move_on_after(5):
            try:
                while chunk := await stream.receive_some():
                    got += chunk
            except trio.BrokenResourceError:
                pass
    return got


def h2_prior_knowledge() -> bytes:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")],
                      end_stream=True)
    return conn.data_to_send()


async def test_plain_http_to_a_cluster_port_gets_no_http_answer_and_a_line_says_from_where(port_of, caplog):
    _, port = await port_of(plaintext=False)
    with caplog.at_level(logging.WARNING, logger="pp.hypercorn"):
        for hello in (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", h2_prior_knowledge()):
            assert await raw_answer(port, hello) == b""
    assert "refused a connection from 127.0.0.1: it spoke plain HTTP" in caplog.text


async def test_a_member_is_known_by_its_certificate_and_a_client_without_one_is_not(port_of):
    app, port = await port_of(plaintext=False)
    async with member_http() as member, client_http() as client:
        assert (await member.get(f"https://127.0.0.1:{port}/who")).json() == {"member": "test-member"}
        assert (await client.get(f"https://127.0.0.1:{port}/who")).json() == {"member": None}
    with trio.fail_after(5):  # their connections closed: the registry forgets them
        while app.pp_members:
            await trio.sleep(0.01)


async def test_stage_0_s_port_serves_plain_http_beside_tls(port_of):
    _, port = await port_of(plaintext=True)
    async with httpx.AsyncClient() as plain, member_http() as member:
        assert (await plain.get(f"http://127.0.0.1:{port}/who")).json() == {"member": None}
        assert (await member.get(f"https://127.0.0.1:{port}/who")).json() == {"member": "test-member"}


async def test_half_open_handshakes_are_closed_and_a_flood_of_them_leaves_the_port_serving(
        port_of, monkeypatch, caplog):
    monkeypatch.setattr(tls_accept, "HANDSHAKE_S", 0.5)
    caplog.set_level(logging.WARNING, logger="pp.hypercorn")
    _, port = await port_of(plaintext=False)
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"  # a ClientHello's first bytes, and no more
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(200)]
    for stream in held:
        await stream.send_all(hello)
    async with member_http(timeout=5) as member:
        started = trio.current_time()
        assert (await member.get(f"https://127.0.0.1:{port}/who")).json() == {"member": "test-member"}
        assert trio.current_time() - started < 2.0
    closed = 0
    with trio.fail_after(10):
        for stream in held:
            try:
                closed += await stream.receive_some() == b""
            except trio.BrokenResourceError:
                closed += 1
            await stream.aclose()
    assert closed == len(held)
    assert "its TLS handshake took more than 0.5 s" in caplog.text


# --- on a live cluster -------------------------------------------------------------------------------------------

async def test_a_tls_client_without_a_member_s_certificate_gets_nothing_of_the_cluster_s(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    async with client_http(http1=False, http2=True, timeout=10) as client:
        for url in urls:
            for method, path in (("POST", "/v1/link?link=l1&from=pp-stage-0"), ("POST", "/swim/ping"),
                                 ("GET", "/v1/members"), ("GET", "/v1/hops")):
                r = await client.request(method, url + path, content=b"{}", headers={"Content-Type": "application/json"})
                assert r.status_code == 401 and "member's certificate" in r.json()["error"], (url, path, r.text)
        assert (await client.get(urls[1] + "/health")).status_code == 200
    nursery.cancel_scope.cancel()


async def test_a_node_started_with_another_token_cannot_join_and_the_others_say_why(nursery, tmp_path, caplog):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    compute = await nursery.start(local._shared_compute)
    stranger = attrs.evolve(stage_config(1, 2, model="stub", seed=orch.url, peer=urls[0], tmp=tmp_path),
                            cluster_token="another-token", node_id="stranger")
    with caplog.at_level(logging.WARNING):
        await nursery.start(local._scoped, trio.CancelScope(), stranger, compute)
        await trio.sleep(3.0)  # several protocol periods: long enough to have joined
    assert "stranger" not in orch.swim.members()
    async with member_http(timeout=10) as member:
        ids = [m["id"] for m in (await member.get(urls[0] + "/v1/members")).json()["members"]]
    assert "stranger" not in ids
    assert "another PP_CLUSTER_TOKEN" in caplog.text
    nursery.cancel_scope.cancel()


class RecordingProxy:
    """A TCP proxy in front of one node: every byte between the node and whoever called it, both ways, kept."""

    def __init__(self, target_port: int):
        self.target_port, self.seen = target_port, bytearray()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, inbound):
        try:
            outbound = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            return
        async with inbound, outbound, trio.open_nursery() as n:
            n.start_soon(self._pipe, inbound, outbound, n.cancel_scope)
            n.start_soon(self._pipe, outbound, inbound, n.cancel_scope)

    async def _pipe(self, source, sink, scope):
        try:
            while data := await source.receive_some(1 << 16):
                self.seen += data
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_between_members_no_packet_holds_the_token_the_prompt_or_the_answer(nursery, tmp_path):
    """Every node is reached by the others (and the runner) only through a recording proxy: what crosses between
    them, links, gossip, the runner's calls, is kept and searched. The client's own call to stage 0's API goes
    straight to its port (it is not between members)."""
    orch = await nursery.start(functools.partial(local.run_orchestrator, TOKEN, swim_config=local.FAST_SWIM))
    compute = await nursery.start(local._shared_compute)
    proxies, ports, prev = [], [], None
    for stage in range(3):
        port = free_port()
        proxy = RecordingProxy(port)
        front = await nursery.start(proxy.serve)
        config = attrs.evolve(stage_config(stage, 3, model="stub", seed=orch.url, peer=prev, tmp=tmp_path,
                                           advertise_addr=f"https://127.0.0.1:{front}"), port=port)
        prev = await nursery.start(local._scoped, trio.CancelScope(), config, compute)
        proxies.append(proxy)
        ports.append(port)
    with trio.fail_after(120):
        await orch.converge(3)
    prompt = "Tell me about the lighthouse keeper Quillon"
    control = RecordingProxy(ports[0])  # the client's own call, in plain HTTP: the search finds what is there
    front = await nursery.start(control.serve)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"http://127.0.0.1:{front}/v1/chat/completions",
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": "stub", "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": 24, "ignore_eos": True})
    answer = r.json()["choices"][0]["message"]["content"]
    assert r.status_code == 200 and len(answer) >= 8
    assert prompt.encode() in control.seen and API_KEY.encode() in control.seen
    seen = b"".join(bytes(p.seen) for p in proxies)
    assert len(seen) > 20_000 and all(p.seen[:1] == b"\x16" for p in proxies)  # TLS records, and plenty of them
    for secret in (TOKEN, prompt, "lighthouse", answer[:8], json.dumps(answer)[1:9]):
        assert secret.encode() not in seen, secret
    nursery.cancel_scope.cancel()


def self_signed(tmp_path) -> tuple[str, str]:
    """An operator's certificate for 127.0.0.1 (what --tls-cert names), and its key, as files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "api.example")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(NOW - datetime.timedelta(days=1))
            .not_valid_after(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "api.pem", tmp_path / "api.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_with_its_own_certificate_stage_0_serves_the_api_over_tls_only_and_members_still_get_the_cluster_s(
        nursery, tmp_path):
    cert, key = self_signed(tmp_path)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, api_tls=(cert, key))
    ctx = ssl.create_default_context(cafile=cert)  # a client that trusts the operator's certificate, and checks it
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(verify=ctx, timeout=30) as client:
        r = await client.post(urls[0] + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]  # through the members' chain
    host, port = urls[0].split("://")[1].split(":")
    assert await raw_answer(int(port), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == b""  # no plain HTTP now
    async with member_http(timeout=10) as member:  # members are shown the cluster's certificate
        assert (await member.get(urls[0] + "/v1/members")).status_code == 200
    nursery.cancel_scope.cancel()


async def test_a_node_stops_at_once_though_a_tls_peer_reads_nothing_of_what_it_was_sent(nursery):
    """A socket write is shielded from its task's cancellation (half a frame would break the connection), for up to
    the send timeout: a stopping node waited on a peer that read nothing, 30 s. It cuts them now."""
    h2_flow.install()  # as make_app does: the node's timed socket writes
    app = _app()

    @app.get("/big")
    async def big():
        return b"x" * (32 << 20)
    async with trio.open_nursery() as server:
        port = await server.start(functools.partial(serve_app, app, "127.0.0.1", 0, tls=MEMBER_TLS.server_context()))
        stream = await open_raw(f"https://127.0.0.1:{port}", local.ca_context(), ["http/1.1"])
        await stream.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await stream.receive_some(1024)  # the answer has begun, and is never read further
        await trio.sleep(1.0)  # the server's writes fill the sockets' buffers and wait
        nursery.start_soon(_hang_up_after, stream, 15.0)  # else a server that waits for the peer waits 30 s
        stopped = trio.current_time()
        server.cancel_scope.cancel()
    print(f"\nstopped in {trio.current_time() - stopped:.2f} s")
    assert trio.current_time() - stopped < 5.0


async def _hang_up_after(stream, seconds: float) -> None:
    await trio.sleep(seconds)
    await trio.aclose_forcefully(stream)
