"""transactions.long_transactions: one long write transaction while nobody else has the file
open, given up the moment another process opens it (others.OpenAlarm)."""

from __future__ import annotations

import subprocess
import sys
import threading

import apsw
import pytest

from dagsync import transactions as dbmod
from dagsync import others
from dagsync.transactions import OpenedMeanwhile, long_transactions, write_transaction
from tests.processes import run_endless, start_writer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")

@pytest.fixture
def conn(tmp_path):
    path = tmp_path / "x.db"
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE t (x)")
    yield conn
    conn.close()


def rows(path: str) -> list:
    check = apsw.Connection(f"file:{path}?mode=ro", flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
    try:
        return [x for (x,) in check.execute("SELECT x FROM t ORDER BY rowid")]
    finally:
        check.close()


def open_elsewhere(path: str) -> None:
    subprocess.run([sys.executable, "-c", f"open({path!r}, 'rb').close()"], check=True)


def test_an_open_alarm_rings_when_another_process_opens_the_file(conn):
    rang = threading.Event()
    alarm = others.OpenAlarm.start(conn.filename, rang.set)
    assert alarm is not None
    try:
        assert not rang.is_set()
        open_elsewhere(conn.filename)
        assert rang.wait(30)
    finally:
        alarm.close()


def test_steps_share_one_transaction_while_nobody_else_has_the_file_open(conn):
    with long_transactions(conn):
        for i in range(3):
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (?)", (i,))
            assert conn.in_transaction  # the step did not commit
    assert not conn.in_transaction
    assert rows(conn.filename) == [0, 1, 2]


def test_a_long_transaction_commits_every_so_often(conn, monkeypatch):
    monkeypatch.setattr(dbmod, "LONG_COMMIT_SECONDS", 0.0)
    with long_transactions(conn):
        assert id(conn) in dbmod._LONG
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
        assert not conn.in_transaction


def test_a_file_someone_else_has_open_gets_short_transactions(conn):
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; f = open({conn.filename!r}, 'rb'); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        with long_transactions(conn):
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (1)")
            assert not conn.in_transaction
    finally:
        holder.kill()
        holder.wait()


def test_an_open_between_statements_commits_at_the_step_end_and_the_rest_is_polite(conn):
    with long_transactions(conn):
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
        open_elsewhere(conn.filename)
        assert dbmod._LONG[id(conn)].interrupted.wait(30)
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (2)")
        # That step's end let the newcomer in.
        assert not conn.in_transaction
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (3)")
        assert not conn.in_transaction
    assert rows(conn.filename) == [1, 2, 3]


def test_a_writer_that_opens_the_file_mid_statement_gets_in_and_the_transaction_is_rolled_back(conn):
    writers: list[subprocess.Popen] = []
    try:
        with pytest.raises(OpenedMeanwhile, match="another process opened"):
            with long_transactions(conn):
                with write_transaction(conn):
                    conn.execute("INSERT INTO t VALUES ('first step')")
                with write_transaction(conn):
                    conn.execute("INSERT INTO t VALUES ('second step')")
                    # Holds the write lock for minutes unless interrupted.
                    run_endless(conn, lambda: start_writer(conn.filename, "INSERT INTO t VALUES ('writer')"), writers)
    finally:
        # Only once the lock is let go (or the writer has given up).
        outcome = writers[0].communicate(timeout=60)[0].strip() if writers else None
    assert outcome == "ok"
    assert not conn.in_transaction
    # Both steps of the long transaction were rolled back; the writer's row is in.
    assert rows(conn.filename) == ["writer"]


def test_nested_write_transactions_are_one_step(conn, monkeypatch):
    monkeypatch.setattr(dbmod, "LONG_COMMIT_SECONDS", 0.0)
    with long_transactions(conn):
        assert id(conn) in dbmod._LONG
        with write_transaction(conn):
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (1)")
            assert conn.in_transaction  # the inner block is not a step's end
            conn.execute("INSERT INTO t VALUES (2)")
        assert not conn.in_transaction
    assert rows(conn.filename) == [1, 2]


def test_an_error_in_a_step_rolls_the_long_transaction_back(conn):
    with pytest.raises(RuntimeError, match="a step failed"):
        with long_transactions(conn):
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (1)")
            with write_transaction(conn):
                conn.execute("INSERT INTO t VALUES (2)")
                raise RuntimeError("a step failed")
    assert not conn.in_transaction
    assert rows(conn.filename) == []


def test_the_alarm_thread_is_gone_after_the_block(conn):
    before = set(threading.enumerate())
    with long_transactions(conn):
        assert [t.name for t in set(threading.enumerate()) - before] == ["dagsync-open-alarm"]
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
    assert set(threading.enumerate()) - before == set()


def test_an_open_heard_between_steps_lets_the_newcomer_in_before_the_next_step(conn):
    with long_transactions(conn):
        with write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
        long = dbmod._LONG[id(conn)]
        long.opened()  # as the alarm would, between two steps
        assert conn.in_transaction
        with write_transaction(conn):
            # Committed before this step began; this step is a polite one of its own.
            assert id(conn) not in dbmod._LONG
            conn.execute("INSERT INTO t VALUES (2)")
        assert not conn.in_transaction
    assert rows(conn.filename) == [1, 2]


def test_no_alarm_and_no_long_transaction_off_a_local_filesystem(conn):
    mounts = "/dev/vda / ext4 rw 0 0\nserver:/export /home nfs4 rw 0 0\nme@host: /home/me/remote fuse.sshfs rw 0 0\n"
    assert others.on_local_filesystem("/var/lib/x.db", mounts)
    assert not others.on_local_filesystem("/home/me/logs.db", mounts)
    assert not others.on_local_filesystem("/home/me/remote/logs.db", mounts)
    assert others.on_local_filesystem(conn.filename)  # this test's own tmp_path


# -- a merge, when a writer arrives in the middle of its long transaction ------------

@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    from fixtures import family

    return [r.path for r in family(tmp_path_factory.mktemp("fam"), seed=67, machines=2, conversations=300)]


def merge_with_a_writer(tmp_path, machines, monkeypatch, mid_statement: bool):
    """Merge machines[1] into a copy of machines[0]; once the long transaction has
    copied some messages, an llm-style writer opens the target - while a statement
    runs, or between two. Returns (the writer's outcome, plans made)."""
    import shutil

    import dagsync.merge as m
    from dagsync.merge import keyed

    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    plans, writers = [], []
    inner = keyed.apply

    def apply_keyed(self, table):
        # Messages are in by now, inside the long transaction.
        if not writers and dbmod._LONG:
            insert = "INSERT INTO conversations (id, name, model) VALUES ('from-the-writer', 'live', 'echo')"
            if mid_statement:
                run_endless(self.conn, lambda: start_writer(str(target), insert), writers)  # interrupted
            else:
                writers.append(start_writer(str(target), insert))
                assert next(iter(dbmod._LONG.values())).interrupted.wait(30)
        return inner(self, table)

    monkeypatch.setattr(keyed, "apply", apply_keyed)
    report = m.merge(target, [machines[1]], progress=lambda phase, done, total: plans.append(phase) if phase == "planned" else None)
    assert writers, "the merge never wrote in a long transaction"
    outcome = writers[0].communicate(timeout=60)[0].strip()
    return target, outcome, len(plans), report


@pytest.mark.parametrize("mid_statement", [True, False], ids=["mid-statement", "between-statements"])
def test_a_writer_that_opens_the_target_during_a_long_transaction_gets_in_and_nothing_is_lost(
    tmp_path, machines, monkeypatch, mid_statement
):
    from dagsync.merge import merge
    from tests.history import contains, integrity, logical, union_of

    target, outcome, plans, _ = merge_with_a_writer(tmp_path, machines, monkeypatch, mid_statement)
    assert outcome == "ok"
    # Interrupted mid-statement, the transaction was rolled back and the merge planned again.
    assert plans == (2 if mid_statement else 1)
    assert integrity(target) == []
    assert contains(logical(target), union_of(logical(machines[0]), logical(machines[1]))) == []
    assert "from-the-writer" in {row[0] for row in apsw.Connection(str(target)).execute("SELECT id FROM conversations")}
    # And it is all there: merging again writes nothing.
    assert merge(target, [machines[1]]).sources[0].written == 0


def test_what_an_attempt_cut_short_had_committed_is_reported(tmp_path, machines, monkeypatch):
    """The messages were committed before the writer came; the merge planned
    again, found them there, and still says it added them (found on a loaded
    machine: a report of 0 messages added by a merge that added them all)."""
    import shutil

    from dagsync.merge import merge

    clean = tmp_path / "clean.db"
    shutil.copyfile(machines[0], clean)
    expected = {t.table: (t.added, t.mapped, t.existing) for t in merge(clean, [machines[1]]).sources[0].tables}
    monkeypatch.setattr(dbmod, "LONG_COMMIT_SECONDS", 0.0)  # each step committed as it ends
    _, outcome, plans, report = merge_with_a_writer(tmp_path, machines, monkeypatch, mid_statement=True)
    assert (outcome, plans) == ("ok", 2)
    assert {t.table: (t.added, t.mapped, t.existing) for t in report.sources[0].tables} == expected
