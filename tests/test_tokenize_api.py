"""vLLM's POST /tokenize and POST /detokenize on pp-entry (node/api/tokenize_api.py): their shapes, that they give
the ids the completion endpoints compute, their bounds, and that they sit on the client surface.

Most tests serve stage 0's app over a stand-in entry whose worker is a real StageWorker on the tiny model's byte
tokenizer (Llama 3's chat template, real token spellings) and no weights; the last ones run a stub cluster."""
import threading
import types

import httpx
import pytest
import trio

from cluster import API_KEY, TOKEN, client_http, start_cluster
from node.api.openai_api import add_openai_routes
from node.api.openai_fields import ApiError
from node.api.tokenize_api import add_tokenize_routes, parse_detokenize, parse_tokenize
from node.transport.app import make_app, serve_app
from worker.contract import Kernels
from worker.partition import Shard
from worker.stage import StageWorker
from worker.tokens.tokenizer import byte_tokenizer
from worker.tokens.tool_prompt import with_tools
from worker.tokens.vocabulary import Vocabulary
from worker.tool_formats import GENERIC

KEY = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 64
LONGEST = len("<|start_header_id|>")  # the byte vocabulary's longest token, in characters
CHAT = [{"role": "user", "content": "Say hello"}]


class Entry:
    """Stage 0 as the API sees it, loaded, with no chain behind it: nothing is ever admitted."""

    swim, url, shard, hidden_dim, last_answer, max_seqs = None, None, Shard.of(0, 2).sized(2), 16, {}, 1

    def __init__(self, worker):
        self.worker, self.loading, self.serving = worker, False, True
        self.vocabulary = worker.vocabulary

    def health(self) -> dict:
        return {"ready": not self.loading}

    def deliver(self, message, **_):
        raise AssertionError("nothing is delivered here")

    async def wait_response(self, request_id, wait_s):
        return None


def byte_worker() -> StageWorker:
    weightless = types.SimpleNamespace(hidden_dim=16, vocab_size=byte_tokenizer().vocab_size, max_context=CONTEXT,
                                       weight_bytes=0, kv_bytes=0, max_seqs=1, max_batch=1, kernels=Kernels("stub"))
    vocabulary = Vocabulary(byte_tokenizer(), vocab_size=weightless.vocab_size, max_context=CONTEXT)
    return StageWorker(weightless, vocabulary, Shard.of(0, 2).sized(2))


@pytest.fixture
async def entry(nursery):
    node = Entry(byte_worker())
    app = make_app(node, token=TOKEN, max_body_bytes=1 << 20, api_keys=(API_KEY,))
    add_openai_routes(app, node, model_name="tiny")
    add_tokenize_routes(app, node, "tiny")
    port = await nursery.start(serve_app, app, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=KEY, timeout=10) as client:
        yield node, client
    nursery.cancel_scope.cancel()


async def post(client, path, body):
    r = await client.post(path, json=body)
    return r.status_code, r.json()


# -- what they answer -------------------------------------------------------------------------------------

async def test_a_prompt_is_tokenized_as_v1_completions_takes_it(entry):
    node, client = entry
    status, body = await post(client, "/tokenize", {"model": "tiny", "prompt": "Say <|eot_id|> hello"})
    ids = node.vocabulary.tokenizer.encode_prompt("Say <|eot_id|> hello")  # special-token text stays text
    assert status == 200 and body == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}


