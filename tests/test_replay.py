"""Replay, in-process with the stub worker: a stage replaced mid-generation, or rows lost on the way, cost
the requests in flight a re-prefill through the chain — never their tokens (each equals the one-process
reference) and never a slot (every worker ends with none held)."""
import pytest

from roles import make_actor
from roles.actions import Progress, Reply, Send
from roles.first import MAX_REPLAYS, settled_chain
from roles.messages import (Activation, ActivationMeta, EndReason, EndRequest, InferenceRequest, NextTokens,
                            RequestStart, SegmentMeta)
from worker.contract import GREEDY
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.reference import generate_full

MAX_TOKENS = 12


class Cluster:
    """N actors with their workers; messages wait in per-stage inboxes until `round` delivers them."""

    def __init__(self, n: int, max_seqs: int = 4):
        self.n, self.model, self.max_seqs = n, stub_model(), max_seqs
        self.workers = [open_worker(self.model, Shard.of(s, n), max_seqs=max_seqs) for s in range(n)]
        self.actors = [make_actor(w) for w in self.workers]
        self.inbox: dict[int, list] = {s: [] for s in range(n)}
        self.replies: dict[str, object] = {}
        self.progress: dict[str, list[int]] = {}
        self.chain = tuple(f"m{s}" for s in range(1, n))
        self.actors[0].set_chain(self.chain, standing=True)

    def submit(self, prompts: dict[str, str]) -> None:
        for rid, prompt in prompts.items():
            self.inbox[0].append(InferenceRequest(rid, prompt, max_tokens=MAX_TOKENS, reply_to="http://runner"))

    def round(self, stages: int | None = None) -> None:
        """Each stage in turn (the first `stages` of them) takes its inbox, then runs one step."""
        for s, actor in enumerate(self.actors[:stages]):
            messages, self.inbox[s] = self.inbox[s], []
            for m in messages:
                self.act(actor.admit(m))
            planned = actor.plan()
            if planned is not None:
                self.act(actor.finish(planned, actor.run(planned, self.workers[s])))

    def act(self, actions) -> None:
        for a in actions:
            if isinstance(a, Progress):
                if a.token_id is not None:
                    self.progress.setdefault(a.request_id, []).append(a.token_id)
            elif isinstance(a, Reply):
                self.replies[a.response.request_id] = a.response
            else:
                self.inbox[int(a.dest.rsplit("-", 1)[1])].append(a.message)

    def busy(self) -> bool:
        return any(self.inbox.values()) or any(a.queue.waiting for a in self.actors)

    def run(self, rounds: int = 10_000) -> None:
        for _ in range(rounds):
            if not self.busy():
                return
            self.round()

    def replace(self, stage: int) -> None:
        """The stage's process dies (what was sent to it is gone) and a fresh one takes its place."""
        self.inbox[stage] = []
        self.workers[stage] = open_worker(self.model, Shard.of(stage, self.n), max_seqs=self.max_seqs)
        self.actors[stage] = make_actor(self.workers[stage])
        self.chain = tuple(f"{m}'" if i == stage - 1 else m for i, m in enumerate(self.chain))

    def reference(self, prompt: str) -> list[int]:
        return generate_full(self.model, self.workers[0].vocabulary.tokenize(prompt), MAX_TOKENS).token_ids

    def assert_exact_and_clean(self, prompts: dict[str, str]) -> None:
        assert set(self.replies) == set(prompts)
        for rid, prompt in prompts.items():
            assert list(self.replies[rid].token_ids) == self.reference(prompt), rid
            assert self.replies[rid].error is None
            assert self.progress[rid] == self.reference(prompt), rid  # what the entry streamed: no repeats
        assert all(w.active == frozenset() for w in self.workers)
        assert not self.actors[0].live


PROMPTS = {f"r{i}": "x" * (1 + 5 * i) for i in range(6)}


