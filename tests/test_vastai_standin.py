"""The vast.ai stand-in: the JSON shapes the official CLI expects, offers filtered by vast's operators, the
instance lifecycle with a real process behind a port forwarder, logs, and each injectable fault."""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tools.vastai_standin import StandinConfig, container_env, parse_args, run_standin, split_env

KEY = {"Authorization": "Bearer test-key"}
FAST = {"step_s": 0.05, "spawn": False}
# A container that says hello with what vast.ai put in its environment, then idles.
CHATTY = (sys.executable, "-c", "import os, time\n"
          "print('hello from', os.environ['PUBLIC_IPADDR'], os.environ.get('GREETING'), flush=True)\n"
          "print('second line', flush=True)\ntime.sleep(60)")
VASTAI = Path(sys.executable).parent / "vastai"


async def start(nursery, **knobs) -> str:
    return await nursery.start(functools.partial(run_standin, StandinConfig(**{**FAST, **knobs})))


def api(url: str, headers=KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=10, trust_env=False)


async def create(client, offer_id: int, env: dict | None = None) -> httpx.Response:
    return await client.put(f"/api/v0/asks/{offer_id}/", json={
        "client_id": "me", "image": "pp:test", "env": env or {}, "disk": 10, "runtype": "args"})


async def created_id(client, offer_id: int, env: dict | None = None) -> int:
    response = await create(client, offer_id, env)
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    return response.json()["new_contract"]


async def show(client, instance_id: int) -> dict | None:
    response = await client.get(f"/api/v0/instances/{instance_id}/", params={"owner": "me"})
    assert response.status_code == 200, response.text
    return response.json()["instances"]


async def wait_status(client, instance_id: int, wanted: str, timeout: float = 10) -> dict:
    with trio.fail_after(timeout):
        while (inst := await show(client, instance_id))["actual_status"] != wanted:
            await trio.sleep(0.02)
    return inst


async def destroy(client, instance_id: int) -> httpx.Response:
    return await client.request("DELETE", f"/api/v0/instances/{instance_id}/", json={})  # as the CLI sends it


async def search(client, query: dict) -> list[dict]:
    response = await client.post("/api/v0/bundles/", json=query)
    assert response.status_code == 200, response.text
    return response.json()["offers"]


async def fetch_logs(client, instance_id: int, **body) -> str:
    """The CLI's way: request, then poll the result_url (the first GET is 404: the real one lags)."""
    response = await client.put(f"/api/v0/instances/request_logs/{instance_id}/", json=body)
    url = response.json()["result_url"]
    async with api(url, headers={}) as bare:  # result URLs need no key
        assert (await bare.get(url)).status_code == 404
        second = await bare.get(url)
    assert second.status_code == 200
    return second.text


OPERATOR_CASES = [
    ({"gpu_ram": {"gte": 24000}}, lambda o: o["gpu_ram"] >= 24000),
    ({"gpu_name": {"eq": "RTX 4090"}}, lambda o: o["gpu_name"] == "RTX 4090"),
    ({"gpu_name": {"neq": "RTX 4090"}}, lambda o: o["gpu_name"] != "RTX 4090"),
    ({"dph_total": {"lt": 0.35}}, lambda o: o["dph_total"] < 0.35),
    ({"dph_total": {"lte": 0.35}}, lambda o: o["dph_total"] <= 0.35),
    ({"reliability": {"gt": 0.99}}, lambda o: o["reliability"] > 0.99),
    ({"gpu_name": {"in": ["RTX 3090", "L40S"]}}, lambda o: o["gpu_name"] in ("RTX 3090", "L40S")),
    ({"num_gpus": {"notin": [2]}}, lambda o: o["num_gpus"] != 2),
    # the CLI sends numbers and booleans as text
    ({"gpu_ram": {"gte": "24000.0"}, "num_gpus": {"eq": "1"}, "verified": {"eq": "true"}},
     lambda o: o["gpu_ram"] >= 24000 and o["num_gpus"] == 1 and o["verified"]),
    ({"verified": {"eq": True}, "direct_port_count": {"gte": 2}, "reliability": {"gte": 0.98},
      "order": [["dph_total", "asc"]], "type": "on-demand", "allocated_storage": 20.0},
     lambda o: o["verified"] and o["direct_port_count"] >= 2 and o["reliability"] >= 0.98),
]


