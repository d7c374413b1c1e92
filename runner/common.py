"""What every kind of run shares: its result, its failure, and how a nursery's failure is reported."""
from __future__ import annotations

import signal
from pathlib import Path

import attrs
import trio

from node.transport import wire
from node.groups import leaves

from .children import StageExited


@attrs.frozen
class RunResult:
    response: wire.InferenceResponse
    num_stages: int
    timings: dict[str, object]
    run_dir: Path
    split: tuple[int, ...] = ()  # each stage's block count, as the stages gossip it
    kernels: tuple[str | None, ...] = ()  # what each stage computes with, as it gossips it (Kernels.label)


class RunFailed(RuntimeError):
    """The run failed; the message says where and shows the end of the failing stage's log."""


class Stopped(Exception):
    """A --serve run was told to stop (Ctrl-C, SIGTERM): its ordinary end."""


async def fail_on_signals(*, serving: bool = False) -> None:
    """Turn Ctrl-C and SIGTERM into an ordinary failure of the run (or, serving, its ordinary end).
    Left to trio, Ctrl-C raises KeyboardInterrupt in whatever task runs at that moment — inside
    hypercorn's request handling it was logged as an ASGI error and lost."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
            if serving:
                raise Stopped(f"{name}: stopping every node")
            raise RunFailed(f"interrupted by {name}; stopping everything")


def first_failure(group: BaseExceptionGroup, *expected: type[BaseException]) -> BaseException:
    """The exception to report from a nursery's group: Ctrl-C first, then the stage that ended on its
    own (its log is the most telling), then any other run failure or `expected` error; anything else
    is a bug: re-raise all."""
    found_all = list(leaves(group))
    for kind in (KeyboardInterrupt, Stopped, StageExited, RunFailed, *expected):
        found = next((e for e in found_all if isinstance(e, kind)), None)
        if found is not None:
            return found if kind in (KeyboardInterrupt, Stopped) else RunFailed(str(found))
    return group


def timings_of(response: wire.InferenceResponse, converge_s: float, first_token_s: float, total_s: float) -> dict:
    n = len(response.token_ids)
    decode_s = response.decode_s
    return {
        "converge_s": round(converge_s, 3),
        "first_token_s": round(first_token_s, 3),  # prefill through the chain, measured at the runner
        "decode_s": round(decode_s, 3),
        "tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else None,
        "stage_compute_ms_per_token": [round(ms / max(n, 1), 2) for ms in response.stage_compute_ms],
        "total_s": round(total_s, 3),
    }


async def show_weight_progress(swim, progress) -> None:
    """Print the stages' weight-download progress, as they gossip it, until cancelled."""
    shown: dict[int, float] = {}

    def changed(swim):
        now = {m.meta.stage: m.meta.progress for m in swim.members().values()
               if m.meta.stage is not None and m.meta.progress is not None}
        return now if now and now != shown else None

    while True:
        shown = await swim.wait_until(changed)
        progress("weights: " + ", ".join(f"stage {s} {p:.0%}" for s, p in sorted(shown.items())))
