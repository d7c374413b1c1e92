"""A request's cost is bounded before any work on it (issue 33): a body's size does not show what rendering and
tokenizing it costs (9,000 empty messages are 297 KB, and were 0.87 s of template and tokenizer holding the GIL,
refused only after; 8 such at once stalled /health 2.3 s). So a conversation's turns, its characters (tool
calls included) and a request's choices are bounded while it is parsed; what a template writes is capped as it
writes it; and parsing, rendering and tokenizing run in worker threads, PREPARE_THREADS at a time."""
import functools
import json
import threading

import pytest
import trio

from cluster import API_KEY, client_http, start_cluster
from node.api import openai_read
from node.api.openai_fields import ApiError
from node.api.openai_messages import MAX_MESSAGES, MessageBudget, messages
from node.api.openai_wire import MAX_PROMPTS, limits_for, parse_request
from worker.errors import WorkerError
from worker.stub import StubTokenizer
from worker.tokens.chat import LLAMA3_TEMPLATE, render, render_limit

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
EMPTY = {"role": "user", "content": ""}


def refused(body, budget: MessageBudget) -> ApiError:
    with pytest.raises(ApiError) as info:
        messages(body, budget)
    return info.value


def tool_history(calls: int, arguments: str = "{}") -> list[dict]:
    call = [{"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": arguments}} for k in range(calls)]
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": call},
            *({"role": "tool", "tool_call_id": f"c{k}", "content": "r"} for k in range(calls))]


@pytest.mark.parametrize("context,longest,turns,chars", [
    (512, 19, 512, 512 * 19),  # tiny: a turn is at least a token of the context
    (8192, 16, MAX_MESSAGES, 8192 * 16),  # OpenAI's own cap on a chat's messages
    (131072, 40, MAX_MESSAGES, 131072 * 40),
])
def test_a_model_s_limits_bound_a_conversation_s_turns_and_characters(context, longest, turns, chars):
    budget = limits_for(vocab_size=100, max_seqs=4, max_context=context, longest_token_bytes=longest).messages
    assert (budget.max_messages, budget.max_chars) == (turns, chars)


def test_more_turns_than_the_budget_are_refused_before_any_turn_is_read():
    budget = MessageBudget(max_messages=512)
    error = refused({"messages": [EMPTY] * 9000}, budget)
    assert (error.param, error.code) == ("messages", "invalid_value") and "9000 messages" in error.message
    error = refused({"messages": [EMPTY] * 512 + ["not even a message"]}, budget)
    assert "513 messages" in error.message  # refused on the count, before the bad turn is seen
    assert len(messages({"messages": [EMPTY] * 512}, budget)) == 512


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 41}]},
    {"messages": [{"role": "user", "content": "x" * 90, "name": "n" * 11}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}]},
    {"messages": tool_history(1, json.dumps({"a": "x" * 100}))},  # a tool call's arguments are template input
    {"messages": tool_history(20)},  # ids, names and arguments of many calls
])
def test_a_conversation_past_the_characters_the_context_could_hold_is_refused_while_it_is_read(body):
    error = refused(body, MessageBudget(max_chars=100))
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    messages(body, MessageBudget(max_chars=1000))  # within a larger budget, the same conversation is fine


def test_a_turn_with_more_tool_calls_than_turns_could_answer_is_refused_before_they_are_read():
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": ["junk"] * 65}]}
    error = refused(body, MessageBudget(max_messages=64))
    assert error.param == "messages[0].tool_calls" and "65 calls" in error.message


@pytest.mark.parametrize("prompts,n,ok", [(256, 1, True), (128, 2, True), (129, 2, False), (64, 4, True),
                                          (65, 4, False)])
def test_a_request_s_choices_n_times_prompts_are_at_most_max_prompts(prompts, n, ok):
    body = {"model": "m", "prompt": ["p"] * prompts, "n": n}
    if ok:
        assert len(parse_request(body, chat=False, seed_if_unset=0, limits=limits_for(
            vocab_size=100, max_seqs=8, max_context=64, longest_token_bytes=4)).prompts) == prompts
        return
    with pytest.raises(ApiError) as info:
        parse_request(body, chat=False, seed_if_unset=0, limits=limits_for(
            vocab_size=100, max_seqs=8, max_context=64, longest_token_bytes=4))
    assert info.value.param == "n" and str(MAX_PROMPTS) in info.value.message


RUNAWAY = "{% for m in messages %}{% for i in range(100000) %}{{ m['content'] }}{% endfor %}{% endfor %}"


