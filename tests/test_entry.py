"""The serving surface talks to the entry stage only through node/api/entry.py's Entry, and the prompt's
checks are made once, by the actor and the worker: the API shapes their refusals OpenAI's way."""
import ast
from pathlib import Path

import httpx
import pytest

from cluster import API_KEY, api, start_cluster
from node.api.entry import Entry, Members, Vocabulary
from node.membership.swim import Swim
from node.downstream import DownstreamStage
from node.entry import EntryStage
from node.stage_node import StageNode, StageSide
from roles import make_actor
from roles.actions import PROMPT_INVALID, PROMPT_TOO_LONG, Refused
from roles.messages import InferenceRequest
from worker.models import open_worker, stub_model
from worker.partition import Shard

AUTH = {"Authorization": f"Bearer {API_KEY}"}
API = Path(__file__).resolve().parent.parent / "node" / "api"


def members_of(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


@pytest.mark.parametrize("protocol,implementation", [(Entry, EntryStage), (Members, Swim)])
def test_the_entry_stage_and_swim_have_every_member_the_api_uses(protocol, implementation):
    node = (StageNode(Shard.of(0, 2), client=None, side=EntryStage, node_id="n", model_name="m").side
            if implementation is EntryStage else None)
    missing = {m for m in members_of(protocol) if not hasattr(implementation, m) and not hasattr(node, m)}
    assert not missing


def test_a_first_stage_workers_vocabulary_has_every_member_the_api_uses():
    worker = open_worker(stub_model(), Shard.of(0, 2))
    assert not {m for m in members_of(Vocabulary) if not hasattr(worker.vocabulary, m)}


def test_the_api_imports_nothing_of_the_stage_node():
    for path in API.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("node.stage_node", "node.entry"), path.name


@pytest.mark.parametrize("ids,code", [((1, 2, 10_000), PROMPT_INVALID), ((1,) * 600, PROMPT_TOO_LONG)])
def test_the_actor_refuses_a_prompt_of_ids_out_of_the_vocabulary_or_the_context(ids, code):
    first = make_actor(open_worker(stub_model(), Shard.of(0, 2)))
    with pytest.raises(Refused) as info:
        first.admit(InferenceRequest("r", "", max_tokens=1, prompt_token_ids=ids))
    assert (info.value.status, info.value.code) == (400, code)


async def test_the_api_shapes_the_actors_refusals_of_a_prompt_of_ids(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    probe = open_worker(stub_model(), Shard.of(0, 2))
    context, vocab = probe.info.max_context, probe.info.vocab_size
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as client:
        async def complete(prompt):
            r = await client.post(api(urls[0]) + "/v1/completions", json={"model": "stub", "prompt": prompt})
            return r.status_code, r.json()["error"]
        status, error = await complete([1, 2, vocab])
        assert (status, error["code"], error["param"]) == (400, "invalid_value", "prompt")
        assert "32 is not a token id" in error["message"]  # checked at parsing now, before the actor sees it
        status, error = await complete([1] * context)  # no more ids than the context: the actor's to refuse
        assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")
        assert f"maximum context length is {context} tokens" in error["message"]
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("side", [EntryStage, DownstreamStage])
def test_each_stage_side_has_every_member_the_driver_uses(side):
    assert not {m for m in members_of(StageSide) if not hasattr(side, m)}
