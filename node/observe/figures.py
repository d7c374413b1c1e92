"""A stage's running figures besides its hop timings (hops.py): stage 0's request metrics (prompt tokens, time
to the first token and between tokens, how requests ended), the figures of the last answer it followed (the
chat page shows them), and the batched steps it computed (/health)."""
from __future__ import annotations

from roles.actions import Progress
from roles.messages import InferenceResponse

from node.observe import hops
from node.observe.metrics import NodeMetrics


FIRST_STEPS = 16  # steps whose compute times a node logs once (`first_steps`): bench/boot.py, bench/failover.py


class StageFigures:
    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics
        self._timing: dict[str, list[float]] = {}  # stage 0: [admitted, last token] of requests (their metrics)
        self.last_answer: dict = {}  # stage 0: figures of the last answer followed here
        self.steps = self.rows = 0
        self.compute_s = 0.0
        self.first_steps: list[tuple[int, float]] = []  # (rows, compute ms) of the first FIRST_STEPS steps

    def admitted(self, request_id: str, prompt_tokens: int | None) -> None:
        """Stage 0 admitted a request (`prompt_tokens` is None where the actor did not take it in)."""
        if prompt_tokens is not None:
            self.metrics.prompt.inc(prompt_tokens)
            self._timing[request_id] = [hops.now()]

    def progressed(self, progress: Progress) -> None:
        """Stage 0's request metrics: a token came back, or the request ended."""
        timing = self._timing.get(progress.request_id)
        if progress.token_id is not None:
            self.metrics.generated.inc()
            if timing is not None:
                now = hops.now()
                (self.metrics.ttft if len(timing) == 1 else self.metrics.tpot).observe(now - timing[-1])
                timing[1:] = [now]
        if progress.end is not None:
            self.metrics.ended.labels(progress.end.reason.value).inc()
            self._timing.pop(progress.request_id, None)

    def answered(self, response: InferenceResponse) -> None:
        """The last stage's figures of an answer followed here."""
        n = len(response.token_ids)
        if n and response.error is None:
            self.last_answer = {"tokens": n, "stage_ms_per_token": [ms / n for ms in response.stage_compute_ms],
                                "decode_tokens_per_s": round((n - 1) / response.decode_s, 2)
                                if n > 1 and response.decode_s > 0 else None}

    def stepped(self, rows: int, compute_s: float, took_s: float) -> bool:
        """A step of `rows` computed for `compute_s` on the compute thread, `took_s` with the trips there and back.
        True once the first FIRST_STEPS are in: the node logs them (no step after a boot compiles anything)."""
        self.metrics.step.observe(compute_s)
        self.compute_s += took_s
        self.steps += 1
        self.rows += rows
        if len(self.first_steps) < FIRST_STEPS:
            self.first_steps.append((rows, round(compute_s * 1000, 2)))
            return len(self.first_steps) == FIRST_STEPS
        return False

    def health(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "compute_s": round(self.compute_s, 3)}
