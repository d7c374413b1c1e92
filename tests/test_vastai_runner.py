"""Spec tier 5: the --vastai runner against mocked vast.ai HTTP — distinct stages, exact rollback."""
import json

import attrs
import httpx
import pytest
import trio

from runner.common import RunFailed
from runner.ledger import Ledger
from runner.vastai import VastOptions, destroy_leftovers, pick_offers, run_vastai
from runner.vastai_api import Offer
from worker.contract import GREEDY


class FakeVast:
    """Just enough of the API: offers on distinct machines, creates numbered from 100, a failure
    injected at one create, instances that never run (the tests end before that matters)."""

    def __init__(self, *, fail_create_at: int | None = None, error: str = "insufficient_credit"):
        self.fail_create_at, self.error = fail_create_at, error
        self.created, self.destroyed, self.create_bodies = [], [], []

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/v0/bundles/":
            offers = [{"id": 500 + i, "machine_id": i, "gpu_name": "RTX 4090", "dph_total": 0.3 + i / 100,
                       "gpu_ram": 24000, "reliability": 0.99, "direct_port_count": 10} for i in range(8)]
            return httpx.Response(200, json={"offers": offers})
        if path.startswith("/api/v0/asks/"):
            if len(self.create_bodies) + 1 == self.fail_create_at:
                self.create_bodies.append(json.loads(request.content))
                return httpx.Response(400, json={"success": False, "error": self.error, "msg": "no"})
            self.create_bodies.append(json.loads(request.content))
            self.created.append(100 + len(self.created))
            return httpx.Response(200, json={"success": True, "new_contract": self.created[-1]})
        if path.startswith("/api/v0/instances/") and request.method == "DELETE":
            self.destroyed.append(int(path.rstrip("/").rsplit("/", 1)[1]))
            return httpx.Response(200, json={"success": True})
        if path.startswith("/api/v0/instances/request_logs/"):
            return httpx.Response(200, json={"result_url": "http://logs.invalid/x"})
        if path.startswith("/api/v0/instances/"):
            iid = int(path.rstrip("/").rsplit("/", 1)[1])
            return httpx.Response(200, json={"instances": {"id": iid, "actual_status": "loading", "ports": {}}})
        if request.url.host == "logs.invalid":
            return httpx.Response(200, text="node log line\n")
        return httpx.Response(404, json={"error": "not_found"})


def options(tmp_path, n=5, **kw) -> VastOptions:
    return VastOptions(num_stages=n, model="llama3.2:1b", prompt="Say hello", max_tokens=4, sampling=GREEDY,
                       timeout_s=5, converge_timeout_s=5, vast_api_key="secret-key", base_url="http://vast.test",
                       image="me/pp-node:1", ledger_path=tmp_path / "live.json", running_timeout_s=0.5,
                       poll_status_s=0.1, **kw)


async def test_n_creates_carry_distinct_stages_and_every_instance_is_destroyed(tmp_path):
    fake = FakeVast()
    with pytest.raises(RunFailed, match="stage 0: instance 100 not running after"):
        await run_vastai(options(tmp_path), lambda line: None, transport=httpx.MockTransport(fake.handler))
    envs = [body["env"] for body in fake.create_bodies]
    assert [e["STAGE"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert {e["NUM_STAGES"] for e in envs} == {"5"} and {e["MODEL"] for e in envs} == {"llama3.2:1b"}
    assert len({e["PP_CLUSTER_TOKEN"] for e in envs}) == 1 and all("-p 8000:8000" in e for e in envs)
    assert len({e["PP_API_KEY"] for e in envs}) == 1 and envs[0]["PP_API_KEY"] != envs[0]["PP_CLUSTER_TOKEN"]
    assert all("secret-key" not in str(e) for e in envs)  # the vast.ai key stays with the runner
    assert sorted(fake.destroyed) == fake.created == [100, 101, 102, 103, 104]
    assert Ledger(tmp_path / "live.json").ids() == []


@pytest.mark.parametrize("fail_at", [1, 3, 5])
async def test_a_failed_create_rolls_back_exactly_the_instances_created(tmp_path, fail_at):
    fake = FakeVast(fail_create_at=fail_at)
    with pytest.raises(RunFailed, match="insufficient_credit"):
        await run_vastai(options(tmp_path), lambda line: None, transport=httpx.MockTransport(fake.handler))
    assert fake.created == [100 + i for i in range(fail_at - 1)]
    assert sorted(fake.destroyed) == fake.created
    assert Ledger(tmp_path / "live.json").ids() == []


async def test_cancelling_the_runner_still_destroys_everything(tmp_path):
    fake = FakeVast()
    opts = options(tmp_path, n=3)
    with trio.move_on_after(0.3):  # as Ctrl-C would, while waiting for instances to run
        await run_vastai(attrs.evolve(opts, running_timeout_s=60),
                         lambda line: None, transport=httpx.MockTransport(fake.handler))
    assert sorted(fake.destroyed) == fake.created and fake.created


async def test_leftovers_recorded_by_a_killed_runner_are_destroyed(tmp_path):
    ledger = Ledger(tmp_path / "live.json")
    for i in (7, 8):
        ledger.add(i)
    fake = FakeVast()
    assert await destroy_leftovers("k", "http://vast.test", tmp_path / "live.json", lambda line: None,
                                   transport=httpx.MockTransport(fake.handler)) == 2
    assert sorted(fake.destroyed) == [7, 8] and ledger.ids() == []


def test_offers_are_picked_cheapest_first_one_per_machine():
    offers = [Offer.from_json({"id": i, "machine_id": m, "dph_total": p})
              for i, m, p in [(1, 10, 0.5), (2, 10, 0.1), (3, 11, 0.3), (4, 12, 0.2), (5, 13, None)]]
    assert [o.id for o in pick_offers(offers, 3)] == [2, 4, 3]
    assert [o.id for o in pick_offers(offers, 9)] == [2, 4, 3, 5]
