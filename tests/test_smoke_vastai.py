"""`ppsmoke.py --vastai` end to end against the local vast.ai stand-in: real CLI, real node processes
behind port forwarders, and the teardown invariant — zero instances left, whatever happens."""
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tools.vastai_standin import StandinConfig, run_standin
from worker.models import tinygrad_model
from worker.reference import generate_full
from worker.weights.tiny import TinySource

ROOT = Path(__file__).resolve().parent.parent


async def ppsmoke(standin_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "ppsmoke.py"), "--vastai", "--vast-api-key", "test-key", "--vastai-url",
               standin_url, "--image", "pp-node:test", "--status-poll", "0.2", "--ledger", str(tmp_path / "live.json"),
               *([] if "--model" in args else ["--model", "tiny"]), *args]
    return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)


async def live_instances(standin_url: str) -> dict:
    async with httpx.AsyncClient() as client:
        return (await client.get(standin_url + "/standin/state")).json()["instances"]


async def with_standin(nursery, **kw) -> str:
    return await nursery.start(functools.partial(run_standin, StandinConfig(step_s=0.1, logs_lag=False, **kw)))


async def test_five_rented_stages_answer_with_the_single_process_tokens_and_nothing_is_left(nursery, tmp_path):
    url = await with_standin(nursery)
    done = await ppsmoke(url, tmp_path, "-n", "5", "--max-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    import json
    result = json.loads(done.stdout)
    model = tinygrad_model(TinySource())
    assert result["text"] and result["token_ids"] == generate_full(model, result["prompt_token_ids"], 6).token_ids
    assert await live_instances(url) == {}
    assert json.loads((tmp_path / "live.json").read_text())["instances"] == []
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fault", [dict(vanish_first_creates=2),
                                   pytest.param(dict(rate_limit_burst=4), marks=pytest.mark.slow)])
async def test_passing_faults_are_ridden_out(nursery, tmp_path, fault):
    url = await with_standin(nursery, **fault)
    done = await ppsmoke(url, tmp_path, "-n", "2", "--max-tokens", "3")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert await live_instances(url) == {}
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fault,args,reason", [
    (dict(stuck_loading={2}), ("--running-timeout", "3"), "stage 1: instance 7835612 not running after 3 s"),
    (dict(die_after_s={2: 0.5}), (), "stage 1"),
    (dict(), ("--max-dph", "0.01"), "only 0 suitable offers"),
])
async def test_fatal_faults_exit_1_with_a_reason_and_leave_zero_instances(nursery, tmp_path, fault, args, reason):
    url = await with_standin(nursery, **fault)
    with trio.fail_after(150):
        done = await ppsmoke(url, tmp_path, "-n", "3", "--max-tokens", "400", "--converge-timeout", "60", *args)
    err = done.stderr.decode()
    assert done.returncode == 1, err[-3000:]
    assert reason in err.split("FAILED:", 1)[1]
    assert await live_instances(url) == {}
    nursery.cancel_scope.cancel()


async def test_sigint_mid_run_still_destroys_every_instance(nursery, tmp_path):
    url = await with_standin(nursery)
    command = [sys.executable, str(ROOT / "ppsmoke.py"), "--vastai", "--vast-api-key", "k", "--vastai-url", url,
               "--image", "x", "--status-poll", "0.2", "--ledger", str(tmp_path / "live.json"), "-n", "3", "--model", "tiny",
               "--max-tokens", "400"]
    proc = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, cwd=ROOT)
    seen = b""
    with trio.fail_after(120):
        while b"converged in" not in seen:
            seen += await proc.stderr.receive_some()
    proc.send_signal(2)
    with trio.fail_after(60):
        assert await proc.wait() == 1
    assert await live_instances(url) == {}
    nursery.cancel_scope.cancel()