@pytest.mark.parametrize("query, keep", OPERATOR_CASES)
async def test_search_returns_exactly_the_offers_that_pass_the_query(nursery, query, keep):
    async with api(await start(nursery)) as client:
        everything = await search(client, {})
        expected = {o["id"] for o in everything if keep(o)}
        assert 0 < len(expected) < len(everything) == 12  # the case discriminates
        assert {o["id"] for o in await search(client, query)} == expected


async def test_search_orders_by_the_given_keys_then_limits(nursery):
    async with api(await start(nursery)) as client:
        by_price = await search(client, {"order": [["dph_total", "asc"]]})
        prices = [o["dph_total"] for o in by_price]
        assert prices == sorted(prices) and len(set(prices)) == 12
        assert [o["dph_total"] for o in await search(client, {"order": [["dph_total", "desc"]]})] == prices[::-1]
        scores = [o["score"] for o in await search(client, {})]  # vast's default order: score, best first
        assert scores == sorted(scores, reverse=True)
        two_keys = await search(client, {"order": [["num_gpus", "desc"], ["dph_total", "asc"]]})
        pairs = [(o["num_gpus"], o["dph_total"]) for o in two_keys]
        assert pairs == sorted(pairs, key=lambda p: (-p[0], p[1])) and pairs[0][0] == 2
        limited = await search(client, {"order": [["dph_total", "asc"]], "limit": 3})
        assert [o["id"] for o in limited] == [o["id"] for o in by_price[:3]]


async def test_the_query_string_and_new_search_endpoints_agree_with_post(nursery):
    query = {"gpu_ram": {"gte": 40000}, "order": [["dph_total", "asc"]]}
    async with api(await start(nursery)) as client:
        posted = await search(client, query)
        got = await client.get("/api/v0/bundles/", params={"q": json.dumps(query)})
        put = await client.put("/api/v0/search/asks/", json={"select_cols": ["*"], "q": query})
        assert got.json()["offers"] == put.json()["offers"] == posted


@pytest.mark.parametrize("query", [{"no_such_field": {"eq": 1}}, {"gpu_ram": {"about": 1}},
                                   {"gpu_name": {"in": "RTX 4090"}}, {"gpu_ram": {"gte": "lots"}},
                                   {"order": [["dph_total", "sideways"]]}, {"order": [["dph_total"]]}])
async def test_a_query_it_cannot_evaluate_is_refused_as_invalid_args(nursery, query):
    async with api(await start(nursery)) as client:
        response = await client.post("/api/v0/bundles/", json=query)
        assert response.status_code == 400 and response.json()["error"] == "invalid_args"


async def test_an_instance_is_created_shown_listed_and_destroyed(nursery):
    async with api(await start(nursery)) as client:
        instance_id = await created_id(client, 21001003, {"STAGE": "0", "-p 8000:8000": "1"})
        assert (await show(client, instance_id))["actual_status"] == "created"
        await wait_status(client, instance_id, "loading")
        inst = await wait_status(client, instance_id, "running")
        assert inst["public_ipaddr"] == "127.0.0.1" and inst["machine_id"] and inst["start_date"] > 0
        assert inst["extra_env"] == [["STAGE", "0"]] and inst["image_uuid"] == "pp:test"
        assert int(inst["ports"]["8000/tcp"][0]["HostPort"]) > 0
        listed = (await client.get("/api/v1/instances/", params={"limit": 25})).json()
        assert [i["id"] for i in listed["instances"]] == [instance_id] and listed["next_token"] is None
        destroyed = await destroy(client, instance_id)
        assert destroyed.json()["success"] is True
        assert await show(client, instance_id) is None
        assert (await client.get("/api/v1/instances/")).json()["instances"] == []
        assert (await destroy(client, instance_id)).status_code == 404


