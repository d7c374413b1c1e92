import os
import sqlite3

# tinygrad picks its device at import; tests run on the CPU backend (clang) unless told otherwise.
os.environ.setdefault("DEV", "CPU")

import tinygrad.helpers  # noqa: E402


def _shareable_tinygrad_cache() -> None:
    """tinygrad opens its kernel cache (sqlite) lazily in whichever thread compiles first, and sqlite
    then refuses every other thread. A node only ever runs tinygrad on its compute thread, but this
    test process runs it on the main thread in some tests and on a cluster's compute thread in
    others (never both at once), so open the connection up front, usable from any thread."""
    path = tinygrad.helpers.CACHEDB
    os.makedirs(os.path.dirname(path), exist_ok=True)
    conn = sqlite3.connect(path, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL").fetchone()
    conn.execute("PRAGMA synchronous=NORMAL")
    tinygrad.helpers._db_connection = conn


_shareable_tinygrad_cache()
