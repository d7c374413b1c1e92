"""`ppsmoke.py --seed --serve` (real node processes, tiny) used with the official `openai` client: what
it answers, how it refuses, and that a client walking away frees its slots on every stage."""
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import ppsmoke
from runner.secrets import Secrets
from runner.seed import node_env
from served import serving
from test_smoke_seed import ROOT, processes_marked
from worker.models import tinygrad_model
from worker.reference import generate_full
from worker.weights.tiny import TinySource

TOKEN = "serve-test-cluster-token"  # the nodes' own, from the environment: never printed, never a client's
PROMPT = "Say hello"


@pytest.fixture(scope="module")
def served():
    with serving(["--max-seqs", "2", "--max-queue", "1"], stages=2, env_extra={"PP_CLUSTER_TOKEN": TOKEN}) as s:
        assert s.api_key != TOKEN and TOKEN not in s.printed  # a client key of its own making, printed; the token not
        yield s


@pytest.fixture(scope="module")
def tiny():
    return tinygrad_model(TinySource())


def greedy(tiny, ids, max_tokens) -> tuple[list[int], str]:
    tokens = generate_full(tiny, ids, max_tokens).token_ids
    tok = tiny.tokenizer()
    return tokens, tok.decode(tokens, specials=False)  # an answer's text holds no control token


def test_the_model_is_listed_by_the_name_the_cluster_was_started_with(served):
    [model] = served.client().models.list().data
    assert model.id == "tiny" and model.object == "model"


def test_the_model_is_retrieved_by_its_id_and_another_id_is_not_found(served):
    client = served.client()
    [listed] = client.models.list().data
    assert client.models.retrieve("tiny") == listed
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert (openai_error(info)["code"], openai_error(info)["param"]) == ("model_not_found", "model")


def test_tokenize_counts_a_conversation_as_the_chat_template_does_and_detokenize_gives_its_text(served, tiny):
    auth = {"Authorization": f"Bearer {served.api_key}"}
    entry = served.base_url.removesuffix("/v1")
    messages = [{"role": "user", "content": PROMPT}]
    r = httpx.post(entry + "/tokenize", json={"model": "tiny", "messages": messages}, headers=auth)
    ids = tiny.tokenizer().encode_messages(messages)
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    r = httpx.post(entry + "/detokenize", json={"tokens": ids}, headers=auth)
    assert r.status_code == 200 and r.json()["prompt"] == tiny.tokenizer().decode(ids)


def test_a_chat_completion_is_the_single_process_greedy_answer_with_its_usage(served, tiny):
    r = served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=12, temperature=0)
    ids = tiny.tokenizer().encode_chat(PROMPT)
    tokens, text = greedy(tiny, ids, 12)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in tiny.tokenizer().stop_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))


def test_a_streamed_chat_completion_sends_the_same_answer_chunk_by_chunk(served, tiny):
    chunks = list(served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    _, text = greedy(tiny, tiny.tokenizer().encode_chat(PROMPT), 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == text and len(contents) > 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_a_completion_continues_the_raw_prompt(served, tiny):
    r = served.client().completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    _, text = greedy(tiny, tiny.tokenizer().encode_prompt("Once upon a time"), 8)
    assert r.choices[0].text == text and r.usage.completion_tokens == 8


def test_a_stop_string_ends_the_answer_before_it(served, tiny):
    _, text = greedy(tiny, tiny.tokenizer().encode_chat(PROMPT), 12)
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text.index(text[i:i + 2]) == i)
    r = served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"


def openai_error(info) -> dict:
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_a_missing_or_wrong_key_is_401_in_openai_s_shape(served):
    client = openai.OpenAI(base_url=served.base_url, api_key="wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    assert openai_error(info)["code"] == "invalid_api_key"


def test_the_cluster_token_is_no_api_key(served):
    client = openai.OpenAI(base_url=served.base_url, api_key=TOKEN)
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.models.list()
    assert "not a client API key" in openai_error(info)["message"]


def proc_file(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:  # a compiler worker of tinygrad's that has just ended
        return b""


def test_every_node_has_the_client_key_in_its_environment_and_no_secret_is_on_a_command_line(served):
    pids = processes_marked(served.mark)
    nodes = [pid for pid in pids if b"ppnode.py" in proc_file(pid, "cmdline")]
    assert len(nodes) == 2
    for pid in nodes:
        assert f"PP_API_KEY={served.api_key}\0".encode() in proc_file(pid, "environ")
    for pid in pids:
        cmdline = proc_file(pid, "cmdline")
        assert TOKEN.encode() not in cmdline and served.api_key.encode() not in cmdline


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 600}])
    body = openai_error(info)
    assert (body["code"], body["param"]) == ("context_length_exceeded", "messages") and "512" in body["message"]