async def test_the_instance_list_pages_with_next_token_and_filters(nursery):
    async with api(await start(nursery)) as client:
        ids = [await created_id(client, offer) for offer in (21001001, 21001002, 21001003)]
        first = (await client.get("/api/v1/instances/", params={"limit": 2})).json()
        rest = (await client.get("/api/v1/instances/", params={"limit": 2, "after_token": first["next_token"]})).json()
        assert [i["id"] for i in first["instances"] + rest["instances"]] == ids and rest["next_token"] is None
        only = {"select_filters": json.dumps({"gpu_name": {"in": ["RTX 3090"]}})}
        assert [i["id"] for i in (await client.get("/api/v1/instances/", params=only)).json()["instances"]] == ids[2:]


async def test_an_offer_can_be_rented_only_once(nursery):
    async with api(await start(nursery)) as client:
        await created_id(client, 21001005)
        again = await create(client, 21001005)
        assert again.status_code == 404 and again.json()["error"] == "no_such_ask"
        assert 21001005 not in {o["id"] for o in await search(client, {"rentable": {"eq": True}})}
        assert [o["id"] for o in await search(client, {"rented": {"eq": True}})] == [21001005]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}])
async def test_a_request_without_a_key_gets_auth_error(nursery, headers):
    async with api(await start(nursery), headers=headers) as client:
        for response in (await client.post("/api/v0/bundles/", json={}),
                         await create(client, 21001001), await client.get("/api/v1/instances/")):
            assert response.status_code == 404 and response.json()["error"] == "auth_error"
        assert (await client.get("/api/v0/bundles/", params={"api_key": "old-style"})).status_code == 200


async def test_every_nth_request_is_rate_limited_in_plain_text(nursery):
    async with api(await start(nursery, rate_limit_every=3)) as client:
        responses = [await client.get("/api/v1/instances/") for _ in range(7)]
    assert [r.status_code for r in responses] == [200, 200, 429, 200, 200, 429, 200]
    limited = responses[2]
    assert limited.text == "API requests too frequent" and "retry-after" not in limited.headers
    assert limited.headers["content-type"].startswith("text/plain")


async def test_a_burst_rate_limits_the_first_requests(nursery):
    async with api(await start(nursery, rate_limit_burst=2)) as client:
        statuses = [(await client.get("/api/v1/instances/")).status_code for _ in range(4)]
    assert statuses == [429, 429, 200, 200]


async def test_the_first_creates_find_their_offer_gone(nursery):
    async with api(await start(nursery, vanish_first_creates=1)) as client:
        vanished = await create(client, 21001001)
        assert vanished.status_code == 404 and vanished.json()["error"] == "no_such_ask"
        assert 21001001 not in {o["id"] for o in await search(client, {"rentable": {"eq": True}})}
        assert (await create(client, 21001001)).status_code == 404  # taken for good
        await created_id(client, 21001002)


async def test_a_stuck_instance_never_leaves_loading(nursery):
    async with api(await start(nursery, stuck_loading=frozenset({2}))) as client:
        first, second, third = [await created_id(client, o) for o in (21001001, 21001002, 21001003)]
        await wait_status(client, first, "running")
        await wait_status(client, third, "running")
        await trio.sleep(0.2)
        assert (await show(client, second))["actual_status"] == "loading"


async def test_logs_carry_the_containers_output_with_its_environment(nursery):
    async with api(await start(nursery, spawn=True, node_command=CHATTY)) as client:
        instance_id = await created_id(client, 21001001, {"GREETING": "hi", "-p 8000:8000": "1"})
        await wait_status(client, instance_id, "running")
        with trio.fail_after(10):
            while "second line" not in (text := await fetch_logs(client, instance_id)):
                await trio.sleep(0.05)
        assert text == "hello from 127.0.0.1 hi\nsecond line\n"
        assert await fetch_logs(client, instance_id, tail="1") == "second line\n"
        assert await fetch_logs(client, instance_id, filter="hello") == "hello from 127.0.0.1 hi\n"


