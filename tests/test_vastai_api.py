"""The vast.ai client against httpx.MockTransport: the requests it sends (shaped as the official
CLI's), its retries, and what each kind of failure becomes. No network, no real sleeping."""
from __future__ import annotations

import json
import traceback

import httpx
import pytest

from runner.vastai_api import (Instance, Offer, OfferUnavailable, VastClient, VastError,
                               classify_failure, mapped_port, offer_query, should_retry_exception,
                               should_retry_status)

KEY = "k3y-0f-the-acc0unt-7d1e"
BASE = "http://vast.test"


class Sleeps:
    def __init__(self):
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class FakeVast:
    """Answers each request with the next scripted reply for its (method, path); the last reply of
    a script repeats. A reply is an httpx.Response or an exception to raise."""

    def __init__(self, script: dict[tuple[str, str], list]):
        self.script = script
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        replies = self.script[(request.method, request.url.path)]
        reply = replies.pop(0) if len(replies) > 1 else replies[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def client(self, sleeps: Sleeps | None = None, **kw) -> VastClient:
        return VastClient(KEY, base_url=BASE, transport=httpx.MockTransport(self.handle),
                          sleep=sleeps or Sleeps(), **kw)

    def bodies(self) -> list:
        return [json.loads(r.content) if r.content else None for r in self.requests]


def ok(body) -> httpx.Response:
    return httpx.Response(200, json=body)


def rate_limited() -> httpx.Response:
    # vast's 429 is plain text with no Retry-After
    return httpx.Response(429, text="API requests too frequent endpoint threshold=2.0")


OFFER_JSON = {"id": 4242, "machine_id": 17, "host_id": 9, "gpu_name": "RTX 4090", "num_gpus": 1,
              "gpu_ram": 24564, "dph_total": 0.412, "reliability": 0.995, "direct_port_count": 20,
              "inet_down": 812.5, "inet_up": 640.1, "public_ipaddr": " 203.0.113.7\n",
              "geolocation": "Norway, NO", "cuda_max_good": 12.4, "score": 91.2, "rentable": True}

INSTANCE_JSON = {"id": 777, "actual_status": "running", "intended_status": "running",
                 "cur_state": "running", "status_msg": "success, running ...",
                 "public_ipaddr": "203.0.113.7 ", "label": "pp-stage-2",
                 "ports": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "41001"}],
                           "22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "40022"}]},
                 "extra_env": [["STAGE", "2"], ["NUM_STAGES", "5"]], "start_date": 1.7e9}


# ---------------------------------------------------------------------------------- pure parts

@pytest.mark.parametrize("kw, expected_filters", [
    (dict(min_gpu_ram_gb=24, min_reliability=0.98, max_dph=None, min_direct_ports=2,
          exclude_ids=[], limit=20),
     {"gpu_ram": {"gte": 24000}, "reliability": {"gte": 0.98}, "direct_port_count": {"gte": 2}}),
    (dict(min_gpu_ram_gb=7.5, min_reliability=0.9, max_dph=0.5, min_direct_ports=1,
          exclude_ids={31, 5}, limit=64),
     {"gpu_ram": {"gte": 7500}, "reliability": {"gte": 0.9}, "direct_port_count": {"gte": 1},
      "dph_total": {"lte": 0.5}, "id": {"notin": [5, 31]}}),
])
def test_offer_query_uses_raw_api_units_and_the_cli_defaults(kw, expected_filters):
    query = offer_query(**kw)
    assert query == {"verified": {"eq": True}, "external": {"eq": False},
                     "rentable": {"eq": True}, "rented": {"eq": False}, "num_gpus": {"eq": 1},
                     **expected_filters, "order": [["dph_total", "asc"]], "type": "on-demand",
                     "limit": kw["limit"], "allocated_storage": 5.0}


@pytest.mark.parametrize("status, body, expected", [
    (400, '{"success": false, "error": "no_such_ask", "msg": "Instance type 4242 is gone"}',
     "offer_gone"),
    (404, '{"error": "no_such_ask"}', "offer_gone"),
    (410, '{"msg": "offer 4242 is not available"}', "offer_gone"),
    (404, '{"success": false, "error": "auth_error", "msg": "Invalid user key"}', "auth"),
    (401, "Unauthorized", "auth"),
    (400, '{"success": false, "error": "insufficient_credit", "msg": "Your balance is too low"}', "fatal"),
    (400, '{"success": false, "error": "invalid_args", "msg": "disk must be > 0"}', "fatal"),
    (503, "Service not available", "fatal"),
])
def test_failed_responses_are_classified(status, body, expected):
    error = json.loads(body).get("error") if body.startswith("{") else None
    assert classify_failure(status, error, body) == expected


