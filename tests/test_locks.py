"""locks: who holds a database file's SQLite locks, and taking the write lock PENDING first.

The law ``pending_first`` keeps: while another process reads, we never hold
RESERVED, so a reader one step from writing (llm's deferred transactions) is
never refused; while we hold PENDING, nobody can begin reading.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import apsw
import pytest

from dagsync import locks
from dagsync.transactions import write_transaction

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/locks")

RESERVED_BYTE = locks.PENDING_BYTE + 1
SHARED_FIRST = locks.PENDING_BYTE + 2

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

# An llm-style writer: a deferred transaction that reads, then (told to) writes
# and commits, with a 5 s busy timeout; it says what each step did.
READER = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=5)
conn.execute("BEGIN")
conn.execute("SELECT count(*) FROM t").fetchone()
print("reading", flush=True)
for step, sql in (("inserted", "INSERT INTO t VALUES ('llm')"), ("committed", "COMMIT")):
    sys.stdin.readline()
    try:
        conn.execute(sql)
        print(step, flush=True)
    except sqlite3.OperationalError as exc:
        print(f"{step[:-2]} refused: {exc}", flush=True)
        raise SystemExit(1)
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


def my_locks(path: Path) -> set[tuple[str, int, int]]:
    """This process's POSIX locks on ``path``: (READ or WRITE, first byte, last byte)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    held = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[1] != "->" and fields[4] == str(os.getpid()) and fields[5] == ident:
            held.add((fields[3], int(fields[6]), int(fields[7]) if fields[7] != "EOF" else -1))
    return held


def read_elsewhere(path: Path) -> str:
    """What another process gets when it begins to read ``path``, not waiting."""
    code = (
        "import sqlite3, sys\n"
        "try: print(sqlite3.connect(sys.argv[1], timeout=0).execute('SELECT count(*) FROM t').fetchone()[0])\n"
        "except sqlite3.OperationalError as exc: print(exc)"
    )
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True).stdout.strip()


def covers(held: set[tuple[str, int, int]], byte: int, kind: str | None = None) -> bool:
    return any(first <= byte and (last == -1 or last >= byte) and kind in (None, what) for what, first, last in held)


def test_a_lock_is_seen_while_held_and_not_after(db):
    assert not locks.holds_lock(str(db))
    holder = hold(db, "in a transaction")
    try:
        assert locks.holds_lock(str(db))
    finally:
        holder.kill()
        holder.wait()
    assert not locks.holds_lock(str(db))
    # An open file without a transaction holds no lock.
    holder = hold(db)
    try:
        assert not locks.holds_lock(str(db))
    finally:
        holder.kill()
        holder.wait()


def test_with_nobody_else_the_file_is_exclusive_and_begin_exclusive_finds_it_so(db):
    conn = apsw.Connection(str(db))
    with locks.pending_first(conn) as clear:
        assert clear
        assert covers(my_locks(db), SHARED_FIRST, "WRITE")  # EXCLUSIVE (SQLite drops PENDING once it has it)
        # Nobody can begin reading now...
        assert read_elsewhere(db) == "database is locked"
        conn.set_busy_timeout(0)  # ...and BEGIN EXCLUSIVE need wait for nothing
        conn.execute("BEGIN EXCLUSIVE")
    assert conn.in_transaction and covers(my_locks(db), SHARED_FIRST, "WRITE")  # the transaction owns it
    conn.execute("INSERT INTO t VALUES ('dagsync')")
    conn.execute("COMMIT")
    assert my_locks(db) == set()
    assert read_elsewhere(db) == "1"


def test_a_try_that_finds_a_reader_lets_go_and_holds_nothing(db):
    conn = apsw.Connection(str(db))
    holder = hold(db, "in a transaction")
    try:
        with locks.pending_first(conn) as clear:
            assert not clear
        assert my_locks(db) == set()
    finally:
        holder.kill()
        holder.wait()
    with locks.pending_first(conn) as clear:
        assert clear
    assert my_locks(db) == set()  # not taken into a transaction: let go