async def test_a_process_that_ends_leaves_its_instance_exited(nursery):
    command = (sys.executable, "-c", "print('bye', flush=True); raise SystemExit(3)")
    async with api(await start(nursery, spawn=True, node_command=command)) as client:
        instance_id = await created_id(client, 21001001, {"-p 8000:8000": "1"})
        inst = await wait_status(client, instance_id, "exited")
        assert "code 3" in inst["status_msg"] and inst["ports"] == {}
        assert await fetch_logs(client, instance_id) == "bye\n"


async def test_an_instance_set_to_die_is_killed_after_it_starts(nursery):
    async with api(await start(nursery, spawn=True, node_command=CHATTY, die_after_s={2: 0.3})) as client:
        survivor, doomed = [await created_id(client, o) for o in (21001001, 21001002)]
        inst = await wait_status(client, doomed, "exited")
        assert "code -9" in inst["status_msg"]
        assert (await show(client, survivor))["actual_status"] == "running"


async def test_stopping_the_standin_stops_every_process():
    async with trio.open_nursery() as nursery:
        async with api(await start(nursery, spawn=True, node_command=CHATTY)) as client:
            ids = [await created_id(client, o) for o in (21001001, 21001002)]
            for instance_id in ids:
                await wait_status(client, instance_id, "running")
            state = (await client.get("/standin/state")).json()["instances"]
        nursery.cancel_scope.cancel()
    for instance_id in ids:
        with pytest.raises(ProcessLookupError):
            os.kill(state[str(instance_id)]["pid"], 0)


async def test_a_real_node_answers_through_its_mapped_port_until_destroyed(nursery):
    env = {"MODEL": "stub", "STAGE": "0", "NUM_STAGES": "2", "PP_CLUSTER_TOKEN": "x", "PP_PORT": "8000",
           "-p 8000:8000": "1"}
    async with api(await start(nursery, spawn=True)) as client:
        instance_id = await created_id(client, 21001002, env)
        inst = await wait_status(client, instance_id, "running")
        public = f"127.0.0.1:{inst['ports']['8000/tcp'][0]['HostPort']}"
        async with api(f"http://{public}", headers={}) as node:  # stage 0's port answers plain HTTP too
            with trio.fail_after(30):
                while True:
                    try:
                        health = await node.get("/health")
                        break
                    except httpx.TransportError:  # the node is still starting; the forwarder hangs up
                        await trio.sleep(0.1)
            # alone, stage 0 has no chain behind it to serve with: 503, and the body still says who answers
            assert health.status_code == 503 and health.json()["stage"] == 0
            # it advertises F, as a member's address: https://
            assert f"PP_GPU_NODE_ADDR=https://{public}\n" in await fetch_logs(client, instance_id)
            pid = (await client.get("/standin/state")).json()["instances"][str(instance_id)]["pid"]
            assert (await destroy(client, instance_id)).json()["success"]
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
            with pytest.raises(httpx.TransportError):
                await node.get("/health")


async def vastai(url: str, home: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / "config"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_STATE_HOME=str(home / "state"), XDG_DATA_HOME=str(home / "data"),
               VAST_URL=url, VASTAI_NO_UPDATE_CHECK="1")  # VAST_URL: it fetches GPU names at import
    done = await trio.run_process([str(VASTAI), "--url", url, "--api-key", "test-key", *args], env=env,
                                  capture_stdout=True, capture_stderr=True, check=False)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"vastai {' '.join(args)}: exit {done.returncode}\n{out}\n{err}"
    # it exits 0 even after an HTTP error, so read what it said
    assert "Failed with error" not in err and "Traceback" not in err, f"vastai {' '.join(args)}:\n{err}"
    return out


