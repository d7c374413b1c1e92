"""Hostile clients with an API key (issue 23), one finding of the audit per group, each against a live
in-process cluster of the stand-in model (tests/cluster.py) where that is what it needs:

- a poison request (a seed numpy refuses, a temperature that overflows, a compute job that raises) fails
  alone, naming the stage, and the stage goes on; a request that failed is never replayed;
- a client that leaves — over HTTP/1.1 or HTTP/2, before or after the first byte, streamed or not — has its
  request cancelled, and every slot and record of it freed (bench/hostile.py: how soon);
- work on the event loop is bounded: stop strings are capped and matched in linear time, a prompt longer
  than the context could hold is refused untokenized, and tokenizing runs in a thread, so /health answers
  meanwhile (bench/hostile.py: how fast);
- a malformed body is a 400 in OpenAI's shape, never an HTML 500;
- the chat page is sent with a strict Content-Security-Policy, nosniff and no framing."""
import logging

import httpx
import numpy as np
import pytest
import trio

from cluster import API_KEY, start_cluster, stub_tokens
from node.openai_wire import ApiError, parse_request
from roles import make_actor
from roles.messages import EndReason, EndRequest, InferenceRequest
from worker.errors import WorkerError
from worker.models import open_worker, stub_model
from worker.sampling import Sampling, sample
from worker.stage import StageWorker, StepItem

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "Say hello"}]}


async def health(urls):
    async with httpx.AsyncClient() as c:
        return [(await c.get(u + "/health")).json() for u in urls]


async def until_idle(urls, within_s=10.0):
    """Every stage holds no slot, and stage 0 neither runs, queues nor follows a request: within `within_s`."""
    deadline = trio.current_time() + within_s
    while True:
        hs = await health(urls)
        left = {"slots": [h["slots_in_use"] for h in hs], "active": hs[0]["slots"]["active"],
                "waiting": hs[0]["queue"]["waiting"], "followed": hs[0].get("followed", 0)}
        if not any(left["slots"]) and not (left["active"] or left["waiting"] or left["followed"]):
            return
        assert trio.current_time() < deadline, f"still held after {within_s} s: {left}"
        await trio.sleep(0.05)


# -- one request's failure is that request's alone ------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2 ** 64, -2 ** 70])
def test_a_seed_outside_0_to_2_64_is_refused_naming_seed(seed):
    with pytest.raises(ApiError) as info:
        parse_request({**CHAT, "seed": seed}, chat=True, seed_if_unset=0)
    assert (info.value.status, info.value.param) == (400, "seed")
    assert parse_request({**CHAT, "seed": 2 ** 64 - 1}, chat=True, seed_if_unset=0).sampling.seed == 2 ** 64 - 1


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-6])
def test_a_temperature_below_the_sampling_floor_samples_greedily(temperature):
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)  # a positive maximum: inf - inf without the floor
    assert sample(logits, Sampling(temperature=temperature), np.random.default_rng(0)) == 1


def test_a_seed_numpy_refuses_fails_its_own_request_and_the_rest_of_the_step_computes():
    worker = open_worker(stub_model(), 1, 2, max_seqs=4)
    hidden = b"\0" * 4 * worker.info.hidden_dim
    items = [StepItem("bad", 0, hidden=hidden, seq_len=1, sampling=Sampling(1.0, 1.0, -1)),
             StepItem("good", 0, hidden=hidden, seq_len=1, sampling=Sampling(1.0, 1.0, 7))]
    bad, good = worker.run(items)
    assert isinstance(bad, WorkerError) and "seed" in str(bad)
    assert isinstance(good, np.ndarray) and worker.active == {"good"}


@pytest.mark.parametrize("stage", [0, 1])
async def test_a_compute_job_that_raises_fails_its_request_naming_the_stage_and_the_stage_goes_on(
        nursery, tmp_path, monkeypatch, caplog, stage):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4)
    real_run = StageWorker.run

    def poisoned_run(self, items):
        if self.info.stage == stage and any(i.request_id == "poison" for i in items):
            raise RuntimeError("injected: the kernel fell over")
        return real_run(self, items)
    monkeypatch.setattr(StageWorker, "run", poisoned_run)
    with trio.fail_after(30):
        failed = await orch.submit("Say hello", request_id="poison", max_tokens=6)
        assert failed.failed_stage == stage
        assert failed.error == f"stage {stage}: compute failed: RuntimeError: injected: the kernel fell over"
        for i in range(3):  # the stage is still there, and serves everyone else
            r = await orch.submit(f"prompt {i}", max_tokens=6)
            assert r.error is None and list(r.token_ids) == stub_tokens(f"prompt {i}", 6)
        await until_idle(urls)
    [logged] = [r for r in caplog.records if r.getMessage() == "step_failed"]
    assert logged.levelno == logging.ERROR and logged.exc_info[0] is RuntimeError
    nursery.cancel_scope.cancel()


def test_a_request_that_failed_a_stage_is_not_replayed_into_its_replacement():
    n = 3
    workers = [open_worker(stub_model(), s, n) for s in range(n)]
    first = make_actor(0, n, workers[0])
    first.set_chain(("m1", "m2"), standing=True)
    first.admit(InferenceRequest("r", "Say hello", max_tokens=8, reply_to="http://runner"))
    step = first.plan()
    first.finish(step, first.run(step, workers[0]))  # its prompt is on its way to stage 1
    first.set_chain(("m1-new", "m2"), standing=True)  # stage 1 replaced: the request starts its next life
    assert first.live["r"].generation == 1
    # stage 2 had computed the first life and failed it: a replay computes the same again, so it ends
    actions = first.admit(EndRequest("r", EndReason.FAILED, "stage 2: compute failed: ValueError: x", 2, 0,
                                     poison=True))
    assert "r" not in first.live and [a for a in actions if getattr(a, "response", None)]
    assert first.set_chain(("m1-new", "m2-new"), standing=True) == [] and "r" not in first.live
