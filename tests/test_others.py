"""others: who else holds a database file's locks, or has it open (Linux kernel views)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """Another process holds ``path`` open for the block."""
    holder = hold(path)
    try:
        yield
    finally:
        holder.kill()
        holder.wait()


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


def open_and_close_elsewhere(path: Path) -> None:
    subprocess.run([sys.executable, "-c", f"open({str(path)!r}, 'rb').close()"], check=True)


def test_an_open_of_this_process_own_is_not_another_process(db):
    assert not others.may_be_waiting(str(db))
    with others.own_open(str(db)):
        mine = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        mine.execute("SELECT count(*) FROM t").fetchall()
        assert not others.may_be_waiting(str(db))
        # Another process's open after ours is heard as before.
        open_and_close_elsewhere(db)
        assert others.may_be_waiting(str(db))
    finally:
        mine.close()


def test_another_process_open_heard_before_ours_counts_as_before(db):
    """An open heard before ours is another's, whether or not it has the file
    open still (a merge planning again after an llm's open must be polite)."""
    assert not others.may_be_waiting(str(db))
    open_and_close_elsewhere(db)
    with others.own_open(str(db)):
        mine = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    mine.close()
    assert others.may_be_waiting(str(db))


def test_another_process_open_heard_with_ours_counts_while_it_has_the_file_open(db):
    """inotify merges identical unread events: a holder's open made while
    ours is under way may arrive as one with ours. The process table then
    shows the holder."""
    assert not others.may_be_waiting(str(db))
    with others.own_open(str(db)):
        holder = hold(db)
        mine = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    mine.close()
    try:
        assert others.may_be_waiting(str(db))
    finally:
        holder.kill()
        holder.wait()
    assert others.may_be_waiting(str(db))  # and it stays so


def test_another_process_open_heard_with_ours_is_nobody_waiting_once_it_has_closed_the_file(db):
    """What the process table cannot show: a process that opened the file
    and closed it again while ours was being opened - it is not waiting for
    our locks. Its next open is heard."""
    assert not others.may_be_waiting(str(db))
    with others.own_open(str(db)):
        open_and_close_elsewhere(db)
        mine = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    mine.close()
    assert not others.may_be_waiting(str(db))
    open_and_close_elsewhere(db)
    assert others.may_be_waiting(str(db))


def test_an_own_open_that_reuses_a_kept_descriptor_takes_no_other_process_for_ours(db):
    """SQLite keeps the descriptor of a connection closed while another of
    the process holds a lock on the file, and hands it to the next open: no
    open for the kernel to report. Another process's open after it still counts."""
    writer = apsw.Connection(str(db))
    assert not others.may_be_waiting(str(db))
    writer.execute("BEGIN")
    writer.execute("SELECT count(*) FROM t").fetchall()  # a SHARED lock, held
    try:
        with others.own_open(str(db)):
            first = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
        first.execute("SELECT count(*) FROM t").fetchall()
        first.close()  # while the lock is held: SQLite keeps its descriptor
        with others.own_open(str(db)):
            second = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
        second.execute("SELECT count(*) FROM t").fetchall()
        try:
            with holding(db):
                assert others.may_be_waiting(str(db))
        finally:
            second.close()
    finally:
        writer.execute("COMMIT")
        writer.close()


# A merge of two sources into a copy of a third, in a process of its own (a
# fresh view of who has opened what); prints whether the target then seems
# opened by another process, and how many polite pauses the merge took.
MERGE_TWO = r"""
import sys, time
import dagsync.transactions
from dagsync import others
from dagsync.merge import merge
pauses = []
real = time.sleep
dagsync.transactions.time.sleep = lambda s: (pauses.append(s), real(s))
merge(sys.argv[1], sys.argv[2:])
print(others.may_be_waiting(sys.argv[1]), len(pauses))
"""


def test_a_merge_of_several_sources_is_not_polite_to_its_own_threads(tmp_path):
    """A merge's helper threads open the target (the comparison of what both
    files hold; the proofs of a delta, whose rows may refer to the target's):
    nobody else did, so the second source is copied as unhurried as the
    first, whole or from its marks. With another process holding the target
    open, the same merge is polite."""
    from fixtures import family
    from fixtures.generate import grow

    reports = family(tmp_path / "family", seed=3, machines=3, conversations=40, shared_fraction=0.5)
    target, *sources = (str(r.path) for r in reports)
    for _ in ("whole", "from the marks"):
        done = subprocess.run(
            [sys.executable, "-c", MERGE_TWO, target, *sources], capture_output=True, text=True, check=True
        )
        assert done.stdout.split() == ["False", "0"]
        for source in sources:
            grow(source, seed=4)
    with holding(Path(target)):
        done = subprocess.run(
            [sys.executable, "-c", MERGE_TWO, target, *sources], capture_output=True, text=True, check=True
        )
    polite, pauses = done.stdout.split()
    assert polite == "True" and int(pauses) > 0


def test_a_new_file_under_an_old_name_gets_a_new_look(db, tmp_path):
    subprocess.run([sys.executable, "-c", f"open({str(db)!r}, 'rb').close()"], check=True)
    others.may_be_waiting(str(db))
    db.unlink()
    # Another file, possibly with the same inode number: nobody has opened it.
    conn = apsw.Connection(str(db))
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert not others.may_be_waiting(str(db))


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