async def test_the_official_cli_searches_creates_shows_lists_fetches_logs_and_destroys(nursery, tmp_path):
    if not VASTAI.exists():
        pytest.skip(f"the official CLI is not installed ({VASTAI}): pip install vastai")
    url = await start(nursery, spawn=True, node_command=CHATTY)
    offers = json.loads(await vastai(url, tmp_path, "search", "offers", "gpu_ram>=24 num_gpus=1 reliability>0.98",
                                     "-o", "dph", "--raw"))
    assert offers and all(o["gpu_ram"] >= 24000 and o["num_gpus"] == 1 and o["reliability"] > 0.98 for o in offers)
    assert [o["dph_total"] for o in offers] == sorted(o["dph_total"] for o in offers)
    made = json.loads(await vastai(url, tmp_path, "create", "instance", str(offers[0]["id"]), "--image", "pp:test",
                                   "--env", "-e GREETING=hi -p 8000:8000", "--disk", "20", "--raw"))
    instance_id = made["new_contract"]
    assert made["success"] is True
    async with api(url) as client:
        await wait_status(client, instance_id, "running")
    shown = json.loads(await vastai(url, tmp_path, "show", "instance", str(instance_id), "--raw"))
    assert shown["id"] == instance_id and shown["extra_env"] == {"GREETING": "hi"} and shown["ports"]["8000/tcp"]
    listed = json.loads(await vastai(url, tmp_path, "show", "instances", "--raw"))
    assert [i["id"] for i in listed] == [instance_id]
    assert "running" in await vastai(url, tmp_path, "show", "instances")
    assert "hello from 127.0.0.1 hi" in await vastai(url, tmp_path, "logs", str(instance_id))
    assert f"destroying instance {instance_id}." in await vastai(url, tmp_path, "destroy", "instance",
                                                                 str(instance_id), "-y")
    assert json.loads(await vastai(url, tmp_path, "show", "instance", str(instance_id), "--raw")) == {"instances": None}


SPLIT_CASES = [
    ({"A": "1", "-p 8000:8000": "1"}, ({"A": "1"}, [8000])),
    ({"-p 8081:8081/udp": "1", "-p 22:22/tcp": "1", "-h box": "1"}, ({}, [22])),
    ({"N": 3, "-p 41000:8000": "1"}, ({"N": "3"}, [8000])),  # the container's port is the one after ':'
    ({"-p nonsense": "1"}, ({}, [])),
]


@pytest.mark.parametrize("env, expected", SPLIT_CASES)
def test_env_splits_into_variables_and_mapped_tcp_ports(env, expected):
    assert split_env(env) == expected


def test_the_node_env_maps_its_own_port_to_the_nominal_ports_forwarder():
    base = {"PATH": "/bin", "VAST_TCP_PORT_9": "1", "PUBLIC_IPADDR": "10.0.0.1", "PP_BIND": "0.0.0.0"}
    env = container_env(base, {"PP_PORT": "8000", "X": "y"}, node_port=5555, public={8000: 40001, 22: 40002})
    assert env == {"PATH": "/bin", "X": "y", "PP_PORT": "5555", "PP_BIND": "127.0.0.1", "PUBLIC_IPADDR": "127.0.0.1",
                   "VAST_TCP_PORT_8000": "40001", "VAST_TCP_PORT_22": "40002", "VAST_TCP_PORT_5555": "40001",
                   "PYTHONUNBUFFERED": "1", "PP_STDIN_LIFELINE": "1"}


def test_command_line_flags_set_the_fault_knobs():
    config = parse_args(["--port", "0", "--no-spawn", "--vanish-first-creates", "2", "--rate-limit-every", "5",
                         "--rate-limit-burst", "3", "--stuck-loading", "2", "--stuck-loading", "4",
                         "--die-after", "3:1.5"])
    assert (config.port, config.spawn, config.vanish_first_creates, config.rate_limit_every,
            config.rate_limit_burst, config.stuck_loading, config.die_after_s) == (
        0, False, 2, 5, 3, frozenset({2, 4}), {3: 1.5})
