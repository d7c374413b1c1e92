"""The round-3 audit's findings (issue 54) that live at the API's edge, one regression test each; finding 1 (a
taken entry's writes reaching a slot that shares its pages) is tests/test_kv_pages.py's property test and
tests/test_prefix_cache.py's chain through the actors; finding 4 (a forged split) is tests/test_planning.py's.

- 7: one key's burst of costly requests (16 threads of 128 tools) held another key's 4-token chat 3 s: the
  preparation threads' turns are shared among keys (node/api/fair_turns.py).
- 8: a response_format whose grammar passes admission (its first byte walked) and exceeds the library's limits
  as the answer grows failed at the last stage with a 500 `stage_failed`: it is a 400 naming response_format.
- 9: a completion of more prompts than the chain's slots and queue hold got 429 "retry later" on an idle
  cluster, every time: its choices are admitted together. It is a 400 that says why and how many fit.
- 10: an empty completion prompt ran the chat template: echo returned template tokens the client never sent,
  and usage said 0 prompt tokens. It is refused with a 400 naming `prompt`, as vLLM refuses it.
"""
import json
import time

import httpx
import pytest
import trio

from cluster import API_KEY, start_cluster
from node.api import openai_api
from node.api.openai_fields import ApiError
from node.api.openai_read import prompts
from node.api.openai_tools import tool_setup
from node.api.openai_wire import parse_request
from worker.models import open_worker, stub_model
from worker.partition import Shard


@pytest.fixture(scope="module")
def vocabulary():
    return open_worker(stub_model(), Shard.of(0, 2)).vocabulary


@pytest.mark.parametrize("prompt, says", [("", "prompt is empty"), (["Say hello", ""], "prompt[1] is empty"),
                                          ([], "prompt: 0 prompts"), ([[1, 2], []], "prompt[1]: expected a string or "
                                                                                    "a non-empty array")],
                         ids=["an empty text", "one empty text of two", "no prompt", "one empty id list of two"])
def test_an_empty_completion_prompt_is_refused_naming_it(prompt, says):
    with pytest.raises(ApiError) as info:
        parse_request({"model": "stub", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2},
                      chat=False, seed_if_unset=0)
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "invalid_value")
    assert says in str(info.value)


def test_a_prompt_of_one_space_is_still_a_prompt(vocabulary):
    api = parse_request({"model": "stub", "prompt": " ", "max_tokens": 2}, chat=False, seed_if_unset=0)
    [(ids, text)] = prompts(vocabulary, api, tool_setup(None, None))
    assert ids and text == " "


# --- 9: a request that no retry could ever admit --------------------------------------------------------------

async def test_a_completion_with_more_prompts_than_slots_and_queue_together_is_a_400_not_a_429(nursery, tmp_path):
    """Its choices are admitted together or not at all: with 2 slots and 2 places in the queue, 5 prompts could
    never start, however idle the cluster. The audit got 429 "retry later" every time; it is a 400 saying why."""
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=2, max_queue=2)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        r = await client.post(urls[0] + "/v1/completions",
                              json={"model": "stub", "prompt": [f"Say hello {i}" for i in range(5)], "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "at most 4" in error["message"] and "could never start" in error["message"]
        r = await client.post(urls[0] + "/v1/completions",
                              json={"model": "stub", "prompt": [f"Say hello {i}" for i in range(4)], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
        r = await client.post(urls[0] + "/v1/chat/completions", json={
            "model": "stub", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2})
        assert r.status_code == 200, r.text  # n up to the slots, as before
    nursery.cancel_scope.cancel()


# --- 8: a schema that passes admission and fails as the answer grows ------------------------------------------

def wide_schema(properties: int = 1300) -> dict:
    """A short string first, then an object of many optional properties: admission walks the first byte, and the
    grammar library's limits bind only once the answer reaches the second property."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)}}
    return {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}, "b": wide},
            "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_response_format_that_fails_at_the_last_stage_is_a_400_naming_it(nursery, tmp_path, stream):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    body = {"model": "stub", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 200,
            "stream": stream, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "wide", "schema": wide_schema()}}}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        r = await client.post(urls[0] + "/v1/chat/completions", json=body)
        if stream:
            assert r.status_code == 200
            errors = [json.loads(line[6:])["error"] for line in r.text.splitlines()
                      if line.startswith("data: {") and '"error"' in line]
            assert len(errors) == 1, r.text[-2000:]
            error = errors[0]
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_value", error
    assert "response_format" in error["message"]
    nursery.cancel_scope.cancel()


# --- 7: one key's costly requests and another key's cheap one --------------------------------------------------

async def test_one_key_s_burst_of_costly_requests_does_not_hold_back_another_key_s(nursery, tmp_path, monkeypatch):
    """16 requests of one key, each costing 0.3 s of preparation (the audit's 128 tools), then one of another
    key: it is prepared after a turn or two, not after the whole burst (the two threads were first come, first
    served)."""
    started, real = [], openai_api.parse_request

    def parse_request(body, **kw):
        started.append(body["messages"][0]["content"])
        if body["messages"][0]["content"].startswith("costly"):
            time.sleep(0.3)
        return real(body, **kw)
    monkeypatch.setattr(openai_api, "parse_request", parse_request)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, api_keys=(API_KEY, "bystander-key"))

    async def chat(key: str, content: str):
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
            r = await client.post(urls[0] + "/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": content}], "max_tokens": 1})
            assert r.status_code == 200, r.text
    async with trio.open_nursery() as burst:
        for i in range(16):
            burst.start_soon(chat, API_KEY, f"costly {i}")
        with trio.fail_after(60):
            while len(started) < 2:  # the two threads are busy: the rest of the burst queues behind them
                await trio.sleep(0.05)
        await trio.sleep(0.2)
        assert len(started) < 8
        await chat("bystander-key", "hi")
        assert started.index("hi") < len(started) and started.index("hi") <= 8, started
    nursery.cancel_scope.cancel()