@pytest.mark.parametrize("status, replayable, expected", [
    (429, True, True), (429, False, True), (503, True, True), (502, True, True), (504, True, True),
    (503, False, False), (500, True, False), (400, True, False), (404, True, False),
])
def test_which_statuses_are_retried(status, replayable, expected):
    assert should_retry_status(status, replayable=replayable) is expected


@pytest.mark.parametrize("exc, replayable, expected", [
    (httpx.ConnectError("refused"), False, True),
    (httpx.ConnectTimeout("slow"), False, True),
    (httpx.ReadTimeout("slow"), True, True),
    (httpx.ReadTimeout("slow"), False, False),
    (httpx.RemoteProtocolError("dropped"), False, False),
    (httpx.UnsupportedProtocol("ftp"), True, False),
])
def test_which_transport_errors_are_retried(exc, replayable, expected):
    assert should_retry_exception(exc, replayable=replayable) is expected


def test_offer_parsing_is_lenient():
    offer = Offer.from_json(OFFER_JSON)
    assert (offer.id, offer.gpu_ram_mb, offer.dph_total, offer.public_ipaddr) == \
        (4242, 24564.0, 0.412, "203.0.113.7")
    sparse = Offer.from_json({"id": 5, "dph_total": 1})
    assert sparse.id == 5 and sparse.gpu_name is None and sparse.reliability is None


def test_instance_parsing_strips_the_ip_and_turns_extra_env_into_a_dict():
    inst = Instance.from_json(INSTANCE_JSON)
    assert inst.public_ipaddr == "203.0.113.7"
    assert inst.extra_env == {"STAGE": "2", "NUM_STAGES": "5"}
    assert Instance.from_json({"id": 1, "ports": None}).ports == {}


@pytest.mark.parametrize("ports, internal, proto, expected", [
    (INSTANCE_JSON["ports"], 8000, "tcp", 41001),
    (INSTANCE_JSON["ports"], 22, "tcp", 40022),
    (INSTANCE_JSON["ports"], 8000, "udp", None),
    ({}, 8000, "tcp", None),
    ({"8000/tcp": []}, 8000, "tcp", None),
])
def test_mapped_port_reads_dockers_string_host_port(ports, internal, proto, expected):
    inst = Instance.from_json({**INSTANCE_JSON, "ports": ports})
    assert mapped_port(inst, internal, proto) == expected


# ---------------------------------------------------------------------------------- request shapes

async def test_search_posts_the_query_to_bundles_with_bearer_auth():
    fake = FakeVast({("POST", "/api/v0/bundles/"): [ok({"offers": [OFFER_JSON, {"id": 9}]})]})
    query = {"gpu_ram": {"gte": 8000}, "type": "on-demand"}
    async with fake.client() as vast:
        offers = await vast.search_offers(query)
    assert [o.id for o in offers] == [4242, 9]
    (request,) = fake.requests
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert KEY not in str(request.url)
    assert fake.bodies() == [query]


async def test_base_url_path_is_kept_before_api_v0():
    fake = FakeVast({("POST", "/proxy/api/v0/bundles/"): [ok({"offers": []})]})
    vast = VastClient(KEY, base_url=BASE + "/proxy/", transport=httpx.MockTransport(fake.handle))
    async with vast:
        assert await vast.search_offers({}) == []


async def test_create_sends_the_clis_body_and_returns_the_new_contract():
    fake = FakeVast({("PUT", "/api/v0/asks/4242/"): [ok({"success": True, "new_contract": 7835610})]})
    async with fake.client() as vast:
        instance_id = await vast.create_instance(
            4242, image="ghcr.io/x/pp:1", env={"STAGE": "0", "NUM_STAGES": "3"}, ports=[8000],
            disk_gb=20, label="pp-0", onstart="/bin/sh", args=["-c", "exec python ppnode.py"])
    assert instance_id == 7835610
    assert fake.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert fake.bodies() == [{
        "client_id": "me", "image": "ghcr.io/x/pp:1",
        "env": {"STAGE": "0", "NUM_STAGES": "3", "-p 8000:8000": "1"},
        "price": None, "disk": 20, "label": "pp-0", "extra": None, "onstart": "/bin/sh",
        "image_login": None, "python_utf8": False, "lang_utf8": False, "use_jupyter_lab": False,
        "jupyter_dir": None, "force": False, "cancel_unavail": True, "template_hash_id": None,
        "user": None, "runtype": "args", "args": ["-c", "exec python ppnode.py"]}]


