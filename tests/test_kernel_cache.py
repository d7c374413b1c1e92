"""Kernels lowered by one process are found on disk by the next, which computes exactly the same."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, numpy as np
from worker import kernel_cache
from worker.models import tinygrad_model
from worker.tiny import TinySource
model = tinygrad_model(TinySource())
s = model.open_slice(range(1), embed=True, head=True, max_seqs=1)
s.warm_up()
logits = s.forward(s.embed([5, 6, 7]), 0)
print(json.dumps({"disk_hits": kernel_cache.install().disk_hits, "logits": logits.tolist()}))
"""


def run(cache_db: Path) -> dict:
    env = {**os.environ, "CACHEDB": str(cache_db), "DEV": "CPU", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_takes_the_lowered_kernels_from_disk_and_computes_the_same(tmp_path):
    first, second = run(tmp_path / "cache.db"), run(tmp_path / "cache.db")
    assert first["disk_hits"] == 0 and second["disk_hits"] > 0
    assert second["logits"] == first["logits"]
