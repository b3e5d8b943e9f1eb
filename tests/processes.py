"""Child processes for tests: a dagsync operation killed part-way (crash tests), and
an llm-style writer that arrives while dagsync holds the lock (live-writer tests)."""

from __future__ import annotations

import os
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


# Put before a child script that runs one dagsync operation, to kill it at a
# point the test chooses. It fixes every chunk at 50 rows, so that a run
# takes the same steps every time whatever the machine's speed; sets the
# transactions of DAGSYNC_TEST_MODE - "short" (as when another process has
# the file open), "long" (steps of a long transaction, committed at every
# step's end) or "whole" (one long transaction); and prints a line for every
# event - each progress report the script passes to ``event`` (at once, even
# inside a transaction), and each write step's start (inside its transaction)
# and end. At event number DAGSYNC_TEST_STOP_AT it stops, so that the kill
# lands exactly there.
STOPPABLE = r"""
import contextlib as _contextlib, os as _os, time as _time
import dagsync.transactions as _transactions
import dagsync.writer as _writer
_writer.FIRST_CHUNK = _writer.MAX_READ_CHUNK = _writer.MAX_WRITE_CHUNK = _writer.ALONE_MAX_WRITE_CHUNK = 50
_mode = _os.environ.get("DAGSYNC_TEST_MODE", "short")
if _mode == "short":
    _transactions.long_transactions = lambda conn: _contextlib.nullcontext()
else:
    _transactions.LONG_COMMIT_SECONDS = 0.0 if _mode == "long" else 3600.0
_stop_at, _events = int(_os.environ.get("DAGSYNC_TEST_STOP_AT", "0")), [0]

def event(*what):
    _events[0] += 1
    print(*what, flush=True)
    if _events[0] == _stop_at:
        _time.sleep(3600)  # until the test kills this process

_step = _writer.Writer.transaction

@_contextlib.contextmanager
def _announced(self):
    with _step(self):
        event("step: writing")
        yield
    event("step: done")

_writer.Writer.transaction = _announced

# The writer holds back reports while a transaction is open, and how many it
# folds into one depends on when the message proofs (a thread) let it commit:
# the events would vary with the machine's load.
_writer.Writer.progress = lambda self, phase, done, total: self._on_progress(phase, done, total)
"""
MODES = ("short", "long", "whole")


def _child(script: str, args: list[str], mode: str, stop_at: int, stderr: IO[str] | None) -> subprocess.Popen:
    env = dict(os.environ, DAGSYNC_TEST_MODE=mode, DAGSYNC_TEST_STOP_AT=str(stop_at))
    return subprocess.Popen(
        [sys.executable, "-c", STOPPABLE + script, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )


def events_of(script: str, args: list[str], mode: str) -> list[str]:
    """The event lines a run of ``script`` (see STOPPABLE) prints, run to the end."""
    process = _child(script, args, mode, 0, subprocess.PIPE)
    out, err = process.communicate(timeout=300)
    if process.returncode != 0:
        raise RuntimeError(f"the child failed: {err}")
    return out.splitlines()


def kill_at(script: str, args: list[str], event: int, mode: str, stderr: IO[str] | None = None) -> tuple[bool, int]:
    """Run ``script`` (see STOPPABLE) until its ``event``-th event, where it stops,
    then ``kill -9`` it. Returns (it was still running: the kill landed at that
    event, its exit status). A run with fewer events ends first."""
    process = _child(script, args, mode, event, stderr)
    for _ in range(event):
        if not process.stdout.readline():
            break
    alive = process.poll() is None
    process.kill()
    process.wait()
    process.stdout.close()
    return alive, process.returncode


def with_terminal_stderr(argv: list[str]) -> tuple[int, bytes, bytes]:
    """Run ``argv`` with standard error on a terminal (a pty) and standard output
    on a pipe, as a person runs ``dagsync ... --json | jq``: its exit status,
    what it wrote to stdout, and what it drew on the terminal."""
    import pty

    main, secondary = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=secondary)
    os.close(secondary)
    drawn = b""
    while True:
        try:
            block = os.read(main, 1 << 16)
        except OSError:  # the other end closed
            break
        if not block:
            break
        drawn += block
    os.close(main)
    assert proc.stdout is not None
    out = proc.stdout.read()
    return proc.wait(), out, drawn