def test_a_template_that_writes_past_the_render_limit_is_stopped_as_it_writes():
    conversation = [{"role": "user", "content": "x" * 100}] * 4
    with pytest.raises(WorkerError, match="wrote more than"):
        render(RUNAWAY, conversation, bos_token="<s>", eos_token="</s>")
    text = render(LLAMA3_TEMPLATE, conversation, bos_token="<s>", eos_token="</s>")
    assert "x" * 100 in text and len(text) < render_limit(conversation)


async def test_at_most_prepare_threads_prepare_requests_at_once():
    running, most, full, release = [0], [0], threading.Event(), threading.Event()
    lock = threading.Lock()

    def work():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] == openai_read.PREPARE_THREADS:
                full.set()
        release.wait(10)
        with lock:
            running[0] -= 1
    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(openai_read.prepared, work)
        assert await trio.to_thread.run_sync(full.wait, 10)
        await trio.sleep(0.2)  # room for a third to start, were there no limit
        release.set()
    assert most[0] == openai_read.PREPARE_THREADS


async def test_eight_requests_of_9000_empty_messages_are_refused_unrendered_and_health_answers_meanwhile(
        nursery, tmp_path, monkeypatch):
    """The issue's "done when": 8 such requests at once are refused, none of them rendered or tokenized, and
    /health answers within 0.5 s all the while (bench/hostile_api.py measures it against real node processes).
    Compact JSON: 9,000 empty turns fit the stand-in's body limit (its context is 512 tokens)."""
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4)
    rendered = []
    real = StubTokenizer.encode_messages
    monkeypatch.setattr(StubTokenizer, "encode_messages", lambda self, m, **kw: rendered.append(len(m)) or real(
        self, m, **kw))
    body = json.dumps({"model": "stub", "messages": [EMPTY] * 9000}, separators=(",", ":")).encode()
    statuses, latencies, done = [], [], trio.Event()

    async def poll(client):
        while not done.is_set():
            sent = trio.current_time()
            assert (await client.get(urls[0] + "/health")).status_code == 200
            latencies.append(trio.current_time() - sent)
            await trio.sleep(0.02)

    async def send(client):
        r = await client.post(urls[0] + "/v1/chat/completions", content=body)
        statuses.append((r.status_code, r.json()["error"]["param"]))

    async with client_http(timeout=30) as health, client_http(timeout=60, headers=AUTH) as api:
        async with trio.open_nursery() as n:
            n.start_soon(poll, health)
            async with trio.open_nursery() as senders:
                for _ in range(8):
                    senders.start_soon(send, api)
            done.set()
        ok = await api.post(urls[0] + "/v1/chat/completions", content=json.dumps(
            {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    assert statuses == [(400, "messages")] * 8 and rendered == [1] and ok.status_code == 200
    assert latencies and max(latencies) < 0.5, f"/health took up to {max(latencies):.3f} s"
    nursery.cancel_scope.cancel()


PROBES = {  # the audit's classes, each through the served API
    "a lone surrogate in cache_salt": b'{"model": "stub", "prompt": "hi", "max_tokens": 2, "cache_salt": "\\ud800"}',
    "temperature 1e400": b'{"model": "stub", "prompt": "hi", "temperature": 1e400}',
    "a 5,000-digit logit_bias key": b'{"model": "stub", "prompt": "hi", "logit_bias": {"' + b"1" * 5000 + b'": 1}}',
    "a schema's bounds of 10**30": b'{"model": "stub", "prompt": "hi", "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "n", "schema": {"type": "integer", "maximum": 1' + b"0" * 30 + b'}}}}',
    "a recursive $ref": b'{"model": "stub", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
        b'{"name": "n", "schema": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}}',
}


async def test_each_class_of_the_audit_s_bad_fields_is_an_openai_shaped_400_and_the_node_serves_on(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4)
    answers = {}
    async with client_http(timeout=30, headers=AUTH) as api:
        for name, body in PROBES.items():
            with trio.fail_after(20):
                r = await api.post(urls[0] + "/v1/completions", content=body)
            answers[name] = (r.status_code, set(r.json().get("error", {})))
        with trio.fail_after(20):
            ok = await api.post(urls[0] + "/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 2,
                                                                   "cache_salt": "s"})
    assert answers == {name: (400, {"message", "type", "param", "code"}) for name in PROBES}
    assert ok.status_code == 200
    nursery.cancel_scope.cancel()
