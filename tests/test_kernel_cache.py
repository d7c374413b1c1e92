"""Kernels lowered (and tuned by kernel search) by one process are found on disk by the next, which computes
exactly the same and searches nothing again."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, numpy as np
from worker.compute import kernel_cache
from worker.models import tinygrad_model
from worker.weights.tiny import TinySource
model = tinygrad_model(TinySource())
s = model.open_slice(range(1), embed=True, head=True, max_seqs=1)
s.warm_up()
logits = s.forward(s.embed([5, 6, 7]), 0)
print(json.dumps({"disk_hits": kernel_cache.install().disk_hits, "logits": logits.tolist()}))
"""


def run(cache_db: Path, script: str = SCRIPT) -> dict:
    env = {**os.environ, "CACHEDB": str(cache_db), "DEV": "CPU", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # suite time; every default-suite run after the first takes its kernels from this cache
def test_a_second_process_takes_the_lowered_kernels_from_disk_and_computes_the_same(tmp_path):
    first, second = run(tmp_path / "cache.db"), run(tmp_path / "cache.db")
    assert first["disk_hits"] == 0 and second["disk_hits"] > 0
    assert second["logits"] == first["logits"]


TUNED = """
import json, sys
import tinygrad.codegen.opt.search as search
from worker.compute import kernel_cache
from worker.models import tinygrad_model
from worker.weights.tiny import TinySource
searches = []
real = search.beam_search
def counted(*args, **kw):
    searches.append(1)
    return real(*args, **kw)
search.beam_search = counted
model = tinygrad_model(TinySource())
s = model.open_slice(range(1), embed=True, head=True, max_seqs=1)
s.warm_up(beam=1)
logits = s.forward(s.embed([5, 6, 7]), 0)
print(json.dumps({"searches": len(searches), "disk_hits": kernel_cache.install().disk_hits, "logits": logits.tolist()}))
"""


@pytest.mark.slow  # a BEAM search of every step graph: about 2 minutes on 2 cores
def test_a_second_boot_of_a_slice_finds_its_tuned_kernels_on_disk_and_searches_nothing(tmp_path):
    first, second = run(tmp_path / "cache.db", TUNED), run(tmp_path / "cache.db", TUNED)
    assert first["searches"] > 0 and first["disk_hits"] == 0
    assert second["searches"] == 0 and second["disk_hits"] > 0
    assert second["logits"] == first["logits"]
