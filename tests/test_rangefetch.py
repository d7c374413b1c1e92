"""Each stage fetches only the header and its own tensors of a GGUF by HTTP range requests, from a
stdlib HTTP server on 127.0.0.1 started by the test, and what it fetched loads as the whole file does."""
from __future__ import annotations


import attrs
import httpx
import numpy as np
import pytest
import trio

from rangeserver import RangeServer, Served, write_gguf  # noqa: F401
from worker.errors import ModelFileError
from worker.partition import Shard, layer_range
from worker.weights.gguf import GGUFSource
from worker.weights.rangefetch import (Identity, SliceMeta, cache_hit, cache_name, check_partial,
                               clip_ranges, fetch_stage_slice, merge_ranges, parse_content_range,
                               read_meta, should_report)
from worker.weights.contract import stage_tensor_names
from worker.weights.tiny import TINY_CONFIG

PATH = "/bartowski/Tiny-GGUF/resolve/main/Tiny-Q6_K.gguf"
UNTIED_PATH = "/bartowski/Tiny-GGUF/resolve/main/Tiny-untied.gguf"
GUESS = 1024  # far below the tiny header, so the header prefix has to grow
SPLITS = [(n, s) for n in (2, 3, 5) for s in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    return {PATH: write_gguf(tmp / "tied.gguf", TINY_CONFIG),
            UNTIED_PATH: write_gguf(tmp / "untied.gguf", attrs.evolve(TINY_CONFIG, tie_embeddings=False))}


@pytest.fixture
def server(files):
    srv = RangeServer(files)
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(timeout=5)


async def fetch(server, cache, stage, num_stages, path=PATH, **kw):
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        return await fetch_stage_slice(server.url(path), cache, shard=Shard.of(stage, num_stages),
                                       client=client, header_guess=GUESS, **kw)


def expected_names(config, stage, n):
    names = stage_tensor_names(config, layer_range(config.n_layers, stage, n), embed=stage == 0, head=stage == n - 1)
    return {*names, "rope_freqs.weight"}


# --- each stage gets its slice and only its slice ------------------------------------------

@pytest.mark.parametrize("num_stages, stage", SPLITS)
async def test_stage_fetches_about_its_slice_and_loads_it_as_the_whole_file_does(
        tmp_path, server, files, num_stages, stage):
    path = await fetch(server, tmp_path, stage, num_stages)
    whole = GGUFSource(files[PATH])
    names = expected_names(whole.config, stage, num_stages)
    served = sum(s.nbytes for s in server.gets())
    slice_bytes = sum(whole.header.tensors[n].nbytes for n in names)
    size = files[PATH].stat().st_size
    # the header prefix overshoots by at most its own size when it doubles; padding is < 32 B a tensor
    assert served <= max(GUESS, 2 * whole.header.data_start) + slice_bytes + 32 * len(names)
    if 0 < stage < num_stages - 1:
        assert served < size / 2
    assert path.stat().st_size == size
    assert set(read_meta(path.with_name(path.name + ".pp_meta")).tensors) == names
    fetched = GGUFSource(path)
    assert fetched.config == whole.config
    for name in sorted(names):
        assert np.array_equal(fetched.load(name), whole.load(name)), name


@pytest.mark.parametrize("num_stages, stage", [(2, 1), (3, 2)])
async def test_untied_last_stage_fetches_output_norm_and_head_but_not_the_embedding(
        tmp_path, server, files, num_stages, stage):
    path = await fetch(server, tmp_path, stage, num_stages, path=UNTIED_PATH)
    whole, fetched = GGUFSource(files[UNTIED_PATH]), GGUFSource(path)
    names = expected_names(whole.config, stage, num_stages)
    assert {"output.weight", "output_norm.weight"} <= names and "token_embd.weight" not in names
    for name in sorted(names):
        assert np.array_equal(fetched.load(name), whole.load(name)), name
    embd = whole.header.tensors["token_embd.weight"]
    assert not any(s.first < embd.offset + embd.nbytes and embd.offset < s.first + s.nbytes
                   for s in server.gets() if s.first >= whole.header.data_start)


async def test_no_byte_is_downloaded_twice(tmp_path, server):
    await fetch(server, tmp_path, 0, 2)
    spans = sorted((s.first, s.first + s.nbytes) for s in server.gets())
    assert len(spans) >= 3  # the header prefix grew at least once, then tensors
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


async def test_last_stage_worker_built_from_its_fetched_slice_computes_as_from_the_whole_file(
        tmp_path, server, files):
    from worker.chain import forward_and_sample
    from worker.models import open_worker, tinygrad_model
    path = await fetch(server, tmp_path, 1, 2)
    hidden = np.random.default_rng(0).standard_normal((3, TINY_CONFIG.dim)).astype(np.float32).tobytes()
    fetched, whole = (open_worker(tinygrad_model(GGUFSource(p)), Shard.of(1, 2)) for p in (path, files[PATH]))
    a, b = (forward_and_sample(w, "r", hidden, 0, 3) for w in (fetched, whole))
    assert a.token_id == b.token_id
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6, atol=1e-6)


