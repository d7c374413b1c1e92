"""What ppsmoke prints: one JSON object (--json), or the text and one stats line for a person."""
from __future__ import annotations

import json

from .common import RunResult


def as_json(result: RunResult, model: str) -> str:
    r = result.response
    return json.dumps({"text": r.text, "token_ids": list(r.token_ids), "prompt_token_ids": list(r.prompt_token_ids),
                       "num_stages": result.num_stages, "split": list(result.split), "kernels": list(result.kernels),
                       "model": model, "timings": result.timings,
                       "logs": str(result.run_dir)})


def stats_line(result: RunResult) -> str:
    t = result.timings
    per_stage = " / ".join(f"{ms:.1f}" for ms in t["stage_compute_ms_per_token"])
    rate = f"{t['tokens_per_s']:.1f} tok/s" if t["tokens_per_s"] is not None else "n/a tok/s"
    blocks = f" | blocks per stage: {' / '.join(map(str, result.split))}" if result.split else ""
    return (f"[{len(result.response.token_ids)} tokens | converge {t['converge_s']:.1f} s | first token "
            f"{t['first_token_s']:.2f} s | {rate} | compute ms/token per stage: {per_stage}{blocks}"
            f"{kernels_part(result.kernels)}]")


def kernels_part(kernels: tuple[str | None, ...]) -> str:
    """Pure: what the stages compute with: once where all say the same, else per stage ("?": not said)."""
    if not kernels:
        return ""
    named = [k or "?" for k in kernels]
    return f" | kernels: {named[0]}" if len(set(named)) == 1 else f" | kernels per stage: {' / '.join(named)}"
