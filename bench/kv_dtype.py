"""What float16 KV caches change in SmolLM2's answers (issue 39): for each prompt transformers' greedy answer
was recorded for (tests/smollm2_transformers.json), the whole model in one process with float32 KV and with
float16 KV: the largest difference between their logits along the answer, the smallest top-2 gap of float32's
(a difference below it cannot change a greedy token), and whether each dtype's answer equals transformers'.

  DEV=CPU python -m bench.kv_dtype
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from worker.models import open_model
from worker.reference import generate_full

RECORDED = Path(__file__).resolve().parent.parent / "tests" / "smollm2_transformers.json"


def main() -> int:
    greedy = json.loads(RECORDED.read_text(encoding="utf-8"))["greedy"]
    models = {dt: open_model("smollm2:135m", cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None,
                             progress=False, max_context=256, kv_dtype=dt) for dt in ("float32", "float16")}
    print("| prompt | max abs logit difference | smallest top-2 gap (float32) | float32 = transformers | "
          "float16 = transformers |\n|---|---|---|---|---|")
    for g in greedy:
        wide, half = (generate_full(models[dt], g["prompt_ids"], 64) for dt in ("float32", "float16"))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(wide.logits, half.logits))
        gap = min(float(np.diff(np.sort(row)[-2:])[0]) for row in wide.logits)
        print(f"| {g['prompt'][:24]!r} | {diff:.4f} | {gap:.4f} | {wide.token_ids == g['token_ids']} | "
              f"{half.token_ids == g['token_ids']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
