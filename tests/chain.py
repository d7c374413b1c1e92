"""Test helper: N stage actors with their workers in one process, messages passed by hand: `ask` admits
requests at once and runs every stage until all answer (the prefix cache's and the KV budget's tests)."""
from roles import make_actor
from roles.actions import Progress, Reply, Send
from roles.messages import Activation, InferenceRequest
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.reference import generate_full

MAX_TOKENS = 6


class Chain:
    """N actors with their workers in one process; `ask` admits requests at once and runs until all answer."""

    def __init__(self, n: int, *, max_seqs: int = 4, prefix_cache: bool = True, model=None):
        self.n, self.model, self.max_seqs, self.cache = n, model or stub_model(), max_seqs, prefix_cache
        self.workers = [open_worker(self.model, Shard.of(s, n), max_seqs=max_seqs) for s in range(n)]
        self.actors = [make_actor(w, prefix_cache=prefix_cache) for w in self.workers]
        self.actors[0].set_chain(tuple(f"m{s}" for s in range(1, n)), standing=True)
        self.inbox: dict[int, list] = {s: [] for s in range(n)}
        self.replies: dict[str, object] = {}
        self.starts: dict[str, int] = {}  # the position each request's first rows left stage 0 at
        self.lives: dict[str, list[int]] = {}  # ... for each of its lives (a replay starts another)
        self.after_step = lambda stage: None  # called after each stage's step: what a test checks throughout

    def ask(self, prompts: dict[str, list[int]], max_tokens: int = MAX_TOKENS, salt: str = "") -> dict[str, list[int]]:
        for rid, ids in prompts.items():
            self.inbox[0].append(InferenceRequest(rid, "", max_tokens=max_tokens, reply_to="http://runner",
                                                  prompt_token_ids=tuple(ids), cache_salt=salt))
        while any(self.inbox.values()) or any(a.queue.waiting for a in self.actors):
            for s, actor in enumerate(self.actors):
                messages, self.inbox[s] = self.inbox[s], []
                for m in messages:
                    self._act(s, actor.admit(m))
                if (step := actor.plan()) is not None:
                    self._act(s, actor.finish(step, actor.run(step, self.workers[s])))
                    self.after_step(s)
        return {rid: list(self.replies[rid].token_ids) for rid in prompts}

    def _act(self, stage: int, actions) -> None:
        for a in actions:
            if isinstance(a, Reply):
                self.replies[a.response.request_id] = a.response
            elif isinstance(a, Send):
                if stage == 0 and isinstance(a.message, Activation):
                    for seg in a.message.meta.segments:
                        if seg.start is not None:
                            self.starts[seg.request_id] = seg.position
                            self.lives.setdefault(seg.request_id, []).append(seg.position)
                self.inbox[int(a.dest.rsplit("-", 1)[1])].append(a.message)
            else:
                assert isinstance(a, Progress)

    def tokens(self, text: str) -> list[int]:
        return self.workers[0].vocabulary.tokenize(text, chat=False)

    def reference(self, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        return generate_full(self.model, ids, max_tokens).token_ids

    def assert_clean(self) -> None:
        """No request holds a slot anywhere, and every stage keeps the same entries stage 0 indexes."""
        assert all(w.active == frozenset() for w in self.workers)
        names = set(self.actors[0].cache.index.names())
        assert all(names <= set(w.kept) for w in self.workers)
        assert all(len(w.kept) <= self.max_seqs for w in self.workers)