async def test_show_asks_for_owner_me_and_parses_the_instance():
    fake = FakeVast({("GET", "/api/v0/instances/777/"): [ok({"instances": INSTANCE_JSON})]})
    async with fake.client() as vast:
        inst = await vast.show_instance(777)
    assert fake.requests[0].url.params["owner"] == "me"
    assert (inst.id, inst.actual_status, mapped_port(inst, 8000)) == (777, "running", 41001)


async def test_show_of_a_gone_instance_is_none():
    fake = FakeVast({("GET", "/api/v0/instances/5/"): [ok({"instances": None})]})
    async with fake.client() as vast:
        assert await vast.show_instance(5) is None


async def test_destroy_sends_delete_with_an_empty_body():
    fake = FakeVast({("DELETE", "/api/v0/instances/777/"): [ok({"success": True, "msg": "destroyed"})]})
    async with fake.client() as vast:
        await vast.destroy_instance(777)
    assert fake.bodies() == [{}]


async def test_destroy_of_an_instance_already_gone_is_fine():
    gone = httpx.Response(404, json={"success": False, "error": "no_such_instance"})
    fake = FakeVast({("DELETE", "/api/v0/instances/777/"): [gone]})
    async with fake.client() as vast:
        await vast.destroy_instance(777)


@pytest.mark.parametrize("reply", [
    httpx.Response(404, text="<html>Not Found</html>"),  # not the API: a wrong base URL
    httpx.Response(404, json={"success": False, "error": "auth_error", "msg": "Invalid user key"}),
])
async def test_destroy_does_not_take_a_foreign_404_for_gone(reply):
    fake = FakeVast({("DELETE", "/api/v0/instances/777/"): [reply]})
    async with fake.client() as vast:
        with pytest.raises(VastError, match="DELETE /api/v0/instances/777/"):
            await vast.destroy_instance(777)


async def test_logs_are_fetched_from_the_result_url_without_auth_once_ready():
    sleeps = Sleeps()
    fake = FakeVast({("PUT", "/api/v0/instances/request_logs/777/"):
                     [ok({"result_url": "http://logs.test/abc.log"})],
                     ("GET", "/abc.log"): [httpx.Response(404), httpx.Response(200, text="booted\n")]})
    async with fake.client(sleeps) as vast:
        assert await vast.instance_logs(777) == "booted\n"
    put, *gets = fake.requests
    assert json.loads(put.content) == {"tail": "1000"}
    assert [g.url.host for g in gets] == ["logs.test", "logs.test"]
    assert all("authorization" not in g.headers for g in gets)
    assert len(sleeps.delays) == 1


async def test_logs_that_never_appear_fail_after_about_ten_seconds():
    sleeps = Sleeps()
    fake = FakeVast({("PUT", "/api/v0/instances/request_logs/777/"):
                     [ok({"result_url": "http://logs.test/abc.log"})],
                     ("GET", "/abc.log"): [httpx.Response(404)]})
    async with fake.client(sleeps) as vast:
        with pytest.raises(VastError, match="logs of instance 777"):
            await vast.instance_logs(777)
    assert 8 <= sum(sleeps.delays) <= 12


# ---------------------------------------------------------------------------------- retries, errors

async def test_429_twice_then_success_backs_off_exponentially():
    sleeps = Sleeps()
    fake = FakeVast({("POST", "/api/v0/bundles/"): [rate_limited(), rate_limited(),
                                                   ok({"offers": [OFFER_JSON]})]})
    async with fake.client(sleeps) as vast:
        assert [o.id for o in await vast.search_offers({})] == [4242]
    assert len(fake.requests) == 3
    assert sleeps.delays == pytest.approx([0.15, 0.30])


