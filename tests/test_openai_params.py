"""The API evaluation and agent tools expect, through an in-process cluster of the stand-in model: logprobs
(with echo, as lm-eval's loglikelihood asks), several prompts and choices, vLLM's stopping extensions, and
lengths past the context refused as vLLM refuses them. Each answer is checked against one process."""
import functools

import httpx
import pytest
import trio

from cluster import API_KEY, api, slow_stub, start_cluster
from worker.batching import Segment
from worker.contract import Sampling
from worker.logprobs import token_logprobs
from worker.models import stub_model
from worker.reference import generate_full
from worker.stub import StubTokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOK = StubTokenizer()


@pytest.fixture
async def entry(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 3, tmp_path, max_seqs=4, max_queue=8, chunked_prefill_size=3)
    async with httpx.AsyncClient(base_url=api(urls[0]), headers=AUTH, timeout=60) as client:
        yield client


def one_process_prompt_logprobs(ids, top):
    model = stub_model()
    full = model.open_slice(range(model.total_blocks), embed=True, head=True)
    logits = full.forward_batch(full.embed(ids), [Segment(0, 0, len(ids))], logit_rows=range(len(ids)))
    return token_logprobs(logits[:-1], ids[1:], top)


async def complete(entry, **body) -> dict:
    r = await entry.post("/v1/completions", json={"model": "stub", **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_echo_with_max_tokens_0_gives_the_prompt_s_logprobs_as_one_process_computes_them(entry):
    prompt = "the quick brown fox"
    ids = TOK.encode_prompt(prompt)
    body = await complete(entry, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    [choice] = body["choices"]
    want = one_process_prompt_logprobs(ids, 2)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"] == [None] + [w.logprob for w in want]
    assert lp["top_logprobs"][1:] == [{TOK.decode([i]): v for i, v in w.top} for w in want]
    assert lp["tokens"] == [TOK.decode([i]) for i in ids] and lp["text_offset"] == list(range(len(ids)))


async def test_lm_eval_s_loglikelihood_request_batches_prompts_of_token_ids(entry):
    """local-completions sends token ids, echo, logprobs 1 and max_tokens 1, several prompts at once, and
    reads token_logprobs[ctxlen:-1]: the prompt's, then the one generated token's."""
    prompts = [TOK.encode("question one answer"), TOK.encode("second"), TOK.encode("a third prompt")]
    body = await complete(entry, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    model = stub_model()
    for ids, choice in zip(prompts, body["choices"]):
        lps = choice["logprobs"]["token_logprobs"]
        assert lps[:-1] == [None] + [w.logprob for w in one_process_prompt_logprobs(ids, 1)]
        gen = generate_full(model, ids, 1)
        assert lps[-1] == token_logprobs(gen.logits[0][None], gen.token_ids, 1)[0].logprob
        assert len(lps) == len(ids) + 1


async def test_n_choices_draw_from_seed_plus_their_index_and_stream_by_index(entry):
    ids = TOK.encode_prompt("abc")
    body = await complete(entry, prompt="abc", n=3, temperature=1.0, seed=11, max_tokens=6)
    model = stub_model()
    want = [TOK.decode([t for t in generate_full(model, ids, 6, Sampling(1.0, 1.0, 11 + j)).token_ids
                        if t not in TOK.stop_ids]) for j in range(3)]
    assert [c["text"] for c in body["choices"]] == want and len(set(want)) > 1
    r = await entry.post("/v1/completions", json={"model": "stub", "prompt": "abc", "n": 3, "temperature": 1.0,
                                                  "seed": 11, "max_tokens": 6, "stream": True})
    texts = {0: "", 1: "", 2: ""}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                texts[c["index"]] += c["text"]
    assert [texts[j] for j in range(3)] == want


async def test_ignore_eos_gives_exactly_the_tokens_asked_for(entry):
    forced_eos = {"1": 100}  # the stand-in's stop id, made certain
    body = await complete(entry, prompt="abc", max_tokens=7, logit_bias=forced_eos, temperature=0)
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (1, "stop")
    body = await complete(entry, prompt="abc", max_tokens=7, logit_bias=forced_eos, temperature=0, ignore_eos=True)
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (7, "length")


async def test_stop_token_ids_end_the_answer_and_min_tokens_holds_them_off(entry):
    ids = TOK.encode_prompt("abc")
    greedy = generate_full(stub_model(), ids, 8).token_ids
    stop = greedy[2]
    body = await complete(entry, prompt="abc", max_tokens=8, temperature=0, stop_token_ids=[stop])
    n = greedy.index(stop) + 1
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (n, "stop")
    body = await complete(entry, prompt="abc", max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=8)
    assert body["usage"]["completion_tokens"] == 8


async def test_chat_logprobs_are_openai_s_list_of_tokens_with_their_alternatives(entry):
    messages = [{"role": "user", "content": "hi"}]
    r = await entry.post("/v1/chat/completions", json={"model": "stub", "messages": messages, "max_tokens": 3,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    gen = generate_full(stub_model(), TOK.encode_messages(messages), 3)
    want = [token_logprobs(lg[None], [t], 2)[0] for lg, t in zip(gen.logits, gen.token_ids)]
    assert [c["logprob"] for c in content] == [w.logprob for w in want]
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == [[TOK.decode([i]) for i, _ in w.top]
                                                                         for w in want]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "abc", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "abc", "n": 5}, "n", "invalid_value"),
    ({"prompt": [[1, 2], [3, 40]]}, "prompt", "invalid_value"),
    ({"prompt": "abc", "logit_bias": {"32": 1}}, "logit_bias", "invalid_value"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(entry, body, param, code):
    r = await entry.post("/v1/completions", json={"model": "stub", **body})
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


async def test_a_refused_choice_admits_none_of_its_request(entry, monkeypatch):
    """Past the slots and the queue, a request of several prompts is refused whole, nothing left running: with a
    slot busy a 429 (a retry may pass), and more than the slots and queue could ever hold a 400 (issue 54)."""
    slow_stub(monkeypatch, 0.05)
    async with trio.open_nursery() as busy:
        busy.start_soon(functools.partial(entry.post, "/v1/completions",
                                          json={"model": "stub", "prompt": "a", "max_tokens": 400}))
        with trio.fail_after(30):
            while not (await entry.get("/health")).json()["slots"]["active"]:
                await trio.sleep(0.05)
        # one slot held: 3 free and 8 places in the queue for 12 choices
        r = await entry.post("/v1/completions", json={"model": "stub", "prompt": ["a"] * 12, "max_tokens": 2})
        assert r.status_code == 429
        busy.cancel_scope.cancel()  # its client leaves: the request is cancelled
    with trio.fail_after(30):  # the stream closed: its request is cancelled and its slot freed
        while (await entry.get("/health")).json()["slots_in_use"]:
            await trio.sleep(0.05)
    r = await entry.post("/v1/completions", json={"model": "stub", "prompt": ["a"] * 13, "max_tokens": 2})
    assert r.status_code == 400 and "at most 12" in r.json()["error"]["message"]
    health = (await entry.get("/health")).json()
    assert health["slots_in_use"] == 0
    body = await complete(entry, prompt=["a"] * 12, max_tokens=2)  # 4 slots and 8 waiting: all of them run
    assert len(body["choices"]) == 12
