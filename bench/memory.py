"""Peak memory of one process holding a whole model (or a stage's slice of it), against what it must hold:
its weights and its KV caches. Run once per configuration: peak RSS only grows in a process.

  python -m bench.memory small
  python -m bench.memory smollm2:135m --stage 1 --stages 2 --kv-cache-dtype float32
  python -m bench.memory /tmp/bench-f32.gguf --stage 0 --stages 2
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from worker.batching import DEFAULT_MAX_SEQS
from worker.config import DEFAULT_CONTEXT
from worker.models import open_model
from worker.partition import Role, layer_range, role_of
from worker.weights.contract import PRECISIONS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--stages", type=int, default=1, help="1: the whole model in one slice")
    p.add_argument("--max-seqs", type=int, default=DEFAULT_MAX_SEQS)
    p.add_argument("--ctx", type=int, default=DEFAULT_CONTEXT, help="positions a slot holds, as a node's --ctx")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="which weights keep the file's precision (weights.contract.narrow_kinds)")
    p.add_argument("--kv-cache-dtype", choices=("float16", "float32"), default="float16",
                   help="what the KV caches hold, as a node's --kv-cache-dtype (float16, a node's default)")
    args = p.parse_args(argv)
    model = open_model(args.model, cache_dir=Path(tempfile.gettempdir()), ollama_models_dir=None,
                       precision=args.precision, max_context=args.ctx, kv_dtype=args.kv_cache_dtype)
    if args.stages == 1:
        layers, embed, head = range(model.total_blocks), True, True
    else:
        role = role_of(args.stage, args.stages)
        layers, embed, head = layer_range(model.total_blocks, args.stage, args.stages), role is Role.FIRST, role is Role.LAST
    started = time.perf_counter()
    tokenizer = model.tokenizer()  # first, and kept, as a node's stage does (worker.models.open_worker)
    s = model.open_slice(layers, embed=embed, head=head, max_seqs=args.max_seqs)
    loaded_s = time.perf_counter() - started
    s.warm_up()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    del tokenizer
    mb = 2 ** 20
    print(json.dumps({"model": args.model, "precision": args.precision, "kv_cache_dtype": args.kv_cache_dtype, "stage": args.stage, "stages": args.stages, "max_seqs": args.max_seqs,
                      "load_s": round(loaded_s, 1), "weight_mb": round(s.weight_bytes / mb),
                      "kv_mb": round(s.kv_bytes / mb), "peak_rss_mb": round(peak / mb),
                      "rss_over_weights_and_kv": round(peak / (s.weight_bytes + s.kv_bytes), 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
