"""Child processes for tests: a dagsync operation killed part-way (crash tests), and
an llm-style writer that arrives while dagsync holds the lock (live-writer tests)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import IO

import apsw

# An llm-style writer: a 5 s busy timeout, deferred transaction, no retry.
# Runs the INSERT it is given; prints "ok" when its row is in, or the error
# that stopped it.
WRITER = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=5, isolation_level=None)
try:
    conn.execute("BEGIN")
    conn.execute(sys.argv[2])
    conn.execute("COMMIT")
    print("ok", flush=True)
except sqlite3.Error as exc:
    print(f"failed: {exc}", flush=True)
"""


def start_writer(path: str, insert: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, path, insert], stdout=subprocess.PIPE, text=True)


# Counting this far takes SQLite minutes: a statement that only an interrupt
# ends soon. Its first row calls start_writer_now(), so the writer starts while
# it runs, never before.
ENDLESS = (
    "WITH RECURSIVE c(x) AS (SELECT start_writer_now() UNION ALL SELECT x + 1 FROM c WHERE x < 2000000000) "
    "SELECT count(*) FROM c"
)


def run_endless(conn: apsw.Connection, start: Callable[[], subprocess.Popen], writers: list) -> None:
    """Run ENDLESS on ``conn``; the writer ``start`` makes is appended to ``writers``."""
    conn.create_scalar_function("start_writer_now", lambda: (writers.append(start()), 1)[1], 0)
    conn.execute(ENDLESS).fetchall()


def kill_after(script: str, args: list[str], lines: int, stderr: IO[str] | None = None) -> tuple[bool, int]:
    """Run ``python -c script args``, read ``lines`` lines of its output (one per
    progress event), then ``kill -9`` it, so the kill lands part-way through
    its work by construction. Returns (it was still running, its exit status).
    """
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    for _ in range(lines):
        if not process.stdout.readline():
            break
    alive = process.poll() is None
    process.kill()
    process.wait()
    process.stdout.close()
    return alive, process.returncode