async def test_429_forever_gives_up_after_max_retries():
    sleeps = Sleeps()
    fake = FakeVast({("POST", "/api/v0/bundles/"): [rate_limited()]})
    async with fake.client(sleeps, max_retries=3) as vast:
        with pytest.raises(VastError) as caught:
            await vast.search_offers({})
    assert len(fake.requests) == 4 and len(sleeps.delays) == 3
    assert caught.value.status == 429
    assert "POST /api/v0/bundles/" in str(caught.value) and "too frequent" in str(caught.value)


async def test_connection_errors_are_retried():
    boom = httpx.ConnectError("connection refused")
    fake = FakeVast({("GET", "/api/v0/instances/1/"): [boom, boom, ok({"instances": None})]})
    async with fake.client() as vast:
        assert await vast.show_instance(1) is None
    assert len(fake.requests) == 3


@pytest.mark.parametrize("failure", [httpx.Response(503, text="upstream"),
                                     httpx.ReadTimeout("no answer")])
async def test_a_create_that_may_have_taken_effect_is_not_repeated(failure):
    fake = FakeVast({("PUT", "/api/v0/asks/4242/"): [failure, ok({"new_contract": 1})]})
    async with fake.client() as vast:
        with pytest.raises(VastError, match="PUT /api/v0/asks/4242/"):
            await vast.create_instance(4242, image="i", env={}, disk_gb=10, label="pp-0")
    assert len(fake.requests) == 1


async def test_a_rate_limited_create_is_retried():
    fake = FakeVast({("PUT", "/api/v0/asks/4242/"): [rate_limited(), ok({"new_contract": 11})]})
    async with fake.client() as vast:
        assert await vast.create_instance(4242, image="i", env={}, disk_gb=10, label="pp-0") == 11


@pytest.mark.parametrize("reply", [
    httpx.Response(400, json={"success": False, "error": "no_such_ask",
                              "msg": "Instance type 4242 is no longer available."}),
    httpx.Response(404, text="no_such_ask"),
    ok({"success": False, "error": "no_such_ask", "msg": "ask 4242 not available"}),
])
async def test_a_vanished_offer_raises_offer_unavailable(reply):
    fake = FakeVast({("PUT", "/api/v0/asks/4242/"): [reply]})
    async with fake.client() as vast:
        with pytest.raises(OfferUnavailable, match="asks/4242"):
            await vast.create_instance(4242, image="i", env={}, disk_gb=10, label="pp-0")


async def test_insufficient_credit_is_fatal_not_a_vanished_offer():
    reply = httpx.Response(400, json={"success": False, "error": "insufficient_credit",
                                      "msg": "Your account lacks credit"})
    fake = FakeVast({("PUT", "/api/v0/asks/4242/"): [reply]})
    async with fake.client() as vast:
        with pytest.raises(VastError) as caught:
            await vast.create_instance(4242, image="i", env={}, disk_gb=10, label="pp-0")
    assert type(caught.value) is VastError and caught.value.error == "insufficient_credit"


async def test_a_refused_key_says_so():
    reply = httpx.Response(404, json={"success": False, "error": "auth_error",
                                      "msg": "Invalid user key"})
    fake = FakeVast({("POST", "/api/v0/bundles/"): [reply]})
    async with fake.client() as vast:
        with pytest.raises(VastError, match="refused the API key") as caught:
            await vast.search_offers({})
    assert caught.value.error == "auth_error" and len(fake.requests) == 1


async def test_the_api_key_never_appears_in_errors_or_reprs():
    echo = httpx.Response(400, json={"error": "invalid_args", "msg": f"bad request for {KEY}"})
    fake = FakeVast({
        ("POST", "/api/v0/bundles/"): [rate_limited()],
        ("PUT", "/api/v0/asks/1/"): [echo],
        ("GET", "/api/v0/instances/2/"): [httpx.ConnectError("refused")],
        ("DELETE", "/api/v0/instances/3/"): [httpx.Response(404, json={"error": "auth_error"})],
    })
    caught = []
    async with fake.client(max_retries=1) as vast:
        for call in (lambda: vast.search_offers({}),
                     lambda: vast.create_instance(1, image="i", env={}, disk_gb=1, label="l"),
                     lambda: vast.show_instance(2), lambda: vast.destroy_instance(3)):
            with pytest.raises(VastError) as info:
                await call()
            caught.append(info.value)
        shown = [repr(vast)] + [s for e in caught
                                for s in (str(e), repr(e), "".join(traceback.format_exception(e)))]
    assert len(caught) == 4
    assert not [s for s in shown if KEY in s]