@pytest.mark.parametrize("n, stage", [(3, 1), (3, 2), (4, 2), (2, 1)])
@pytest.mark.parametrize("after_rounds", [1, 4, 9])
def test_a_stage_replaced_mid_generation_costs_a_replay_not_a_token(n, stage, after_rounds):
    c = Cluster(n)
    c.submit(PROMPTS)
    for _ in range(after_rounds):
        c.round()
    c.replace(stage)
    assert c.actors[0].set_chain(None, standing=False) == []  # gossip: the stage is dead
    c.run(5)
    assert c.actors[0].plan() is None and c.actors[0].health()["admitting"] is False  # paused meanwhile
    c.act(c.actors[0].set_chain(c.chain, standing=True))  # the replacement is ready
    c.run()
    c.assert_exact_and_clean(PROMPTS)
    assert c.actors[0].health()["replays"] == 0  # counted per live request: all are over


def test_the_chain_is_settled_once_every_replayed_request_has_a_token_of_its_new_life_back():
    c = Cluster(3)
    c.submit(PROMPTS)
    c.round()
    assert settled_chain(c.actors[0]) == c.chain  # nothing lost, nothing replayed
    c.replace(1)
    c.actors[0].set_chain(None, standing=False)
    assert settled_chain(c.actors[0]) == ()  # a stage is missing
    c.act(c.actors[0].set_chain(c.chain, standing=True))
    settled = []
    while c.busy():
        settled.append(settled_chain(c.actors[0]))
        c.round()
    assert settled[0] == () and c.chain in settled  # replays pending, then none: before the answers end
    resumed = settled.index(c.chain)
    assert all(s == c.chain for s in settled[resumed:])
    c.assert_exact_and_clean(PROMPTS)


def test_rows_a_stage_could_not_pass_on_are_replayed_at_once_while_the_chain_stands():
    c = Cluster(3)
    c.submit(PROMPTS)
    for _ in range(2):
        c.round()
    c.round(stages=2)
    lost = [m for m in c.inbox[2] if isinstance(m, Activation)]
    c.inbox[2] = [m for m in c.inbox[2] if not isinstance(m, Activation)]
    assert lost
    for m in lost:  # the link from stage 1 gave up on them
        c.act(c.actors[1].undeliverable(Send("pp-stage-2", m), "connection refused"))
    reports = list(c.inbox[0])
    assert reports and all(isinstance(r, EndRequest) and r.reason is EndReason.LOST for r in reports)
    c.run()
    c.assert_exact_and_clean(PROMPTS)


def test_a_lost_report_waits_while_a_stage_is_suspected_and_replays_once_it_stands_again():
    c = Cluster(3)
    c.submit({"a": "hello"})
    c.round(stages=2)
    c.inbox[2].clear()  # the prefill never reached the last stage
    c.act(c.actors[0].set_chain(c.chain, standing=False))  # stage 2 is suspected
    c.act(c.actors[0].admit(EndRequest("a", EndReason.LOST, "stage 1: timed out", 1, 0)))
    c.run()
    assert "a" not in c.replies and c.actors[0].live["a"].lost
    c.act(c.actors[0].set_chain(c.chain, standing=True))  # it answered after all
    c.run()
    c.assert_exact_and_clean({"a": "hello"})


def test_rows_and_tokens_of_a_replaced_life_are_dropped_wherever_they_arrive():
    c = Cluster(3)
    c.submit({"a": "hello there"})
    c.round()
    stale_rows = list(c.inbox[1])  # generation 0's prefill, still on its way to stage 1
    c.run(4)
    stale_tokens = [m for m in c.inbox[0] if isinstance(m, NextTokens)]
    c.replace(2)
    c.act(c.actors[0].set_chain(c.chain, standing=True))
    c.inbox[1] = stale_rows + c.inbox[1]  # arrive after the replay began: dropped, not "starts twice"
    c.inbox[0] += stale_tokens
    c.run()
    c.assert_exact_and_clean({"a": "hello there"})


