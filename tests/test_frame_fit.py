"""A link sends only frames its receiver takes (issue 33): batches are cut by encoded size as well as by rows
and tokens, to frames.frame_limit, the limit the receiver holds them to; a request whose part alone is over
it (prompt logprobs of a long prompt) fails alone, and every other request of the batch is sent. A frame a
peer refuses anyway is dropped after a few resends, failing only its requests, rather than looping."""
import httpx
import pytest
import trio

from cluster import API_KEY, api, start_cluster
from node.observe import hops
from node.transport import frames
from node.transport.links import coalesce
from node.transport.streams import REFUSED_AFTER, LinkStream
from roles.messages import Activation, EndReason, EndRequest, NextTokens, RequestStart, SegmentMeta, Token
from worker.contract import Sampling, TokenLogprob
from worker.models import stub_model
from worker.reference import generate_full
from worker.stub import StubTokenizer

DIM = 1  # so that the room for rows a frame may hold (MAX_FRAME_ROWS x DIM x 4) hides little metadata
META = 4096  # a small limit, so that frames over it are cheap to make


@pytest.fixture
def small_frames(monkeypatch):
    monkeypatch.setattr(frames, "MAX_FRAME_META", META)


def link() -> tuple[LinkStream, list]:
    lost = []
    stream = LinkStream("pp-stage-0", source="pp-stage-2", resolve=lambda name: "http://peer",
                        client=httpx.AsyncClient(), stats=hops.HopStats(),
                        on_lost=lambda messages, error: lost.append((messages, error)))
    return stream, lost


def sent(batch: list) -> tuple[list, list]:
    """What a link writes for `batch`, as its receiver reads it (refusing what it must); and what was lost."""
    stream, lost = link()
    reader = frames.FrameReader(DIM)
    for message in coalesce(batch):
        reader.feed(stream.frame(message))
    return [message for _, _, message in reader.frames()], lost


def token(rid: str, prompt_logprobs: int = 0) -> Token:
    lps = tuple(TokenLogprob(i, -1.5, tuple((j, -2.25) for j in range(5))) for i in range(prompt_logprobs))
    return Token(rid, 7, 3, False, prompt_logprobs=lps)


def start_rows(rid: str, prompt_len: int, rows: int = 2) -> Activation:
    start = RequestStart(8, Sampling(), tuple(range(1000, 1000 + prompt_len)))
    return Activation.of([(SegmentMeta(rid, 0, rows, start=start), bytes(rows * DIM * 4))])


def tokens_of(messages: list) -> list:
    return [t for m in messages for t in m.tokens]


def rows_of(messages: list) -> list:
    return [(s.request_id, s.position, s.seq_len) for m in messages for s in m.meta.segments]


@pytest.mark.parametrize("logprobs", [[0, 20, 0, 20, 20, 0, 20], [25] * 8, [0] * 900 + [20] * 3])
def test_fed_back_tokens_with_prompt_logprobs_are_cut_into_frames_the_receiver_takes(small_frames, logprobs):
    batch = [NextTokens((token(f"r{i}", n),)) for i, n in enumerate(logprobs)]  # ~110 B a prompt logprob
    got, lost = sent(batch)
    assert tokens_of(got) == tokens_of(batch) and lost == []
    assert len(got) > 1  # merged into one, as before, they are over the limit


@pytest.mark.parametrize("prompt_lens", [[300] * 8, [10, 600, 10, 600, 10]])
def test_request_starts_are_cut_into_frames_the_receiver_takes(small_frames, prompt_lens):
    batch = [start_rows(f"r{i}", n) for i, n in enumerate(prompt_lens)]  # ~5 B a prompt token
    got, lost = sent(batch)
    assert rows_of(got) == rows_of(batch) and lost == []
    assert b"".join(m.hidden for m in got) == b"".join(m.hidden for m in batch)


