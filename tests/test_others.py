"""others: who else holds a database file's locks, or has it open (Linux kernel views)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import apsw
import pytest

import dagsync.transactions
from dagsync import others
from dagsync.transactions import write_transaction

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc and inotify")

# Holds the file open (and, with a second argument, a read transaction) until killed.
HOLDER = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
if len(sys.argv) > 2:
    conn.execute("BEGIN")
    conn.execute("SELECT count(*) FROM t").fetchone()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "x.db"
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    return path


def hold(path: Path, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_nobody_else_nobody_waiting(db):
    assert not others.may_be_waiting(str(db))
    assert not others.may_be_waiting(str(db))


def test_a_process_that_opens_the_file_later_may_be_waiting(db):
    assert not others.may_be_waiting(str(db))
    subprocess.run([sys.executable, "-c", f"open({str(db)!r}, 'rb').close()"], check=True)
    assert others.may_be_waiting(str(db))
    # And it stays so: a process that has been here may come back.
    assert others.may_be_waiting(str(db))


def test_a_process_that_had_the_file_open_before_may_be_waiting(db):
    holder = hold(db)
    try:
        assert others.may_be_waiting(str(db))
    finally:
        holder.kill()
        holder.wait()


def test_a_new_file_under_an_old_name_gets_a_new_look(db, tmp_path):
    subprocess.run([sys.executable, "-c", f"open({str(db)!r}, 'rb').close()"], check=True)
    others.may_be_waiting(str(db))
    db.unlink()
    # Another file, possibly with the same inode number: nobody has opened it.
    conn = apsw.Connection(str(db))
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert not others.may_be_waiting(str(db))


def test_a_lock_is_seen_while_held_and_not_after(db):
    assert not others.holds_lock(str(db))
    holder = hold(db, "in a transaction")
    try:
        assert others.holds_lock(str(db))
    finally:
        holder.kill()
        holder.wait()
    assert not others.holds_lock(str(db))
    # An open file without a transaction holds no lock.
    holder = hold(db)
    try:
        assert not others.holds_lock(str(db))
    finally:
        holder.kill()
        holder.wait()


def test_write_transactions_pause_only_when_someone_may_be_waiting(db, monkeypatch):
    pauses: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(dagsync.transactions.time, "sleep", lambda s: (pauses.append(s), real_sleep(s)))
    conn = apsw.Connection(str(db))
    try:
        for _ in range(3):
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (1)")
        assert pauses == []
        holder = hold(db)
        try:
            for _ in range(3):
                with write_transaction(conn):
                    conn.execute("INSERT INTO t VALUES (1)")
        finally:
            holder.kill()
            holder.wait()
        assert len(pauses) == 3
    finally:
        conn.close()
