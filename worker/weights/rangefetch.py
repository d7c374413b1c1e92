"""Fetch one pipeline stage's slice of a public GGUF file by HTTP range requests into a local cache.

A stage needs only its blocks (plus the embedding or the head), a fraction of a multi-GB file. The
header comes first, as a prefix grown until it parses; then only the byte ranges of the stage's
tensors. Everything lands at its original offset in a sparse file of the full size, so GGUFSource
loads it unchanged and, reading only the tensors it is asked for, never touches the holes.
A `.pp_meta` JSON sidecar fingerprints a complete file, so a second call needs no network.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Awaitable, Callable, Mapping
from urllib.parse import unquote, urlparse

import attrs
import cattrs
import httpx
import trio
from cattrs.preconf.json import make_converter

from ..errors import ModelFileError
from ..partition import Shard
from .contract import stage_tensor_names
from .gguf_header import GGUFHeader, IncompleteHeader, config_from_header, parse_header

log = logging.getLogger(__name__)

HEADER_GUESS = 4 << 20   # first prefix; llama3's ~10 MB header (128k tokens, 280k merges) grows from it
MERGE_GAP = 1 << 20      # a gap this small costs less to download than another round trip
CHUNK = 1 << 20          # bytes per disk write (each is a hop to a worker thread)
PROGRESS_STEP = 0.01     # report at most every 1% ...
PROGRESS_INTERVAL_S = 0.5  # ... or every half second, whichever comes first
ROPE_FREQS = "rope_freqs.weight"  # tiny, and the loader needs it for the config
META_SUFFIX = ".pp_meta"
PART_SUFFIX = ".part"


@attrs.frozen
class Identity:
    """The remote file as its first response described it; every later response must agree."""

    size: int
    etag: str | None
    last_modified: str | None


@attrs.frozen
class SliceMeta:
    """The sidecar of a complete slice file."""

    url: str
    size: int
    etag: str | None
    last_modified: str | None
    stage: int
    num_stages: int
    ranges: tuple[tuple[int, int], ...]  # half-open [start, end) byte ranges fetched, header prefix first
    tensors: tuple[str, ...]             # the tensors whose bytes the file holds


_meta_json = make_converter(forbid_extra_keys=True)


# --- pure decisions ----------------------------------------------------------------------------

def cache_name(url: str, shard: Shard) -> str:
    """`<basename>.stage<S>of<N>.gguf` (S counts from 0, as STAGE does), so stages sharing a disk don't clash;
    with a layer partition `<basename>.stage<S>of<N>.split<A>-<B>-....gguf`, so another split's slice of the
    same stage is never taken for this one's."""
    base = unquote(urlparse(url).path).rstrip("/").rsplit("/", 1)[-1]
    base = re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "model"
    split = "" if shard.partition is None else ".split" + "-".join(map(str, shard.partition))
    return f"{base}.stage{shard.index}of{shard.count}{split}.gguf"


def cache_hit(meta: SliceMeta | None, file_size: int | None, *, url: str, shard: Shard) -> bool:
    """A complete file fetched for this very url and stage split. Trusted without asking the server:
    a node must start offline from its cache."""
    return (meta is not None and file_size == meta.size
            and (meta.url, meta.stage, meta.num_stages) == (url, shard.index, shard.count))