@pytest.mark.parametrize("extra,param", [({"top_p": "x"}, "top_p"), ({"n": 3}, "n"), ({"max_tokens": -1}, "max_tokens")])
def test_a_bad_parameter_is_400_naming_it(served, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                extra_body=extra)
    assert openai_error(info)["param"] == param


def test_past_the_queue_the_entry_answers_429(served):
    client = served.client(max_retries=0)
    streams = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=400, temperature=0, stream=True)
               for _ in range(3)]  # 2 slots, 1 waiting; greedy, so none ends early and frees its slot
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
        assert openai_error(info)["code"] == "rate_limit_exceeded"
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.close()
    wait_until_idle(served)


def test_a_client_that_walks_away_mid_stream_frees_its_slots_on_every_stage(served):
    stream = served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=400, temperature=0, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    assert served.slots_in_use() == [1, 1]
    stream.close()
    wait_until_idle(served)


def wait_until_idle(served, timeout_s=15):
    deadline = time.monotonic() + timeout_s
    while any(served.slots_in_use()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.slots_in_use() == [0, 0]


def test_ppsmoke_refuses_contradictory_serve_flags():
    done = subprocess.run([sys.executable, str(ROOT / "ppsmoke.py"), "--seed", "--serve", "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--serve" in done.stderr


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
         "required": ["color", "n"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [0, 1])
def test_response_format_json_schema_makes_even_random_weights_write_the_schema(served, seed):
    """The tiny model's weights are random: unconstrained it writes bytes, never this object."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}
    r = served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=48, temperature=1.0, seed=seed, response_format=fmt)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and isinstance(value["n"], int)
    else:  # cut by max_tokens inside the integer: a prefix of the object
        assert text.startswith('{"color":"') and re.fullmatch(r'\{"color":"(red|green)","n":-?\d*', text), text
    free = served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=12, temperature=1.0, seed=seed)
    assert not free.choices[0].message.content.startswith('{"color"')


def test_a_bad_schema_is_a_400_naming_response_format(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}})
    assert openai_error(info)["param"] == "response_format" and "frog" in openai_error(info)["message"]


def test_ppsmoke_refuses_host_with_vastai_naming_why():
    with pytest.raises(SystemExit):
        ppsmoke.parse_args(["--vastai", "--image", "x", "--host", "0.0.0.0"])
    done = subprocess.run([sys.executable, str(ROOT / "ppsmoke.py"), "--vastai", "--image", "x", "--host", "0.0.0.0"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--host is for --seed" in done.stderr and "port mapping" in done.stderr


def test_host_and_port_reach_stage_0_alone():
    args = ppsmoke.parse_args(["--seed", "--serve", "--host", " 0.0.0.0 ", "--port", "8123", "--model", "tiny"])
    args.model_path, args.secrets = "tiny", Secrets(None, ("k",), None)
    opts = ppsmoke._seed_options(args, {})
    envs = [node_env(opts, "t", "https://127.0.0.1:1", stage, None) for stage in range(3)]
    assert [(e["PP_BIND"], e["PP_PORT"]) for e in envs] == [("0.0.0.0", "8123"), ("127.0.0.1", "0"), ("127.0.0.1", "0")]
    plain = ppsmoke.parse_args(["--seed", "--model", "tiny"])
    plain.model_path, plain.secrets = args.model_path, args.secrets
    assert node_env(ppsmoke._seed_options(plain, {}), "t", "https://127.0.0.1:1", 0, None)["PP_BIND"] == "127.0.0.1"


def loopback_alias() -> tuple[str, int]:
    """127.0.0.2 and a port free on it: Linux answers the whole of 127/8 on loopback."""
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            return "127.0.0.2", probe.getsockname()[1]
    except OSError:
        pytest.skip("this machine's loopback answers 127.0.0.1 alone")


def test_the_api_listens_on_the_host_and_port_given_and_not_elsewhere():
    host, port = loopback_alias()
    with serving(["--model", "stub", "--host", host, "--port", str(port)], stages=2, ready_s=120) as s:
        assert s.base_url == f"http://{host}:{port}/v1"
        r = httpx.get(f"{s.base_url}/models", headers={"Authorization": f"Bearer {s.api_key}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "stub"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.parametrize("skip", [True, False])
def test_control_tokens_reach_the_text_only_when_skip_special_tokens_is_false(served, tiny, skip):
    header = tiny.tokenizer().special_ids["<|start_header_id|>"]
    r = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                           logit_bias={str(header): 100},
                                           extra_body={"skip_special_tokens": skip, "return_token_ids": True})
    assert r.choices[0].token_ids == [header, header]
    assert r.choices[0].text == ("" if skip else "<|start_header_id|>" * 2)