async def test_a_conversation_is_tokenized_through_the_chat_template_with_or_without_the_generation_prompt(entry):
    node, client = entry
    tok = node.vocabulary.tokenizer
    _, with_prompt = await post(client, "/tokenize", {"messages": CHAT})
    _, without = await post(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert with_prompt["tokens"] == tok.encode_messages(CHAT) == node.vocabulary.tokenize("Say hello")
    assert without["tokens"] == tok.encode_messages(CHAT, add_generation_prompt=False)
    assert with_prompt["count"] > without["count"]


async def test_token_strs_spell_each_token_as_the_vocabulary_does_when_asked(entry):
    _, client = entry
    _, plain = await post(client, "/tokenize", {"prompt": "a b"})
    _, spelled = await post(client, "/tokenize", {"messages": CHAT, "return_token_strs": True})
    assert "token_strs" not in plain
    assert spelled["token_strs"][:2] == ["<|begin_of_text|>", "<|start_header_id|>"]
    _, spaced = await post(client, "/tokenize", {"prompt": "a b", "return_token_strs": True})
    assert spaced["token_strs"] == ["a", "Ġ", "b"]  # byte-level BPE spells a space Ġ


async def test_detokenizing_what_tokenize_gave_is_the_text_the_template_wrote(entry):
    node, client = entry
    _, tokenized = await post(client, "/tokenize", {"messages": CHAT})
    status, body = await post(client, "/detokenize", {"model": "tiny", "tokens": tokenized["tokens"]})
    assert status == 200 and body == {"prompt": node.vocabulary.tokenizer.decode(tokenized["tokens"])}
    assert body["prompt"].startswith("<|begin_of_text|><|start_header_id|>user") and "Say hello" in body["prompt"]
    assert (await post(client, "/detokenize", {"tokens": []}))[1] == {"prompt": ""}


async def test_tokenizer_info_names_the_special_tokens_and_the_chat_template(entry):
    """What lm-eval's remote tokenizer reads before it sends a request (its probe needs eos_token)."""
    node, client = entry
    r = await client.get("/tokenizer_info")
    tok = node.vocabulary.tokenizer
    assert r.status_code == 200 and r.json() == {
        "tokenizer_class": "Tokenizer", "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": None,
        "chat_template": tok.chat_template, "model_max_length": CONTEXT}
    assert (await client.get("/tokenizer_info", headers={"Authorization": "Bearer wrong"})).status_code == 401


async def test_a_count_past_the_context_is_reported_not_refused(entry):
    _, client = entry
    status, body = await post(client, "/tokenize", {"prompt": "x" * (CONTEXT + 10)})
    assert status == 200 and body["count"] == CONTEXT + 10 > body["max_model_len"]


async def test_tokenizing_runs_in_a_worker_thread(entry, monkeypatch):
    node, client = entry
    loop_thread, threads = threading.get_ident(), []
    real = node.vocabulary.tokenize
    monkeypatch.setattr(node.vocabulary, "tokenize",
                        lambda *a, **kw: threads.append(threading.get_ident()) or real(*a, **kw))
    assert (await post(client, "/tokenize", {"prompt": "hi"}))[0] == 200
    assert threads and loop_thread not in threads


# -- how they refuse --------------------------------------------------------------------------------------

async def test_another_model_is_404_model_not_found(entry):
    _, client = entry
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
                       ("/detokenize", {"model": "gpt-4", "tokens": [1]})):
        status, answer = await post(client, path, body)
        assert (status, answer["error"]["code"], answer["error"]["param"]) == (404, "model_not_found", "model")


async def test_a_text_the_context_could_not_hold_is_refused_before_it_is_tokenized(entry, monkeypatch):
    node, client = entry
    monkeypatch.setattr(node.vocabulary, "tokenize", lambda *a, **kw: pytest.fail("tokenized"))
    monkeypatch.setattr(node.vocabulary, "tokenize_messages", lambda *a, **kw: pytest.fail("tokenized"))
    too_long = "x" * (CONTEXT * LONGEST + 1)
    for body, param in (({"prompt": too_long}, "prompt"), ({"messages": [{"role": "user", "content": too_long}]},
                                                           "messages")):
        status, answer = await post(client, "/tokenize", body)
        assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, "context_length_exceeded", param)


async def test_more_ids_than_the_context_or_ids_out_of_the_vocabulary_are_refused_naming_tokens(entry):
    node, client = entry
    vocab = node.worker.info.vocab_size
    for tokens, code in (([1] * (CONTEXT + 1), "context_length_exceeded"), ([1, vocab], "invalid_value"),
                         ([-1], "invalid_value"), ([1, True], "invalid_type"), ([1, "2"], "invalid_type")):
        status, answer = await post(client, "/detokenize", {"tokens": tokens})
        assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, code, "tokens"), tokens


