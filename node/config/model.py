"""The model a node serves and how its weights are kept: a model it can load or fetch, the precision, what its
KV caches hold, and how its blocks are split over the stages."""
from __future__ import annotations

import re
from pathlib import Path

from node.config.sources import ConfigError, Sources
from roles.messages import is_http_url
from worker.partition import AUTO, parse_partition
from worker.weights.contract import PRECISIONS
from worker.weights.fetch import DEFAULT_MODEL, REGISTRY
from worker.tool_formats import FAMILIES
from worker.weights.tiny import BUILT_IN


def model_spec(src: Sources) -> str:
    """A model the node can load or fetch: built-in, a known name, an http(s) URL, or an existing path
    (whether the file is a usable model is found when it is opened). An empty variable means the default."""
    raw, label = src.get("--model")
    if raw is not None and not raw.strip() and label == "--model":
        raise ConfigError("--model is empty: name a model (tiny, llama3.2:1b, ...), a URL or a path")
    model = (raw or "").strip() or DEFAULT_MODEL
    name = model.lower()
    if name in ("stub", *BUILT_IN, *(k.lower() for k in REGISTRY)) or is_http_url(model) or Path(model).exists():
        return model
    raise ConfigError(f"{label}={raw!r} is neither a built-in model ({', '.join(['stub', *BUILT_IN])}), a known "
                      f"name ({', '.join(sorted(REGISTRY))}), an http(s) URL nor an existing path")


KV_CACHE_DTYPES = ("auto", "float16", "float32")  # vLLM's --kv-cache-dtype, with its names for these two


def kv_cache_dtype(src: Sources, *, converts_half: bool = True) -> str:
    """What the KV caches hold: float16 (auto: half float32's bytes, and SmolLM2's greedy answers equal
    transformers' at N = 1, 2, 3 and 5; docs/benchmarks.md) or float32. `converts_half`: this CPU converts
    float16 in hardware (x86's F16C); without it tinygrad's kernels cannot store a float16 cache (clang calls a
    runtime routine they cannot link), so auto is float32 there and float16 is refused (issue 53)."""
    raw, label = src.get("--kv-cache-dtype")
    value = (raw or "auto").strip().lower()
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"{label}={raw!r}: expected {', '.join(KV_CACHE_DTYPES)}")
    if value == "float16" and not converts_half:
        raise ConfigError(f"{label}={raw!r}: this CPU has no F16C, so tinygrad's kernels cannot store float16; "
                          f"use float32 (auto picks it here)")
    if value == "auto":
        return "float16" if converts_half else "float32"
    return value


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def kv_cache_memory(src: Sources) -> int | None:
    """The memory a stage's KV may fill, in bytes (K, M, G and T are powers of 1024, as in `free -h`); None:
    auto, a share of the machine's free memory (node/kv_memory.py)."""
    raw, label = src.get("--kv-cache-memory")
    try:
        return memory_size(raw or "auto")
    except ValueError as exc:
        raise ConfigError(f"{label}={raw!r}: {exc}") from None


def memory_size(text: str) -> int | None:
    """`auto` (None) or a size in bytes: 2G, 1.5GiB, 512M, 1073741824; ValueError names what is expected."""
    value = text.strip()
    if value.lower() == "auto":
        return None
    found = _SIZE.fullmatch(value)
    if found is None:
        raise ValueError("expected auto or a size in bytes such as 2G, 512M or 1073741824")
    size = int(float(found[1]) * _UNITS[found[2].lower()])
    if size <= 0:
        raise ValueError("the KV memory must be more than 0 bytes")
    return size


def precision(src: Sources) -> str:
    raw, label = src.get("--precision")
    value = (raw or "auto").strip().lower()
    if value not in PRECISIONS:
        raise ConfigError(f"{label}={raw!r}: expected {', '.join(PRECISIONS)}")
    return value


def layer_partition(src: Sources, num_stages: int) -> tuple[int, ...] | str | None:
    """`auto` (the default: planned at boot from what each node measures), `equal` (None: the even split) or each
    stage's block count (worker.partition.parse_partition); whether they sum to the model's blocks is checked once
    the model is open."""
    raw, label = src.get("--layer-partition")
    try:
        return parse_partition(raw or AUTO, num_stages)
    except ValueError as exc:
        raise ConfigError(f"{label}={raw!r}: {exc}") from None


def tool_call_parser(src: Sources) -> str | None:
    """--tool-call-parser: a family of worker/tool_formats.py, or None for auto (the chat template's)."""
    raw, label = src.get("--tool-call-parser")
    value = (raw or "auto").strip()
    if value != "auto" and value not in FAMILIES:
        raise ConfigError(f"{label}={raw!r}: want auto, {', '.join(FAMILIES)}")
    return None if value == "auto" else value
