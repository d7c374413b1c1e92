"""What reading a GGUF file's weights costs: open it (header, config), then decode every tensor to float32
as a stage's loader does, one at a time; seconds and the process's peak RSS. Run once per file: peak RSS
only grows in a process.

  python -m bench.load smollm2:135m
  python -m bench.load /tmp/bench-q8_0.gguf
"""
from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from worker.weights.fetch import DEFAULT_MODEL, resolve_model
from worker.weights.gguf import GGUFSource


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a GGUF file or a known name")
    args = p.parse_args(argv)
    path = resolve_model(args.model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None).path
    started = time.perf_counter()
    source = GGUFSource(path)
    opened = time.perf_counter()
    for name in sorted(source.names()):
        source.load(name)
    done = time.perf_counter()
    types = collections.Counter(t.type_name for t in source.header.tensors.values())
    print(json.dumps({"model": args.model, "tensors": dict(types), "open_s": round(opened - started, 3),
                      "decode_all_s": round(done - opened, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
