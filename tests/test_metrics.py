"""GET /metrics on every node: Prometheus' text format, read back with prometheus_client's own parser, and
counters that move by what a request did; every series names the served model, as vLLM's do."""
import trio
from prometheus_client.parser import text_string_to_metric_families

from cluster import API_KEY, client_http, start_cluster
from worker.models import stub_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}  # a scraper is a client (over TLS, without a certificate)
MODEL_NAME = "served-stub"  # what the API calls the model: not the model argument


async def scrape(client, url) -> dict:
    """{(sample name, frozenset of labels): value} of one node's /metrics."""
    r = await client.get(url + "/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples, name, **labels):
    return samples.get((name, frozenset({"model_name": MODEL_NAME, **labels}.items())), 0.0)


async def test_metrics_parse_and_move_by_what_one_request_did(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 3, tmp_path, model_name=MODEL_NAME)
    messages = [{"role": "user", "content": "Say hello"}]
    prompt = len(stub_model().tokenizer().encode_messages(messages))
    async with client_http(timeout=30) as client:
        assert (await client.get(urls[0] + "/metrics")).status_code == 401  # it takes a client API key
        before = [await scrape(client, u) for u in urls]
        with trio.fail_after(30):
            r = await client.post(urls[0] + "/v1/chat/completions", headers=AUTH, json={
                "model": MODEL_NAME, "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with trio.fail_after(10):  # the request's end reaches stages 1.. after its answer: their slots free then
            after = [await scrape(client, u) for u in urls]
            while any(value(a, "pp_slots_in_use") for a in after):
                await trio.sleep(0.05)
                after = [await scrape(client, u) for u in urls]
    entry0, entry1 = before[0], after[0]
    moved = lambda name, **labels: value(entry1, name, **labels) - value(entry0, name, **labels)  # noqa: E731
    assert moved("pp_generated_tokens_total") == 5
    assert moved("pp_prompt_tokens_total") == prompt
    assert moved("pp_requests_total", reason="finished") == 1
    assert moved("pp_time_to_first_token_seconds_count") == 1
    assert moved("pp_time_per_output_token_seconds_count") == 4
    assert value(entry1, "pp_requests_running") == 0 and value(entry1, "pp_requests_queued") == 0
    assert ("pp_num_preemptions_total", frozenset({("model_name", MODEL_NAME)})) in entry1  # none: room to spare
    assert value(entry1, "pp_num_preemptions_total") == 0
    for stage, (b, a) in enumerate(zip(before, after)):
        assert value(a, "pp_step_compute_seconds_count") > value(b, "pp_step_compute_seconds_count"), stage
        assert ("pp_weight_bytes", frozenset({("model_name", MODEL_NAME)})) in a  # the stub weighs 0
        assert value(a, "pp_peak_rss_bytes") > 0
        # the finished request's KV is the prefix cache's now: none held by a request, its positions cached
        total, cached = value(a, "pp_kv_cache_positions", state="total"), value(a, "pp_kv_cache_positions", state="cached")
        assert value(a, "pp_kv_cache_positions", state="used") == 0 and prompt <= cached <= prompt + 5
        assert total > cached and value(a, "pp_kv_cache_usage_perc") == cached / total
        assert value(a, "pp_gossip_members", state="alive") == 4  # three stages and the orchestrator
        assert value(a, "pp_gossip_members", state="dead") == 0
    # the hop into stage 1 was timed on the wire, and in the queue before its step
    assert value(after[1], "pp_hop_seconds_count", hop="from pp-stage-0", part="queue") > 0
    nursery.cancel_scope.cancel()


async def test_every_series_of_every_node_is_labelled_with_the_served_model_name(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, model_name=MODEL_NAME)
    async with client_http(timeout=30) as client:
        scraped = [await scrape(client, u) for u in urls]
    for samples in scraped:
        assert {"pp_slots_in_use", "pp_gossip_members", "pp_generated_tokens_total",
                "pp_step_compute_seconds_count"} <= {name for name, _ in samples}
        assert {dict(labels).get("model_name") for _, labels in samples} == {MODEL_NAME}
    nursery.cancel_scope.cancel()



async def test_the_prefix_cache_counts_tokens_looked_up_and_found_and_health_shows_its_blocks(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, model_name=MODEL_NAME)
    messages = [{"role": "system", "content": "You answer in one short line, always politely."},
                {"role": "user", "content": "Say hello"}]
    prompt = len(stub_model().tokenizer().encode_messages(messages))
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    async with client_http(timeout=30) as client:
        for _ in range(2):  # the second starts after the whole blocks of the first's prompt
            with trio.fail_after(30):
                assert (await client.post(urls[0] + "/v1/chat/completions", headers=AUTH, json=body)).status_code == 200
        samples = await scrape(client, urls[0])
        healths = [(await client.get(u + "/health")).json() for u in urls]
    health = healths[0]["prefix_cache"]
    assert [h["slots_kept"] for h in healths] == [1, 1]  # every stage holds the one entry stage 0 indexes
    assert value(samples, "pp_prefix_cache_queries_total") == 2 * prompt
    assert value(samples, "pp_prefix_cache_hits_total") == (prompt - 1) // 16 * 16 > 0
    assert value(samples, "pp_prefix_cache_blocks") == health["blocks"] == (prompt + 4) // 16
    assert (health["enabled"], health["entries"], health["block_size"]) == (True, 1, 16)
    nursery.cancel_scope.cancel()