def merge_ranges(ranges, gap: int) -> list[tuple[int, int]]:
    """Sorted half-open ranges, joined where they overlap or lie at most `gap` bytes apart."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip_ranges(ranges, have: int) -> list[tuple[int, int]]:
    """Drop what the first `have` bytes (the header prefix, already fetched) cover."""
    return [(max(start, have), end) for start, end in ranges if end > have]


def should_report(fraction: float, last_fraction: float, now: float, last_time: float) -> bool:
    return fraction - last_fraction >= PROGRESS_STEP or now - last_time >= PROGRESS_INTERVAL_S


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def parse_content_range(value: str | None) -> tuple[int, int, int] | None:
    """`bytes a-b/total` -> (a, b, total) (b inclusive); None for anything else, `*` totals included."""
    m = _CONTENT_RANGE.fullmatch(value.strip()) if value else None
    if m is None:
        return None
    first, last, total = map(int, m.groups())
    return (first, last, total) if first <= last < total else None


def check_partial(url: str, status: int, headers: Mapping[str, str], start: int, end: int,
                  expect: Identity | None) -> tuple[Identity, int]:
    """Check a response to `Range: bytes=start-(end-1)`; returns the file's identity and the body length.

    `end` may run past the file (the first header request does not know the size yet): a server
    clips it. A 200 carries the whole file and is refused: a stage must not download all of it.
    """
    if status == 200:
        raise ModelFileError(url, "the server ignored the Range request and answered with the whole file "
                                  "(HTTP 200); fetching one stage's slice needs byte-range support")
    if status != 206:
        raise ModelFileError(url, f"HTTP {status} {httpx.codes.get_reason_phrase(status)} "
                                  f"for bytes {start}-{end - 1}")
    parsed = parse_content_range(headers.get("content-range"))
    if parsed is None:
        raise ModelFileError(url, f"partial response without a usable Content-Range "
                                  f"({headers.get('content-range')!r})")
    first, last, total = parsed
    size = expect.size if expect else total
    if total != size:
        raise ModelFileError(url, f"the file changed size during the download ({size} bytes, now {total})")
    etag = headers.get("etag")
    if expect and expect.etag and etag and etag != expect.etag:
        raise ModelFileError(url, f"the file changed during the download (ETag {expect.etag}, now {etag})")
    if (first, last) != (start, min(end, size) - 1):
        raise ModelFileError(url, f"asked for bytes {start}-{min(end, size) - 1}, got {first}-{last}")
    if headers.get("content-encoding", "identity") != "identity":
        raise ModelFileError(url, f"range body is {headers['content-encoding']}-encoded; asked for identity")
    return expect or Identity(total, etag, headers.get("last-modified")), last - first + 1


def stage_names(header: GGUFHeader, url: str, shard: Shard) -> list[str]:
    """The tensors `shard` loads, plus rope_freqs.weight when the file has it."""
    # Rope factors shape the rotary embedding, not which tensors a stage needs; the loader
    # reads them later from the fetched rope_freqs.weight.
    config = config_from_header(header, url, None)
    shard = shard.sized(config.n_layers)
    names = stage_tensor_names(config, shard.blocks, embed=shard.embeds, head=shard.has_head)
    if ROPE_FREQS in header.tensors:
        names.append(ROPE_FREQS)
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise ModelFileError(url, f"{len(missing)} tensors the stage needs are not in the file: {missing[:4]}")
    return names


def tensor_ranges(header: GGUFHeader, names: list[str], size: int, url: str) -> list[tuple[int, int]]:
    out = []
    for name in names:
        info = header.tensors[name]
        if info.offset + info.nbytes > size:
            raise ModelFileError(url, f"tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                                      f"past the end of the {size}-byte file")
        out.append((info.offset, info.offset + info.nbytes))
    return out


# --- the cache sidecar -------------------------------------------------------------------------

def read_meta(meta_path: Path) -> SliceMeta | None:
    """The sidecar, or None when there is none or it is unreadable (then the slice is fetched again)."""
    try:
        raw = json.loads(meta_path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"not a JSON object: {raw!r:.40}")
        return _meta_json.structure(raw, SliceMeta)
    except FileNotFoundError:
        return None
    except (ValueError, cattrs.BaseValidationError) as e:
        log.warning("%s: unreadable slice fingerprint (%s); fetching the slice again", meta_path, e)
        return None


def _write_meta(meta_path: Path, meta: SliceMeta) -> None:
    tmp = meta_path.with_name(meta_path.name + PART_SUFFIX)
    tmp.write_text(json.dumps(_meta_json.unstructure(meta), indent=1))
    tmp.replace(meta_path)


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


# --- the network -------------------------------------------------------------------------------

class _Progress:
    """Turns bytes received into throttled, monotonic fractions; 1.0 only once the file is in place."""

    def __init__(self, callback: Callable[[float], None] | None, total: int):
        self.callback, self.total, self.done = callback, max(total, 1), 0
        self.last_fraction, self.last_time = 0.0, time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        fraction, now = min(self.done / self.total, 1.0), time.monotonic()
        if self.callback and fraction < 1.0 and should_report(fraction, self.last_fraction, now, self.last_time):
            self.last_fraction, self.last_time = fraction, now
            self.callback(fraction)

    def finish(self) -> None:
        if self.callback:
            self.callback(1.0)


async def _get_range(client: httpx.AsyncClient, url: str, start: int, end: int, expect: Identity | None,
                     sink: Callable[[bytes], Awaitable[None]]) -> Identity:
    """GET bytes [start, end) (clipped to the file), check the answer, stream the body into `sink`."""
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    got = 0
    try:
        async with client.stream("GET", url, headers=headers, follow_redirects=True) as r:
            ident, length = check_partial(url, r.status_code, r.headers, start, end, expect)
            async for chunk in r.aiter_raw(CHUNK):
                got += len(chunk)
                if got > length:
                    raise ModelFileError(url, f"bytes {start}-{start + length - 1}: the server sent more than asked")
                await sink(chunk)
    except httpx.HTTPError as e:
        raise ModelFileError(url, f"download of bytes {start}-{end - 1} failed: {type(e).__name__}: {e}") from e
    if got != length:
        raise ModelFileError(url, f"bytes {start}-{start + length - 1}: body truncated at {got} of {length} bytes")
    return ident


async def _fetch_header(client: httpx.AsyncClient, url: str, guess: int) -> tuple[GGUFHeader, bytes, Identity]:
    """The header by a prefix grown until it parses; the first answer also tells the size."""
    chunks: list[bytes] = []

    async def keep(chunk: bytes) -> None:
        chunks.append(chunk)

    ident, have, want = None, 0, guess
    while True:
        ident = await _get_range(client, url, have, want, ident, keep)
        prefix = b"".join(chunks)
        have = len(prefix)
        try:  # parsing llama3's vocabulary takes a while: keep the node's event loop free
            return await trio.to_thread.run_sync(parse_header, prefix, url), prefix, ident
        except IncompleteHeader as e:
            if have >= ident.size:
                raise ModelFileError(url, f"header is truncated: it needs at least {e.needed_bytes} bytes, "
                                          f"the file has {ident.size}") from None
            want = min(ident.size, max(e.needed_bytes, 2 * have))


async def _download(client: httpx.AsyncClient, url: str, tmp: Path, prefix: bytes,
                    ranges: list[tuple[int, int]], ident: Identity, meter: _Progress) -> None:
    try:
        async with await trio.open_file(tmp, "wb") as f:
            await f.truncate(ident.size)  # sparse: the holes take no disk space
            await f.write(prefix)
            meter.add(len(prefix))

            async def write(chunk: bytes) -> None:
                await f.write(chunk)
                meter.add(len(chunk))

            for start, end in ranges:
                await f.seek(start)
                await _get_range(client, url, start, end, ident, write)
    except OSError as e:
        raise ModelFileError(tmp, f"cannot write the slice of {url}: {e.strerror}") from e


async def block_count(url: str, client: httpx.AsyncClient, header_guess: int = HEADER_GUESS) -> int:
    """The blocks of the GGUF at `url`, from its header alone (a node measures a block before it knows its
    range: worker/calibrate.py). ModelFileError naming the URL."""
    header, _, _ = await _fetch_header(client, url, header_guess)
    return config_from_header(header, url, None).n_layers


async def fetch_stage_slice(url: str, cache_dir: Path, *, shard: Shard, client: httpx.AsyncClient,
                            progress: Callable[[float], None] | None = None,
                            header_guess: int = HEADER_GUESS) -> Path:
    """Download the header and `shard`'s tensors of the GGUF at `url` into a sparse file in `cache_dir`.

    Returns the file, which GGUFSource opens as it would the whole one (only this stage's tensors
    hold data). A complete cached file for the same url and split returns at once, without network.
    `progress(fraction)` is called, throttled, as bytes arrive, and with 1.0 at the end.
    Raises ModelFileError naming the URL (the cache file for disk errors); nothing is left under the
    final name unless complete. Timeouts are the client's. `header_guess` is the first prefix asked
    for; tests make it small to exercise the growth.
    """
    cache_dir = Path(cache_dir)
    path = cache_dir / cache_name(url, shard)
    meta_path = path.with_name(path.name + META_SUFFIX)
    if cache_hit(read_meta(meta_path), _size_or_none(path), url=url, shard=shard):
        _Progress(progress, 1).finish()
        return path
    meta_path.unlink(missing_ok=True)  # a stale fingerprint must not vouch for whatever comes next

    header, prefix, ident = await _fetch_header(client, url, header_guess)
    names = stage_names(header, url, shard)
    ranges = clip_ranges(merge_ranges(tensor_ranges(header, names, ident.size, url), MERGE_GAP), len(prefix))
    meter = _Progress(progress, len(prefix) + sum(end - start for start, end in ranges))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PART_SUFFIX)
    try:
        await _download(client, url, tmp, prefix, ranges, ident, meter)
        tmp.replace(path)
    except BaseException:  # cancelled or failed: leave no half-written file behind, then go on failing
        tmp.unlink(missing_ok=True)
        raise
    _write_meta(meta_path, SliceMeta(
        url=url, size=ident.size, etag=ident.etag, last_modified=ident.last_modified, stage=shard.index,
        num_stages=shard.count, ranges=((0, len(prefix)), *ranges), tensors=tuple(names)))
    meter.finish()
    return path