# --- cache and progress ------------------------------------------------------------------------

async def test_second_fetch_of_the_same_slice_uses_the_cache_without_network(tmp_path, server):
    first = await fetch(server, tmp_path, 1, 3)
    n_requests = len(server.log)
    reports = []
    again = await fetch(server, tmp_path, 1, 3, progress=reports.append)
    assert again == first and len(server.log) == n_requests and reports == [1.0]


async def test_stages_sharing_a_cache_dir_get_their_own_files(tmp_path, server):
    paths = {await fetch(server, tmp_path, s, 3) for s in range(3)}
    assert len(paths) == 3


@pytest.mark.parametrize("damage", ["truncated file", "fetched from another url", "unreadable sidecar"])
async def test_cached_slice_that_does_not_match_is_fetched_again(tmp_path, server, files, damage):
    server.files["/mirror/Tiny-Q6_K.gguf"] = server.files[PATH]
    path = await fetch(server, tmp_path, 0, 2)
    meta = path.with_name(path.name + ".pp_meta")
    if damage == "truncated file":
        with open(path, "r+b") as f:
            f.truncate(1000)
    elif damage == "unreadable sidecar":
        meta.write_text('{"url": 3')
    n_requests = len(server.log)
    url_path = "/mirror/Tiny-Q6_K.gguf" if damage == "fetched from another url" else PATH
    again = await fetch(server, tmp_path, 0, 2, path=url_path)
    assert again == path and len(server.log) > n_requests
    assert read_meta(meta).url == server.url(url_path)
    assert np.array_equal(GGUFSource(again).load("blk.0.attn_q.weight"),
                          GGUFSource(files[PATH]).load("blk.0.attn_q.weight"))


async def test_progress_rises_monotonically_and_ends_at_one(tmp_path, server):
    reports = []
    await fetch(server, tmp_path, 0, 2, progress=reports.append)
    assert len(reports) >= 2 and reports == sorted(reports)
    assert reports[-1] == 1.0 and reports.count(1.0) == 1 and reports[0] > 0


# --- failures leave nothing behind -------------------------------------------------------------

def assert_nothing_cached(cache):
    assert not cache.exists() or list(cache.iterdir()) == []


async def test_missing_file_is_an_error_naming_the_url(tmp_path, server):
    with pytest.raises(ModelFileError, match="404") as info:
        await fetch(server, tmp_path / "cache", 0, 2, path="/absent.gguf")
    assert info.value.path == server.url("/absent.gguf")
    assert_nothing_cached(tmp_path / "cache")


async def test_server_without_range_support_is_refused_not_downloaded_whole(tmp_path, server):
    server.fault = "ignore_range"
    with pytest.raises(ModelFileError, match="ignored the Range") as info:
        await fetch(server, tmp_path / "cache", 0, 2)
    assert info.value.path == server.url(PATH)
    assert len(server.gets()) == 1
    assert_nothing_cached(tmp_path / "cache")


@pytest.mark.parametrize("fault, problem", [
    ("truncate", "failed"),
    ("unframed", "truncated at"),
    ("resize", "changed size"),
    ("retag", "changed during"),
])
async def test_broken_tensor_download_is_an_error_and_leaves_no_file(tmp_path, server, files, fault, problem):
    server.fault, server.fault_from = fault, GGUFSource(files[PATH]).header.data_start
    with pytest.raises(ModelFileError, match=problem) as info:
        await fetch(server, tmp_path / "cache", 1, 2)
    assert info.value.path == server.url(PATH)
    assert_nothing_cached(tmp_path / "cache")


async def test_cancelled_fetch_leaves_no_file(tmp_path, server):
    with trio.CancelScope() as scope:
        await fetch(server, tmp_path / "cache", 0, 2, progress=lambda fraction: scope.cancel())
    assert scope.cancelled_caught
    assert list((tmp_path / "cache").iterdir()) == []


# --- the pure decisions ------------------------------------------------------------------------

