"""writer.Writer: the one owner of how a target is written.

Its parts on their own (ranges cover every row once, progress never called
inside a transaction, on_commit counts only what is committed, redo), then
every operation that writes - gc, pack, unpack, canonicalise, vacuum - in
the writer's long transactions: an llm-style writer that opens the file
while one runs gets in, nothing is lost, and the file and the report are
those of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import sys
from pathlib import Path

import apsw
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dagsync.transactions as transactions
import dagsync.writer as writer_module
from dagsync.blobs import pack
from dagsync.unpack import unpack
from dagsync.canonicalise import canonicalise
from dagsync.db import open_target
from dagsync.errors import DagsyncError
from dagsync.gc import gc
from dagsync.transactions import OpenedMeanwhile
from dagsync.vacuum import vacuum
from dagsync.verify import verify
from dagsync.writer import Writer
from fixtures import generate
from tests.history import content_dump
from tests.processes import run_endless, start_writer

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


@pytest.fixture
def conn(tmp_path):
    conn = apsw.Connection(str(tmp_path / "x.db"))
    conn.execute("CREATE TABLE t (x)")
    yield conn
    conn.close()


def rows(path: str) -> list:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as check:
        return [x for (x,) in check.execute("SELECT x FROM t ORDER BY rowid")]


# -- ranges ---------------------------------------------------------------------------------


@given(
    st.sets(st.integers(1, 5000), max_size=300),
    st.integers(1, 700),
    st.sampled_from(["1", "x % 3 = 0"]),
    st.one_of(st.none(), st.integers(0, 5000)),
    st.sampled_from(["rowid", "x", "label"]),
)
def test_ranges_cover_every_matching_row_exactly_once(rowids, first, where, bound, column):
    conn = apsw.Connection(":memory:")
    conn.execute("CREATE TABLE t (x INTEGER, label TEXT)")
    conn.executemany("INSERT INTO t (rowid, x, label) VALUES (?, ?, ?)", [(r, r, f"k{r:05d}") for r in rowids])
    writer = Writer(conn)
    writer_module.FIRST_CHUNK, saved = first, writer_module.FIRST_CHUNK
    try:
        seen = []
        for low, high in writer.ranges("main.t", column, where=where, rowid_bound=bound):
            assert low <= high
            seen += [r for (r,) in conn.execute(f"SELECT rowid FROM t WHERE {column} BETWEEN ? AND ? AND {where}", (low, high))]
    finally:
        writer_module.FIRST_CHUNK = saved
    expected = sorted(r for r in rowids if (where == "1" or r % 3 == 0) and (bound is None or r <= bound))
    if bound is not None and column not in ("rowid", "x"):
        # A bound on another column is the caller's to repeat in its statements.
        seen = [r for r in seen if r <= bound]
    assert sorted(seen) == expected
    assert len(seen) == len(set(seen))


def test_ranges_reach_rows_added_while_they_run(conn):
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(10)])
    writer = Writer(conn)
    seen = []
    for low, high in writer.ranges("main.t"):
        seen += [r for (r,) in conn.execute("SELECT rowid FROM t WHERE rowid BETWEEN ? AND ?", (low, high))]
        if len(seen) < 30:
            conn.execute("INSERT INTO t VALUES (99)")  # a live writer's row, after the end
    assert sorted(seen) == list(range(1, len(seen) + 1)) and len(seen) >= 30


# -- progress and on_commit --------------------------------------------------------------------


def test_progress_waits_for_the_commit_and_on_commit_counts_only_what_is_committed(conn, monkeypatch):
    monkeypatch.setattr(transactions, "LONG_COMMIT_SECONDS", 3600.0)  # one long transaction
    calls: list[tuple] = []
    committed: list[int] = []
    writer = Writer(conn, lambda *a: calls.append((a, conn.in_transaction)))
    with writer.session():
        for i in range(3):
            with writer.transaction():
                conn.execute("INSERT INTO t VALUES (?)", (i,))
                writer.on_commit(lambda i=i: committed.append(i))
            writer.progress("copying", i + 1, 3)
        if transactions._LONG:  # a long transaction could be had: nothing passed on inside it
            assert conn.in_transaction and calls == [] and committed == []
    assert committed == [0, 1, 2]
    assert calls and all(not inside for _, inside in calls)
    assert calls[-1][0] == ("copying", 3, 3)


def test_on_commit_forgets_what_was_rolled_back(conn):
    committed: list[str] = []
    writer = Writer(conn)
    with writer.transaction():
        writer.on_commit(lambda: committed.append("first"))
    with pytest.raises(RuntimeError):
        with writer.transaction():
            writer.on_commit(lambda: committed.append("second"))
            raise RuntimeError("a step failed")
    writer.on_commit(lambda: committed.append("outside"))  # no transaction: at once
    assert committed == ["first", "outside"]


def test_a_dry_run_writes_nothing_and_counts_at_once(conn):
    committed: list[int] = []
    writer = Writer(conn, dry_run=True)
    with writer.session():
        with writer.transaction():
            assert not conn.in_transaction
            writer.on_commit(lambda: committed.append(1))
    assert committed == [1]


def test_redo_starts_again_and_gives_up_with_a_clear_message(conn, monkeypatch):
    monkeypatch.setattr(transactions, "long_transactions", lambda c: __import__("contextlib").nullcontext())
    writer = Writer(conn)
    attempts: list[int] = []

    def work() -> str:
        attempts.append(1)
        if len(attempts) < 2:
            raise OpenedMeanwhile("another process opened it")
        return "done"

    assert writer.redo(work, "doing it") == "done" and len(attempts) == 2

    def never() -> None:
        raise OpenedMeanwhile("another process opened it")

    with pytest.raises(DagsyncError) as info:
        writer.redo(never, "packing it")
    assert str(info.value) == (
        f"another process kept opening {conn.filename} while packing it; "
        "everything written so far is consistent - run the command again"
    )


# -- every operation, in long transactions, with a writer arriving ---------------------------


NOW = 1_900_000_000.0  # past every message the generator dates
WRITER_ROW = "INSERT INTO conversations (id, name, model) VALUES ('from-the-writer', 'live', 'echo')"


def dump(path: Path) -> list[str]:
    """Every row but dagsync's bookkeeping, the blob store, and the live writer's row; full-text
    indexes by what they index (unpack makes them again: ``history.content_dump``)."""
    return content_dump(path, ("_dagsync_", "blob_dicts", 'INTO "blobs"', "TABLE blobs", "from-the-writer"))


def orphan_a_third(path: Path) -> None:
    with sqlite3.connect(path) as c:
        c.execute("DELETE FROM calls WHERE conversation_id IN (SELECT id FROM conversations WHERE rowid % 3 = 0)")
        c.execute("UPDATE conversations SET head_message_id = NULL WHERE rowid % 3 = 0")


def with_duplicates(path: Path) -> None:
    """A copy of every fourth leaf message under the same parent, with its parts, as a
    file without the unique index can hold; the copies' ids sort after the originals'."""
    leaves = (
        "SELECT id FROM messages m WHERE id != 'root' AND rowid % 4 = 0 "
        "AND NOT EXISTS (SELECT 1 FROM messages c WHERE c.parent_id = m.id)"
    )
    with sqlite3.connect(path) as c:
        c.execute("DROP INDEX idx_messages_parent_hash_unique")
        c.execute(f"CREATE TEMP TABLE twins AS {leaves}")
        c.execute(
            "INSERT INTO messages SELECT 'zz' || substr(id, 3), parent_id, content_hash, role, provider_metadata_json, "
            "created_at FROM messages WHERE id IN (SELECT id FROM temp.twins)"
        )
        c.execute(
            "INSERT INTO message_parts SELECT 'zz' || id, 'zz' || substr(message_id, 3), \"order\", part_type, content, "
            "content_json, tool_call_id, server_executed FROM message_parts WHERE message_id IN (SELECT id FROM temp.twins)"
        )


def incremental_with_free_pages(path: Path) -> None:
    with sqlite3.connect(path, isolation_level=None) as c:
        c.execute("PRAGMA auto_vacuum = INCREMENTAL")
        c.execute("VACUUM")
        c.execute("CREATE TABLE filler AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000) "
                  "SELECT randomblob(3000) AS x FROM n")
        c.execute("DROP TABLE filler")  # about 1,500 free pages


# name: (prepare the file, run the operation, the figures of its report an interruption must not change)
OPERATIONS = {
    "gc": (orphan_a_third, lambda p: gc(p, grace="0s", now=NOW), lambda r: (r.deleted, [(t.table, t.deleted) for t in r.tables])),
    "pack": (lambda p: None, lambda p: pack(p, threshold=100), lambda r: ([c.packed for c in r.columns], r.distinct_payloads, r.new_blobs)),
    "unpack": (lambda p: pack(p, threshold=100), unpack, lambda r: (r.values, r.payload_bytes, r.blobs_removed)),
    "canonicalise": (with_duplicates, canonicalise, lambda r: (r.groups, r.collapsed, r.parts_removed)),
    "vacuum": (incremental_with_free_pages, lambda p: _vacuum(p), lambda r: r.mode),
}


def _vacuum(path: Path):
    with open_target(path) as db:
        return vacuum(db)


@pytest.fixture(scope="module")
def subject(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("subject") / "dag.db"
    generate(path, seed=23, conversations=150)
    return path


def prepared(subject: Path, directory: Path, name: str, operation: str) -> Path:
    """The operation's starting file, made on another file and copied: this process
    opening the file itself counts as someone else opening it (inotify cannot tell),
    and then there is no long transaction to interrupt."""
    scratch, path = directory / f"{name}-scratch.db", directory / f"{name}.db"
    shutil.copyfile(subject, scratch)
    OPERATIONS[operation][0](scratch)
    shutil.copyfile(scratch, path)
    return path


def long_steps(monkeypatch) -> list[int]:
    """Count the write steps taken inside long transactions."""
    steps: list[int] = []
    inner = writer_module.Writer.transaction

    def transaction(self):
        if transactions._LONG:
            steps.append(1)
        return inner(self)

    monkeypatch.setattr(writer_module.Writer, "transaction", transaction)
    return steps


def interrupt_a_step(monkeypatch, path: Path, step: int, mid_statement: bool) -> list:
    """On write step ``step`` inside a long transaction, an llm-style writer opens
    the file: while a statement runs at the end of the step (before it commits), or
    once the step is done."""
    writers: list = []
    steps: list[int] = []
    inner = writer_module.Writer.transaction

    def transaction(self):
        @contextlib.contextmanager
        def one_step():
            with inner(self):
                if not writers and transactions._LONG:
                    steps.append(1)
                yield
                if not writers and len(steps) == step and mid_statement:
                    # The step's own statements have run: all of it is rolled back.
                    run_endless(self.conn, lambda: start_writer(str(path), WRITER_ROW), writers)
            if not writers and len(steps) == step and not mid_statement:
                writers.append(start_writer(str(path), WRITER_ROW))
                assert next(iter(transactions._LONG.values())).interrupted.wait(30)

        return one_step()

    monkeypatch.setattr(writer_module.Writer, "transaction", transaction)
    return writers


@linux_only
@pytest.mark.parametrize("where", [0.25, 0.75], ids=["early", "late"])
@pytest.mark.parametrize("mid_statement", [True, False], ids=["mid-statement", "between-statements"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_an_llm_that_opens_the_file_during_a_long_transaction_gets_in_and_the_result_is_whole(
    subject, tmp_path, monkeypatch, operation, mid_statement, where
):
    _, run, figures = OPERATIONS[operation]
    # Small chunks, each step committed: many steps, and an interrupted attempt
    # has committed some of the work before it gives way.
    monkeypatch.setattr(transactions, "LONG_COMMIT_SECONDS", 0.0)
    monkeypatch.setattr(writer_module, "FIRST_CHUNK", 20)
    monkeypatch.setattr(writer_module, "ALONE_MAX_WRITE_CHUNK", 40)
    expected_path = prepared(subject, tmp_path, "expected", operation)
    with monkeypatch.context() as counting:
        steps = long_steps(counting)
        expected = run(expected_path)
    assert len(steps) >= 4, f"{operation} took {len(steps)} steps: too few to interrupt one part-way"
    path = prepared(subject, tmp_path, "interrupted", operation)
    # Work before that step is committed; the step's own is rolled back.
    writers = interrupt_a_step(monkeypatch, path, 1 + int(len(steps) * where), mid_statement)
    report = run(path)
    assert writers, f"{operation} never reached that step in a long transaction"
    assert writers[0].communicate(timeout=60)[0].strip() == "ok"
    assert "from-the-writer" in {r[0] for r in sqlite3.connect(path).execute("SELECT id FROM conversations")}
    assert verify(path).problems == ()
    assert dump(path) == dump(expected_path)
    assert figures(report) == figures(expected)