def test_a_token_too_large_for_any_frame_fails_its_request_alone(small_frames):
    batch = [NextTokens((token("a"), token("big", 60), token("b", 5))), NextTokens((token("c"),))]
    got, lost = sent(batch)
    assert [t.request_id for t in tokens_of(got)] == ["a", "b", "c"]
    [([part], error)] = lost
    assert part == NextTokens((token("big", 60),)) and f"({META}, frames.MAX_FRAME_META" in error


def test_a_start_too_large_for_any_frame_fails_its_request_alone_with_its_later_rows(small_frames):
    big = start_rows("big", 1000, rows=2)
    later = Activation.of([(SegmentMeta("big", 2, 3), bytes(3 * DIM * 4))])  # a next prompt chunk of it
    batch = [start_rows("a", 5), big, later, start_rows("b", 5)]
    got, lost = sent(batch)
    assert rows_of(got) == [("a", 0, 2), ("b", 0, 2)]
    assert [(rows_of(parts), "MAX_FRAME_META" in error) for parts, error in lost] == [
        ([("big", 0, 2)], True), ([("big", 2, 3)], True)]


ENDS = [EndRequest(f"r{n}", EndReason.FINISHED) for n in range(3)]


async def test_a_frame_the_peer_refuses_again_and_again_fails_alone_and_the_frames_after_it_go_on():
    """The peer took frame 1 and keeps refusing frame 2 (its stream ends at it each time): after
    REFUSED_AFTER resends, frame 2's request fails and frame 3 is sent; nothing else is lost."""
    answers = iter([{"last_seq": None, "boot": "a"}] + [{"last_seq": 1, "boot": "a"}] * 10)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=next(answers)))
    lost = []
    stream = LinkStream("pp-stage-1", source="pp-stage-0", resolve=lambda name: "http://peer",
                        client=httpx.AsyncClient(transport=transport), stats=hops.HopStats(),
                        on_lost=lambda messages, error: lost.append((messages, error)))
    await stream._resume("http://peer")
    for message in ENDS:
        stream.frame(message)
    resent = [await stream._resume("http://peer") for _ in range(REFUSED_AFTER + 2)]
    assert resent == [[(2, ENDS[1]), (3, ENDS[2])]] * REFUSED_AFTER + [[(3, ENDS[2])]] * 2
    [([message], error)] = lost
    assert message == ENDS[1] and "refuses it" in error


@pytest.mark.parametrize("meta, big", [
    (8192, {"prompt": " ".join(f"word{i}" for i in range(60)), "echo": True, "logprobs": 5}),  # ~70 KB of logprobs
    (1024, {"prompt": "x y z " * 70})])  # a RequestStart of ~1.4 KB (its prompt's ids)
async def test_a_request_too_large_for_a_frame_fails_alone_while_the_others_finish(
        nursery, tmp_path, monkeypatch, meta, big):
    monkeypatch.setattr(frames, "MAX_FRAME_META", meta)  # the receiver's limit as much as the sender's
    _, urls, _ = await start_cluster(nursery, 3, tmp_path, max_seqs=8)
    prompts = [f"prompt number {i}" for i in range(4)]
    results = {}

    async def complete(name, **body):
        results[name] = await client.post("/v1/completions", json={"model": "stub", "max_tokens": 12, **body})

    async with httpx.AsyncClient(base_url=api(urls[0]), headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=60) as client:
        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                clients.start_soon(lambda: complete("big", **big))
                for p in prompts:
                    clients.start_soon(lambda p=p: complete(p, prompt=p, temperature=0))
    tok, model = StubTokenizer(), stub_model()
    for p in prompts:
        assert results[p].status_code == 200, results[p].text
        want = generate_full(model, tok.encode_prompt(p), 12).token_ids
        assert results[p].json()["choices"][0]["text"] == tok.decode(list(want)), p
    assert results["big"].status_code == 500 and "MAX_FRAME_META" in results["big"].text, results["big"].text
    nursery.cancel_scope.cancel()
