"""What a run does once its cluster has converged, in either mode (--seed, --vastai): answer one prompt
through pp-entry's OpenAI API, streaming the text as it comes, or (--serve) print how to reach the API and
serve until stopped. Either way a stage that dies ends the run at once, naming it."""
from __future__ import annotations

import shlex
import time
from typing import Awaitable, Callable

import attrs
import trio

from node.groups import unwrapped
from node.planning import gossiped_kernels, gossiped_plan
from node.transport.client import member_transport
from .orchestrator import Orchestrator, StageDied
from roles import topology
from worker.contract import Sampling

from .ask import ask
from .common import RunFailed, RunResult, timings_of


@attrs.frozen
class Use:
    """What to do with the cluster."""

    prompt: str
    max_tokens: int
    sampling: Sampling
    timeout_s: float
    model_name: str  # as the API serves it: the --model the run was started with
    api_key: str = attrs.field(default="", repr=False)  # a client key: the runner asks as a client does
    key_given: bool = False  # the user chose the clients' keys: they are not printed back
    serve: bool = False
    on_text: Callable[[str], None] = lambda text: None  # each piece of the answer as it arrives
    announce: Callable[[str], None] = print  # --serve: the lines a user pastes


def entry_url(orch: Orchestrator) -> str:
    entry = orch.swim.resolve(topology.ENTRY)
    if entry is None:
        raise RunFailed("no alive member holds pp-entry")
    return entry.addr


async def answer_once(orch: Orchestrator, use: Use, *, converged: float, started: float,
                      num_stages: int, run_dir) -> RunResult:
    try:
        with trio.fail_after(use.timeout_s), unwrapped(StageDied):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(orch.watch)
                asked = await ask(entry_url(orch), transport=member_transport(orch.tls, http2=False),
                                  api_key=use.api_key, model=use.model_name, prompt=use.prompt,
                                  max_tokens=use.max_tokens, sampling=use.sampling, on_text=use.on_text)
                nursery.cancel_scope.cancel()
    except StageDied as exc:
        raise RunFailed(str(exc)) from None
    except trio.TooSlowError:
        raise RunFailed(f"no answer within {use.timeout_s:.0f} s") from None
    answered = time.monotonic()
    timings = timings_of(asked.response, converged - started, asked.first_token_s, answered - started)
    members = orch.swim.members().values()
    split = gossiped_plan(members, orch.swim.me.id, num_stages) or ()
    return RunResult(asked.response, num_stages, timings, run_dir, split, gossiped_kernels(members, num_stages))


def announce_entry(use: Use, stage: int, holder) -> None:
    """A replaced stage 0 is a new entry: its streams were lost, and its address may have changed."""
    if stage == 0:
        use.announce(f"OPENAI_BASE_URL={api_base(holder.url)}/v1")


def api_base(member_addr: str) -> str:
    """Stage 0's API for a user's clients: its member address (https://, the cluster's own CA) as plain http://,
    which the same port serves to clients (node/transport/tls_accept.py)."""
    return "http://" + member_addr.split("://", 1)[-1]


def announcement(base: str, use: Use) -> list[str]:
    """The lines a user pastes to reach the API. A key the runner made up is printed; one the user gave (from a
    file or the environment, so as not to show it) is not: the curl line reads it from $OPENAI_API_KEY. The
    cluster token is never printed: it is the nodes' alone."""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Say hello"}], "stream": true}'
            % use.model_name)
    if use.key_given:
        key_line, header = "# OPENAI_API_KEY: a client key you gave (--api-key, --api-key-file, PP_API_KEY)", \
            '"Authorization: Bearer $OPENAI_API_KEY"'
    else:
        key_line, header = f"OPENAI_API_KEY={use.api_key}", shlex.quote(f"Authorization: Bearer {use.api_key}")
    return [f"OPENAI_BASE_URL={base}", key_line,
            f"curl -N {base}/chat/completions -H {header} -H 'Content-Type: application/json' -d {shlex.quote(body)}"]


async def serve(orch: Orchestrator, use: Use, keep: Callable[[], Awaitable[None]] | None = None) -> None:
    """Announce the API and wait: only a signal (Stopped) or a failure (RunFailed) ends this. `keep`
    replaces stages that die (runner/keeper.py); without it, a dead stage ends the run."""
    for line in announcement(api_base(entry_url(orch)) + "/v1", use):
        use.announce(line)
    if keep is not None:
        await keep()
        return
    try:
        await orch.watch()
    except StageDied as exc:
        raise RunFailed(str(exc)) from None
