"""The runner as an OpenAI client of its own cluster: one chat completion streamed from pp-entry, text
handed on as it arrives, token ids and the stages' figures collected into an InferenceResponse."""
from __future__ import annotations

import json
import time
from typing import Callable

import attrs
import httpx

from node.transport import wire
from worker.contract import Sampling

from .common import RunFailed

# A stream is silent for as long as a prompt takes to go through every stage (minutes for a big model
# on CPUs); the whole answer is bounded by the caller's timeout instead.
READ_TIMEOUT_S = 600.0


@attrs.frozen
class Asked:
    response: wire.InferenceResponse
    first_token_s: float  # from sending to the first token's chunk


async def ask(entry_url: str, *, api_key: str, model: str, prompt: str, max_tokens: int, sampling: Sampling,
              on_text: Callable[[str], None] = lambda text: None, transport=None) -> Asked:
    """Stream one answer; raises RunFailed with the cluster's error (it names the stage at fault). `transport`:
    the runner's, as a member (node/transport/client.py's member_transport: the entry's certificate checked
    against the cluster's CA)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed, "stream": True,
            "return_token_ids": True}
    state = {"text": [], "ids": [], "prompt": (), "timings": {}, "first": None}
    sent = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=READ_TIMEOUT_S), transport=transport) as client:
        async with client.stream("POST", entry_url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {api_key}"}) as r:
            if r.status_code != 200:
                raise RunFailed(f"pp-entry refused the prompt: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take(json.loads(line[6:]), state, on_text)
    if state["first"] is None:
        raise RunFailed("pp-entry ended the stream before any token")
    t = state["timings"]
    response = wire.InferenceResponse("", "".join(state["text"]), tuple(state["ids"]), tuple(state["prompt"]),
                                      tuple(t.get("stage_compute_ms", ())), t.get("decode_s", 0.0),
                                      tuple(t.get("token_ms", ())), t.get("queued_s", 0.0))
    return Asked(response, state["first"] - sent)


def _take(event: dict, state: dict, on_text: Callable[[str], None]) -> None:
    if "error" in event:
        raise RunFailed(event["error"].get("message", "the cluster failed the request"))
    state["prompt"] = event.get("prompt_token_ids", state["prompt"])
    state["timings"] = event.get("pp_timings", state["timings"])
    for choice in event.get("choices", ()):
        ids = choice.get("token_ids", [])
        if ids and state["first"] is None:
            state["first"] = time.monotonic()
        state["ids"] += ids
        text = (choice.get("delta") or {}).get("content", "")
        if text:
            state["text"].append(text)
            on_text(text)