async def test_a_body_past_what_the_context_could_need_is_413_in_openai_s_shape(entry):
    _, client = entry
    r = await client.post("/tokenize", content=b'{"prompt": "' + b"x" * (4 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_while_stage_0_loads_they_answer_503_in_openai_s_shape(entry):
    node, client = entry
    node.loading = True
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        status, answer = await post(client, path, body)
        assert (status, answer["error"]["code"]) == (503, "unavailable")


@pytest.mark.parametrize("body,param,code", [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": "a", "messages": CHAT}, "prompt", "invalid_value"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens", "invalid_type"),
    ({"prompt": "\ud800"}, "prompt", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt", "invalid_type"),
    ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", "unsupported_parameter"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message", "unsupported_parameter"),
    ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter"),
    ({"prompt": "a", "model": 3}, "model", "invalid_type"),
    ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs", "invalid_type"),
])
def test_a_bad_tokenize_body_is_refused_naming_the_parameter(body, param, code):
    with pytest.raises(ApiError) as info:
        parse_tokenize(body)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_vllm_s_defaults_hold_and_unknown_fields_are_ignored():
    req = parse_tokenize({"prompt": "a", "colour": "red", "add_generation_prompt": False})
    assert (req.model, req.prompt, req.add_special_tokens, req.return_token_strs) == (None, "a", True, False)
    chat = parse_tokenize({"model": "m", "messages": CHAT, "add_special_tokens": False,
                           "continue_final_message": False})
    assert (chat.model, chat.messages, chat.add_generation_prompt) == ("m", tuple(CHAT), True)
    assert parse_detokenize({"tokens": [3, 1], "colour": "red"}) == (None, (3, 1))
    with pytest.raises(ApiError) as info:
        parse_detokenize({"model": "m"})
    assert info.value.param == "tokens"


# -- on a stub cluster --------------------------------------------------------------------------------------

async def test_they_take_a_client_api_key_and_refuse_the_token_in_openai_s_shape(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    async with client_http(timeout=10) as client:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [2, 3]})):
            for headers, status, code in (({}, 401, "invalid_api_key"), (KEY, 200, None),
                                          ({"Authorization": f"Bearer {TOKEN}"}, 403, None)):
                r = await client.post(urls[0] + path, json=body, headers=headers)
                assert r.status_code == status, (path, r.text)
                if status != 200:
                    assert r.json()["error"]["code"] == code and TOKEN not in r.text
        r = await client.post(urls[0] + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}, headers=KEY)
        with_bos = await client.post(urls[0] + "/tokenize", json={"prompt": "hi"}, headers=KEY)
        assert [0, *r.json()["tokens"]] == with_bos.json()["tokens"]  # the stand-in's BOS is 0
        assert (await client.post(urls[1] + "/tokenize", json={"prompt": "hi"}, headers=KEY)).status_code == 404
    nursery.cancel_scope.cancel()


async def test_a_served_prompt_is_counted_as_its_completion_uses_it(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    async with client_http(timeout=30, headers=KEY) as client:
        with trio.fail_after(30):
            done = await client.post(urls[0] + "/v1/chat/completions", json={"model": "stub", "messages": CHAT,
                                                                               "max_tokens": 2})
        counted = await client.post(urls[0] + "/tokenize", json={"model": "stub", "messages": CHAT})
    assert done.json()["usage"]["prompt_tokens"] == counted.json()["count"]
    nursery.cancel_scope.cancel()


async def test_a_conversation_with_tools_is_counted_as_the_chat_endpoint_shows_them(entry):
    node, client = entry
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    status, body = await post(client, "/tokenize", {"messages": CHAT, "tools": [tool]})
    told = with_tools(CHAT, [tool], GENERIC)  # the byte vocabulary's template takes no tools: the generic prompt
    assert status == 200 and body["tokens"] == node.vocabulary.tokenize_messages(told)
    status, plain = await post(client, "/tokenize", {"messages": CHAT, "tools": [tool], "tool_choice": "none"})
    assert plain["tokens"] == node.vocabulary.tokenize_messages(CHAT)  # none: the tools are not shown