def test_while_a_stage_is_missing_new_requests_wait_and_start_once_the_chain_is_whole():
    c = Cluster(3)
    c.actors[0].set_chain(None, standing=False)
    c.submit({"a": "hi"})
    c.run(3)
    assert c.actors[0].admission.waiting and not c.actors[0].live
    assert c.actors[0].health()["admitting"] is False
    c.act(c.actors[0].set_chain(c.chain, standing=True))  # the same members: nothing to replay
    c.run()
    c.assert_exact_and_clean({"a": "hi"})


def test_a_request_lost_over_and_over_fails_naming_it_and_frees_its_slots():
    c = Cluster(3)
    c.submit({"a": "hi"})
    for _ in range(MAX_REPLAYS + 1):
        c.round()
        c.inbox[2] = [m for m in c.inbox[2] if not isinstance(m, Activation)]  # always lost past stage 1
        live = c.actors[0].live.get("a")
        if live is not None:
            c.act(c.actors[0].admit(EndRequest("a", EndReason.LOST, "stage 1: refused", 1, live.generation)))
    c.run()
    assert "lost 16 times" in c.replies["a"].error
    assert all(w.active == frozenset() for w in c.workers)


def test_the_first_request_of_a_replaced_stage_0_frees_every_slot_the_old_one_s_requests_held():
    c = Cluster(3)
    c.actors[0].entry = "entry-1"
    c.submit({f"old{i}": "x" for i in range(c.max_seqs)})
    c.run(3)
    assert len(c.workers[1].active) == len(c.workers[2].active) == c.max_seqs  # every slot taken
    stale = list(c.inbox[1])  # the old entry's rows, still on their way
    c.inbox[0] = []
    c.workers[0] = open_worker(c.model, Shard.of(0, 3), max_seqs=c.max_seqs)  # its requests died with it
    c.actors[0] = make_actor(c.workers[0], node_id="entry-2")
    c.actors[0].set_chain(c.chain, standing=True)
    c.submit({f"new{i}": f"hi {i}" for i in range(c.max_seqs)})
    c.round(stages=1)
    c.inbox[1] = c.inbox[1] + stale  # a frozen old entry's rows arriving late are dropped too
    c.run()
    assert {rid for rid in c.replies} == {f"new{i}" for i in range(c.max_seqs)}
    assert all(r.error is None for r in c.replies.values())
    assert list(c.replies["new0"].token_ids) == c.reference("hi 0")
    assert all(w.active == frozenset() for w in c.workers)


def test_a_stage_told_by_gossip_of_a_new_stage_0_frees_only_the_old_one_s_requests():
    c = Cluster(3)
    c.actors[0].entry = "entry-1"
    c.submit({"a": "hello"})
    c.run(2)
    assert c.workers[2].active == {"a"}
    c.actors[2].entries.forget_except("entry-1")  # gossip lagging behind: nothing to free
    c.round()
    assert c.workers[2].active == {"a"}
    c.actors[2].entries.forget_except("entry-2")
    c.round()
    assert c.workers[2].active == frozenset()


def test_a_replayed_start_carries_the_generated_tokens_and_the_last_stage_counts_them():
    w = open_worker(stub_model(), Shard.of(1, 2))
    last = make_actor(w)
    start = RequestStart(3, GREEDY, (1, 2), "http://runner", replayed=(5, 6))
    seg = SegmentMeta("a", 0, 4, start=start, generation=1)
    last.admit(Activation(ActivationMeta((seg,)), b"\0" * 4 * 4 * w.info.hidden_dim))
    planned = last.plan()
    [reply, tokens] = last.finish(planned, last.run(planned, w))
    [token] = tokens.message.tokens
    assert (token.position, token.generation, token.done) == (4, 1, True)  # the third of max_tokens 3
    assert reply.response.token_ids[:2] == (5, 6) and reply.response.prompt_token_ids == (1, 2)
