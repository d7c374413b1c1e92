"""The weight source a model argument names, opened without tinygrad: a runner checks a model file with
it before any node exists, and a stage opens its slice from it.

Opening reads only metadata (a GGUF header, a Hugging Face config and safetensors headers) and building
the tokenizer reads the vocabulary, so a file that is no usable model is refused in a second, naming the
file and the defect (worker.errors.ModelFileError), before gigabytes are read or processes started.
"""
from __future__ import annotations

from pathlib import Path

from .weights.fetch import ModelKind, resolve_model
from .weights.tiny import BUILT_IN, TinySource
from .weights.contract import WeightSource

STUB = "stub"  # worker.stub's stand-in: no weights, no source


def open_source(spec: str, *, cache_dir: Path, ollama_models_dir: Path | None,
                progress: bool = True) -> WeightSource | None:
    """The source of `spec` (None for the stub): a built-in model, or the GGUF file or Hugging Face
    directory it resolves to (a known name may be downloaded first: worker.weights.fetch)."""
    name = spec.strip().lower()
    if name == STUB:
        return None
    if name in BUILT_IN:
        return TinySource(BUILT_IN[name], path=name)
    ref = resolve_model(spec, cache_dir=cache_dir, ollama_models_dir=ollama_models_dir, progress=progress)
    if ref.kind is ModelKind.GGUF:
        from .weights.gguf import GGUFSource
        return GGUFSource(ref.path)
    from .weights.hf import HFSource
    return HFSource(ref.path)


def check_source(source: WeightSource | None) -> None:
    """Everything about a source that can be refused before its weights are read: its config (read when
    it was opened) and its tokenizer. Raises ModelFileError naming the file."""
    if source is not None:
        source.tokenizer()