def test_a_reader_one_step_from_writing_is_never_refused_by_a_try(db):
    """The race a BEGIN EXCLUSIVE try has: it holds RESERVED for a moment, and a
    reader that asks for RESERVED then is refused at once, busy timeout or not."""
    conn = apsw.Connection(str(db))
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout.readline() == "reading\n"
        with locks.pending_first(conn) as clear:
            assert not clear
            assert not covers(my_locks(db), RESERVED_BYTE)
            reader.stdin.write("write\n")
            reader.stdin.flush()
            assert reader.stdout.readline() == "inserted\n"  # RESERVED was free
            reader.stdin.write("commit\n")
            reader.stdin.flush()  # its COMMIT waits for our SHARED, inside its busy timeout
        assert reader.stdout.readline() == "committed\n"
        assert reader.wait(timeout=10) == 0
    finally:
        reader.kill()
        reader.wait()
    assert sqlite3.connect(db).execute("SELECT x FROM t").fetchall() == [("llm",)]


CRASHER = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA cache_size = 5")  # spill: half of the update reaches the file itself
conn.execute("BEGIN")
conn.execute("UPDATE t SET x = randomblob(1000)")
print("written", flush=True)
time.sleep(60)
"""


def test_a_crash_journal_is_rolled_back_by_sqlite_not_taken_for_a_writer(db, monkeypatch):
    """A hot journal is SQLite's to roll back; holding EXCLUSIVE ourselves before
    BEGIN would make SQLite take it for a live writer's and read the half-written file.

    The writer crashes just before the try (after ``_unix_file``, whose own
    read would roll back a journal that was there before)."""
    conn = apsw.Connection(str(db))
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500) "
        "INSERT INTO t SELECT randomblob(1000) FROM n"
    )
    before = hashlib.sha256(b"".join(x for (x,) in conn.execute("SELECT x FROM t ORDER BY rowid"))).hexdigest()
    conn.close()
    unix_file = locks._unix_file

    def crash_first(c: apsw.Connection):
        file = unix_file(c)
        crasher = subprocess.Popen([sys.executable, "-c", CRASHER, str(db)], stdout=subprocess.PIPE, text=True)
        assert crasher.stdout.readline() == "written\n"
        crasher.kill()
        crasher.wait()
        assert Path(f"{db}-journal").stat().st_size > 0
        return file

    monkeypatch.setattr(locks, "_unix_file", crash_first)
    conn = apsw.Connection(str(db))  # nothing cached from before: what it reads, it reads from the file
    with write_transaction(conn):
        conn.execute("INSERT INTO t VALUES (x'00')")
    rows = [x for (x,) in conn.execute("SELECT x FROM t ORDER BY rowid")]
    assert hashlib.sha256(b"".join(rows[:-1])).hexdigest() == before and rows[-1] == b"\x00"
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_only_a_rollback_journal_file_of_sqlites_unix_vfs_is_taken_pending_first(db, tmp_path):
    assert locks._unix_file(apsw.Connection(str(db))) is not None
    assert locks._unix_file(apsw.Connection(":memory:")) is None
    wal = apsw.Connection(str(tmp_path / "wal.db"))
    wal.execute("PRAGMA journal_mode = WAL")
    assert locks._unix_file(wal) is None


@pytest.mark.parametrize(
    ("exclusive", "clear"),
    [(apsw.SQLITE_BUSY, False), (apsw.SQLITE_IOERR_LOCK, True)],
    ids=["busy: later", "an error: the statement meets it and names it"],
)
def test_what_the_vfs_answers_decides_the_try_and_nothing_stays_held(db, monkeypatch, exclusive, clear):
    calls: list[tuple[str, int]] = []

    def lock(_file, level):
        calls.append(("lock", level))
        return exclusive if level == apsw.SQLITE_LOCK_EXCLUSIVE else apsw.SQLITE_OK

    def unlock(_file, level):
        calls.append(("unlock", level))
        return apsw.SQLITE_OK

    methods = locks._IoMethods(iVersion=1, xLock=locks._IoMethods._LOCK(lock), xUnlock=locks._IoMethods._LOCK(unlock))
    file = locks._File(pMethods=ctypes.pointer(methods))
    monkeypatch.setattr(locks, "_unix_file", lambda conn: ctypes.pointer(file))
    with locks.pending_first(apsw.Connection(str(db))) as told:
        assert told is clear
    assert calls[:2] == [("lock", apsw.SQLITE_LOCK_SHARED), ("lock", apsw.SQLITE_LOCK_EXCLUSIVE)]
    assert set(calls[2:]) == {("unlock", apsw.SQLITE_LOCK_NONE)}
