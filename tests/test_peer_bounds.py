"""Peers are bounded too (issue 33): a link frame holds at most what a model can send (rows x dim x 4 plus
metadata) and a header claiming more is refused before its body is buffered; a sender's batches are cut to
fit; a receiver reads a bounded number of link streams; hop figures are labelled only by the chain's stages."""
import itertools

import pytest

from node.observe import hops
from node.downstream import DownstreamStage
from node.stage_node import StageNode
from worker.partition import Shard
from node.transport import frames
from node.transport.app import make_app
from node.transport.link_routes import add_link_routes
from cluster import MEMBER_TLS
from node.transport.client import PeerClient
from node.transport.links import coalesce
from node.transport.streams import MAX_INBOUND_LINKS, LinkReceiver, inbound_link_refusal
from roles.actions import Refused
from roles.messages import Activation, NextTokens, SegmentMeta, Token, WireError

DIM = 8


@pytest.mark.parametrize("kind, limit", [
    (frames.ACTIVATION, 17 + frames.MAX_FRAME_ROWS * DIM * 4 + frames.MAX_FRAME_META),
    (frames.NEXT_TOKENS, 17 + frames.MAX_FRAME_META), (frames.END, 17 + frames.MAX_FRAME_META),
    (frames.HEARTBEAT, 17), (9, 17)])
def test_a_frame_of_each_kind_is_limited_to_what_the_model_can_send(kind, limit):
    assert frames.frame_limit(kind, DIM) == limit


@pytest.mark.parametrize("kind, size", [(frames.ACTIVATION, 1 << 30), (frames.NEXT_TOKENS, (16 << 20) + 18),
                                        (frames.HEARTBEAT, 18), (frames.END, 1 << 31)])
def test_a_header_claiming_more_than_its_limit_is_refused_before_its_body_is_buffered(kind, size):
    reader = frames.FrameReader(DIM)
    reader.feed(frames.HEADER.pack(size, kind, 1, 0.0))  # the header alone: nothing of the body sent yet
    with pytest.raises(WireError, match="outside"):
        list(reader.frames())


def test_a_frame_at_its_limit_is_taken():
    act = Activation.of([(SegmentMeta("r", 5, frames.MAX_FRAME_ROWS), b"\0" * frames.MAX_FRAME_ROWS * DIM * 4)])
    reader = frames.FrameReader(DIM)
    reader.feed(frames.encode(act, 1, 0.0))
    [(seq, _, got)] = list(reader.frames())
    assert seq == 1 and got == act


def act(rid, position, rows):
    return Activation.of([(SegmentMeta(rid, position, rows), bytes(range(rows)) * 4)])  # 4 bytes a row


@pytest.mark.parametrize("rows, max_rows, frames_rows", [
    ([3, 3], 8, [6]), ([3, 3, 3], 6, [6, 3]), ([10], 4, [4, 4, 2]), ([2, 7], 4, [2, 4, 3]), ([4, 4], 4, [4, 4])])
def test_a_senders_activations_are_merged_and_cut_to_fit_a_frame(rows, max_rows, frames_rows):
    messages = [act(f"r{i}", 5, n) for i, n in enumerate(rows)]  # rows after a request's first
    out = coalesce(messages, max_rows=max_rows)
    assert [m.meta.rows for m in out] == frames_rows
    pieces = [p for m in out for p in m.split()]
    for rid in {s.request_id for m in messages for s in m.meta.segments}:  # each request's rows, in order
        mine = [(s, h) for s, h in pieces if s.request_id == rid]
        assert [s.position for s, _ in mine] == list(itertools.accumulate([5] + [s.seq_len for s, _ in mine][:-1]))
        assert b"".join(h for _, h in mine) == next(m.hidden for m in messages if m.meta.segments[0].request_id == rid)


@pytest.mark.parametrize("counts, max_tokens, sizes", [([2, 2], 4, [4]), ([3, 3], 4, [3, 3]), ([9], 4, [4, 4, 1])])
def test_a_senders_tokens_are_merged_and_cut_to_fit_a_frame(counts, max_tokens, sizes):
    messages = [NextTokens(tuple(Token(f"r{i}{j}", 1, 5, False) for j in range(n))) for i, n in enumerate(counts)]
    out = coalesce(messages, max_tokens=max_tokens)
    assert [len(m.tokens) for m in out] == sizes
    assert [t for m in out for t in m.tokens] == [t for m in messages for t in m.tokens]


@pytest.mark.parametrize("reading, limit, refused", [(0, 32, False), (31, 32, False), (32, 32, True), (40, 32, True)])
def test_a_receiver_reads_a_bounded_number_of_link_streams(reading, limit, refused):
    why = inbound_link_refusal(reading, limit)
    assert (why is not None) == refused and (why is None or f"({limit})" in why)


@pytest.mark.parametrize("source, link", [("pp-stage-1", "from pp-stage-1"), ("pp-stage-9", hops.OTHER),
                                         ("x" * 64, hops.OTHER), ("", hops.OTHER)])
def test_hop_figures_are_labelled_only_by_the_chains_stages(source, link):
    assert hops.source_link(source, frozenset({"pp-stage-0", "pp-stage-1", "pp-stage-2"})) == link


def test_senders_a_peer_makes_up_share_one_hop_label_in_hops_and_metrics():
    node = StageNode(Shard.of(1, 3), PeerClient(MEMBER_TLS), side=DownstreamStage, node_id="n", model_name="m")
    for i in range(50):  # a header or a link's `from` names the sender: anything a peer likes
        with pytest.raises(Refused):  # still loading: timed all the same, before the refusal
            node.deliver(NextTokens((Token("r", 1, 5, False),)), source=f"made-up-{i}", sent_at=hops.now())
    with pytest.raises(Refused):  # the chain's own stage keeps its label
        node.deliver(NextTokens((Token("r", 1, 5, False),)), source="pp-stage-0", sent_at=hops.now())
    assert set(node.hops.summary()) == {hops.OTHER, "from pp-stage-0"}
    assert b"made-up" not in node.metrics.render() and b'hop="from other"' in node.metrics.render()


class _Loaded:
    loading, hidden_dim, swim, serving = False, DIM, None, True

    def __init__(self, links_in):
        self.links_in = links_in

    def health(self):
        return {}


MEMBER = ("10.0.0.1", 40000)


@pytest.mark.parametrize("reading, status", [(MAX_INBOUND_LINKS, 503), (MAX_INBOUND_LINKS - 1, 200)])
async def test_past_the_inbound_link_cap_a_link_open_and_its_state_are_refused_with_503(reading, status):
    links_in = LinkReceiver()
    links_in.streams = reading
    app = make_app(stage := _Loaded(links_in), token="t", max_body_bytes=1 << 20)
    add_link_routes(app, stage)
    app.pp_members[MEMBER] = "stage0"  # as if the connection had shown a member's certificate (tls_accept)
    client = app.test_client()
    r = await client.get("/v1/link/abc", scope_base={"client": MEMBER})
    assert r.status_code == status
    if status == 503:
        r = await client.post("/v1/link?link=abc&from=pp-stage-0", scope_base={"client": MEMBER}, data=b"")
        assert r.status_code == 503 and "link streams" in (await r.get_json())["error"]
        assert r.headers["Retry-After"] == "1"