@pytest.mark.slow  # ~1 min; the range fetch itself is in the default suite (test_rangefetch.py)
async def test_each_rented_stage_fetches_only_its_slice_of_a_served_gguf(nursery, tmp_path, monkeypatch):
    from rangeserver import RangeServer, write_gguf
    from worker.weights.contract import stage_tensor_names
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the stand-in's "containers" inherit it
    from worker.weights.gguf import GGUFSource
    from worker.weights.tiny import TINY_CONFIG
    whole = write_gguf(tmp_path / "tiny.gguf", TINY_CONFIG)
    served = RangeServer({"/m/tiny.gguf": whole})
    served.thread.start()
    try:
        url = await with_standin(nursery)
        done = await ppsmoke(url, tmp_path, "-n", "3", "--max-tokens", "5", "--json", "--model",
                             served.url("/m/tiny.gguf"))
    finally:
        served.httpd.shutdown()
        served.httpd.server_close()
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    import json
    result = json.loads(done.stdout)
    model = tinygrad_model(GGUFSource(whole))
    assert result["token_ids"] == generate_full(model, result["prompt_token_ids"], 5).token_ids
    assert "weights: stage 0 100%" in done.stderr.decode()  # progress gossiped by the nodes, shown by the runner
    split = result["split"]  # planned (--layer-partition auto): each node first measured the last block and the head
    measured = json.loads((tmp_path / "cache/pp" / "tiny.stage1of2.split7-1.gguf.pp_meta").read_text())
    assert sorted(measured["tensors"]) == sorted([*stage_tensor_names(TINY_CONFIG, range(7, 8), embed=False, head=True),
                                                  "rope_freqs.weight"])
    for stage in range(3):  # then each stage fetched its own range's tensors (and rope_freqs), nothing else
        name = f"tiny.stage{stage}of3.split{'-'.join(map(str, split))}.gguf.pp_meta"
        meta = json.loads((tmp_path / "cache/pp" / name).read_text())
        blocks = range(sum(split[:stage]), sum(split[:stage + 1]))
        want = stage_tensor_names(TINY_CONFIG, blocks, embed=stage == 0, head=stage == 2)
        assert sorted(meta["tensors"]) == sorted([*want, "rope_freqs.weight"])
    assert await live_instances(url) == {}
    nursery.cancel_scope.cancel()


async def stream_text(client: httpx.AsyncClient, base: str, prompt: str, chunks: list) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}
    async with client.stream("POST", base + "/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                assert "choices" in data, data
                chunks.append(data["choices"][0]["text"])
    return "".join(chunks)


@pytest.mark.slow
async def test_serving_a_lost_instance_is_destroyed_and_replaced_and_no_request_is_lost(nursery, tmp_path):
    url = await with_standin(nursery)
    command = [sys.executable, str(ROOT / "ppsmoke.py"), "--vastai", "--vast-api-key", "k", "--vastai-url", url,
               "--image", "x", "--status-poll", "0.2", "--ledger", str(tmp_path / "live.json"), "-n", "3", "--model", "tiny",
               "--serve"]
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    err, replaced = bytearray(), trio.Event()

    async def drain():
        while chunk := await proc.stderr.receive_some():
            err.extend(chunk)
            if b"stage 1 replaced in" in err:
                replaced.set()
    nursery.start_soon(drain)
    out = b""
    with trio.fail_after(150):
        while b"curl -N" not in out:
            out += await proc.stdout.receive_some()
    base = next(line.split("=", 1)[1] for line in out.decode().splitlines() if line.startswith("OPENAI_BASE_URL="))
    key = next(line.split("=", 1)[1] for line in out.decode().splitlines() if line.startswith("OPENAI_API_KEY="))
    prompts = [f"Tale {i}:" for i in range(4)]
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        undisturbed = [await stream_text(client, base, p, []) for p in prompts]
        chunks = [[] for _ in prompts]
        texts = [None] * len(prompts)
        async with trio.open_nursery() as clients:
            for i, p in enumerate(prompts):
                async def one(i=i, p=p):
                    texts[i] = await stream_text(client, base, p, chunks[i])
                clients.start_soon(one)
            while min(len(c) for c in chunks) < 3:
                await trio.sleep(0.01)
            [victim] = [i for i in (await live_instances(url)).values() if i["ordinal"] == 2]  # stage 1's
            os.kill(victim["pid"], signal.SIGKILL)
    assert texts == undisturbed
    # the runner hears the replacement is ready by gossip, which may come after stage 0 has replayed through it
    with trio.move_on_after(30):
        await replaced.wait()
    log = err.decode()
    assert "stage 1 replaced in" in log and "replacement instance" in log, log[-3000:]
    assert len(await live_instances(url)) == 3  # the lost one was destroyed at once
    proc.send_signal(signal.SIGINT)
    with trio.fail_after(60):
        assert await proc.wait() == 0, err.decode()[-3000:]
    assert await live_instances(url) == {}
    assert json.loads((tmp_path / "live.json").read_text())["instances"] == []
    nursery.cancel_scope.cancel()
