"""A model the worker can run: how to open a slice of it and its tokenizer, whatever its backend."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import attrs

from .batching import DEFAULT_MAX_SEQS
from .compute.cpu_target import NATIVE
from .compute.slice import TinygradSlice
from .partition import Shard
from .slice import Slice
from .stage import StageWorker
from .sources import open_source
from .stub import STUB_BLOCKS, StubSlice, StubTokenizer
from .tokens.vocabulary import Vocabulary
from .weights.contract import WeightSource, narrow_kinds


@attrs.frozen
class Model:
    name: str
    total_blocks: int
    open_slice: Callable[..., Slice]  # (layers: range, *, embed: bool, head: bool, max_seqs: int) -> Slice
    tokenizer: Callable[[], object]
    computes: bool = True  # whether a step does real work worth timing (worker/calibrate.py); not the stub's


def tinygrad_model(source: WeightSource, precision: str = "auto", *, tuned: bool = False,
                   max_context: int | None = None, threads: int = 1, kv_dtype: str = "float32",
                   cpu_target: str = NATIVE) -> Model:
    """`precision` and `tuned` (kernels will be searched: beam > 0) pick which matrices keep the file's
    precision (F16, BF16, Q8_0): weights.contract.narrow_kinds. "f32" widens every weight at load, the reference path.
    `max_context`: the positions each slot's KV holds, at most the file's (None: the file's). `threads`: the
    cores a step's kernels run on (on the CPU: worker/compute/cpu_threads.py). `kv_dtype`: what the KV caches
    hold, float32 or float16 (compute/model.py's KV_DTYPES). `cpu_target`: the CPU pp's kernels are built for
    (compute/cpu_target.py: native or a clang CPU name)."""
    keep = narrow_kinds(precision, tuned)

    def open_slice(layers: range, *, embed: bool, head: bool, max_seqs: int = DEFAULT_MAX_SEQS) -> Slice:
        return TinygradSlice(source, layers, embed=embed, head=head, max_seqs=max_seqs, keep=keep,
                             max_context=max_context, threads=threads, kv_dtype=kv_dtype, cpu_target=cpu_target)
    return Model(source.path, source.config.n_layers, open_slice, source.tokenizer)


def stub_model() -> Model:
    return Model("stub", STUB_BLOCKS, StubSlice, StubTokenizer, computes=False)


def open_worker(model: Model, shard: Shard, *, max_seqs: int = DEFAULT_MAX_SEQS) -> StageWorker:
    """Load exactly `shard`'s slice of `model`: its blocks, plus embedding (first) or head (last), with KV
    caches for `max_seqs` requests at once; the worker keeps the model's Vocabulary (`worker.vocabulary`) on
    the first and last stages."""
    shard = shard.sized(model.total_blocks)
    # the tokenizer first: what building it needs for a while (~50 MB for Llama 3's) is freed before the
    # weights arrive, rather than adding to the stage's peak
    tokenizer = model.tokenizer()
    compute = model.open_slice(shard.blocks, embed=shard.embeds, head=shard.has_head, max_seqs=max_seqs)
    vocabulary = Vocabulary(tokenizer, vocab_size=compute.vocab_size, max_context=compute.max_context)
    return StageWorker(compute, vocabulary, shard)


def open_model(spec: str, *, cache_dir: Path, ollama_models_dir: Path | None, progress: bool = True,
               precision: str = "auto", tuned: bool = False, max_context: int | None = None,
               threads: int = 1, kv_dtype: str = "float32", cpu_target: str = NATIVE) -> Model:
    """The one model argument: `stub`, `tiny`, `small`, a .gguf file, a Hugging Face directory or a known name.
    `precision`, `tuned`, `max_context`, `threads`, `kv_dtype` and `cpu_target` as tinygrad_model's."""
    source = open_source(spec, cache_dir=cache_dir, ollama_models_dir=ollama_models_dir, progress=progress)
    return stub_model() if source is None else tinygrad_model(source, precision, tuned=tuned, max_context=max_context,
                                                                    threads=threads, kv_dtype=kv_dtype,
                                                                    cpu_target=cpu_target)