def test_cache_names_carry_the_stage_split():
    table = [
        ("https://h/r/resolve/main/Llama-3.2-1B-Instruct-Q6_K.gguf", 2, 5, "Llama-3.2-1B-Instruct-Q6_K.stage2of5.gguf"),
        ("https://h/x/model.GGUF?download=true", 0, 2, "model.stage0of2.gguf"),
        ("https://h/x/a%20b.gguf", 1, 3, "a_b.stage1of3.gguf"),
        ("https://h/", 0, 2, "model.stage0of2.gguf"),
        ("https://h/x/..gguf", 0, 2, "model.stage0of2.gguf"),
    ]
    for url, stage, n, name in table:
        assert cache_name(url, Shard.of(stage, n)) == name, url
    # a planned or given split: another split's slice of the same stage is another file
    assert cache_name("https://h/m.gguf", Shard.of(1, 2, (29, 1))) == "m.stage1of2.split29-1.gguf"
    assert cache_name("https://h/m.gguf", Shard.of(1, 2, (18, 12))) == "m.stage1of2.split18-12.gguf"


def test_cache_hit_needs_the_same_url_split_and_a_complete_file():
    meta = SliceMeta(url="u", size=100, etag=None, last_modified=None, stage=1, num_stages=3,
                     ranges=((0, 10),), tensors=("a",))
    table = [
        (meta, 100, "u", 1, 3, True),
        (None, 100, "u", 1, 3, False),
        (meta, None, "u", 1, 3, False),
        (meta, 99, "u", 1, 3, False),
        (meta, 100, "v", 1, 3, False),
        (meta, 100, "u", 2, 3, False),
        (meta, 100, "u", 1, 4, False),
    ]
    for m, size, url, stage, n, hit in table:
        assert cache_hit(m, size, url=url, shard=Shard.of(stage, n)) is hit, (m, size, url, stage, n)


@pytest.mark.parametrize("text", ['{"url": 3', "[1]", '"x"', "{}", '{"url": "u", "size": "big"}'])
def test_unreadable_sidecar_reads_as_no_sidecar(tmp_path, text):
    (tmp_path / "m.pp_meta").write_text(text)
    assert read_meta(tmp_path / "m.pp_meta") is None


def test_merge_and_clip_ranges():
    assert merge_ranges([(50, 60), (0, 10), (12, 20), (100, 110)], 2) == [(0, 20), (50, 60), (100, 110)]
    assert merge_ranges([(0, 10), (5, 8), (11, 12)], 0) == [(0, 10), (11, 12)]
    assert merge_ranges([], 5) == []
    assert clip_ranges([(0, 10), (20, 30), (40, 50)], 25) == [(25, 30), (40, 50)]
    assert clip_ranges([(0, 10)], 10) == []


def test_content_range_parsing():
    table = [("bytes 0-9/100", (0, 9, 100)), ("bytes 5-5/6", (5, 5, 6)), ("bytes 0-9/*", None),
             ("bytes 9-0/100", None), ("bytes 0-100/100", None), (None, None), ("0-9/100", None)]
    for value, parsed in table:
        assert parse_content_range(value) == parsed, value


def test_partial_responses_are_checked_against_the_request_and_the_first_answer():
    known = Identity(100, '"e"', None)
    ok = [
        (206, {"content-range": "bytes 0-49/100", "etag": '"e"'}, 0, 50, None, (Identity(100, '"e"', None), 50)),
        (206, {"content-range": "bytes 0-99/100"}, 0, 4096, None, (Identity(100, None, None), 100)),
        (206, {"content-range": "bytes 10-19/100"}, 10, 20, known, (known, 10)),
    ]
    for status, headers, start, end, expect, result in ok:
        assert check_partial("U", status, headers, start, end, expect) == result
    bad = [
        (200, {}, 0, 50, None, "ignored the Range"),
        (404, {}, 0, 50, None, "HTTP 404 Not Found"),
        (206, {}, 0, 50, None, "Content-Range"),
        (206, {"content-range": "bytes 0-49/101"}, 0, 50, known, "changed size"),
        (206, {"content-range": "bytes 0-49/100", "etag": '"f"'}, 0, 50, known, "changed during"),
        (206, {"content-range": "bytes 0-59/100"}, 0, 50, known, "got 0-59"),
        (206, {"content-range": "bytes 0-49/100", "content-encoding": "gzip"}, 0, 50, known, "gzip"),
    ]
    for status, headers, start, end, expect, problem in bad:
        with pytest.raises(ModelFileError, match=problem) as info:
            check_partial("U", status, headers, start, end, expect)
        assert info.value.path == "U"


def test_progress_is_reported_every_percent_or_half_second():
    table = [(0.02, 0.0, 0.1, 0.0, True), (0.005, 0.0, 0.1, 0.0, False), (0.005, 0.0, 0.6, 0.0, True),
             (0.5, 0.495, 10.2, 10.0, False)]
    for fraction, last_fraction, now, last_time, report in table:
        assert should_report(fraction, last_fraction, now, last_time) is report

