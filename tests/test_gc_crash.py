"""Deletion is crash-safe: kill -9 at any point of a gc leaves a database that
``verify`` passes, and the next gc finishes the job."""

from __future__ import annotations

import random
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dagsync.gc import gc
from dagsync.errors import NotADatabase
from dagsync.verify import verify
from fixtures import generate
from tests.history import integrity
from tests.processes import MODES, events_of, kill_at

# Chunks of 50 rows, so there are many commit points; the child stops at the
# event the test picks and is killed there (tests.processes.STOPPABLE): while
# reading, inside a write step, or between two, in short transactions, steps
# of a long one committed at each step's end, or one long transaction.
GC = r"""
import sys
import dagsync.gc
dagsync.gc.gc(sys.argv[1], grace="0s", progress=event)
"""

# Columns that point into the message DAG from outside it, and the DAG's links.
ROOTS = {
    "dag": (("conversations", "head_message_id"), ("calls", "head_input_message_id"), ("calls", "head_output_message_id")),
    "llm": (("threads", "tip_message_hash"), ("turns", "parent_message_hash"), ("turns", "tip_message_hash")),
}
KEY = {"dag": ("id", "parent_id"), "llm": ("hash", "parent_hash")}
# The rows that belong to a message: (table, SQL selecting them for the messages in temp.keep).
OWNED = {
    "dag": {
        "messages": "SELECT * FROM messages WHERE id IN (SELECT k FROM temp.keep)",
        "message_parts": "SELECT * FROM message_parts WHERE message_id IN (SELECT k FROM temp.keep)",
    },
    "llm": {
        "messages": "SELECT * FROM messages WHERE hash IN (SELECT k FROM temp.keep)",
        "parts": "SELECT * FROM parts WHERE message_hash IN (SELECT k FROM temp.keep)",
        "part_attachments": "SELECT a.* FROM part_attachments a JOIN parts p ON p.id = a.part_id "
        "WHERE p.message_hash IN (SELECT k FROM temp.keep)",
        "part_fragments": "SELECT f.* FROM part_fragments f JOIN parts p ON p.id = f.part_id "
        "WHERE p.message_hash IN (SELECT k FROM temp.keep)",
        "fragments": "SELECT * FROM fragments WHERE id IN (SELECT f.fragment_id FROM part_fragments f "
        "JOIN parts p ON p.id = f.part_id WHERE p.message_hash IN (SELECT k FROM temp.keep))",
        "attachments": "SELECT * FROM attachments WHERE id IN (SELECT a.attachment_id FROM part_attachments a "
        "JOIN parts p ON p.id = a.part_id WHERE p.message_hash IN (SELECT k FROM temp.keep))",
    },
}


def sorted_rows(rows) -> list[tuple]:
    return sorted(rows, key=repr)


def reachable_rows(path: Path, fmt: str) -> dict[str, list[tuple]]:
    """Every row of every message a root reaches: what no gc, whole or killed, may touch."""
    key, parent = KEY[fmt]
    starts = " UNION ".join(f'SELECT "{c}" FROM "{t}" WHERE "{c}" IS NOT NULL' for t, c in ROOTS[fmt])
    if fmt == "dag":
        starts += " UNION SELECT 'root'"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        conn.execute(
            f"CREATE TEMP TABLE keep AS WITH RECURSIVE r(k) AS ({starts} "
            f"UNION SELECT m.{parent} FROM r JOIN messages m ON m.{key} = r.k WHERE m.{parent} IS NOT NULL) "
            "SELECT k FROM r"
        )
        return {table: sorted_rows(conn.execute(sql)) for table, sql in OWNED[fmt].items()}


def dump(path: Path) -> dict[str, list[tuple]]:
    """Every row of every table (FTS indexes aside: their pages depend on the order of deletes)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        virtual = [n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE sql LIKE 'CREATE VIRTUAL TABLE%'")]
        tables = [
            n
            for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
            if not any(n == v or n.startswith(v + "_") for v in virtual)
        ]
        out = {t: sorted_rows(conn.execute(f'SELECT * FROM "{t}"')) for t in tables}
    # When gc first saw a row is bookkeeping that depends on when each run
    # happened: compare which rows it remembers, not when.
    if "_dagsync_gc_seen" in out:
        out["_dagsync_gc_seen"] = sorted_rows(row[:2] for row in out["_dagsync_gc_seen"])
    # When a source was last merged, and when the file was last rewritten
    # (merge.marks, bookkeeping.rewritten): compare what, not when.
    if "_dagsync_sources" in out:
        out["_dagsync_sources"] = sorted_rows(row[:4] + (row[5] is not None,) for row in out["_dagsync_sources"])
    if "_dagsync_meta" in out:
        out["_dagsync_meta"] = sorted_rows(
            (k, v.split(" at ")[0] if k == "rewritten" else v) for k, v in out["_dagsync_meta"]
        )
    # Bookkeeping tables are made when first needed, and a killed run may have
    # made them for nothing: empty ones count as absent.
    if out.get("_dagsync_meta") == [("layout_version", "1")]:
        del out["_dagsync_meta"]
    return {t: rows for t, rows in out.items() if rows or not t.startswith("_dagsync_")}


def foreign_key_problems(path: Path) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute("PRAGMA foreign_key_check").fetchall()


SHARED = ("fragments", "attachments", "tools", "tool_instances")
# Keys of shared rows held inside llm's parts.payload JSON (llm writes a link row for each too).
PAYLOAD_KEYS = {
    "fragments": "j.fullkey GLOB '$.text_ref[[]*[]].fragment'",
    "attachments": "(j.fullkey = '$.attachment.id' OR j.fullkey GLOB '$.attachments[[]*[]].id')",
}


def unreferenced(path: Path) -> set[tuple[str, object]]:
    """(table, key) of the shared rows nothing references: no foreign key of any table, no part payload."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        tables = [n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")]
        out = set()
        for shared in SHARED:  # each keyed by "id"
            referenced = " UNION ".join(
                f'SELECT "{fk[3]}" FROM "{t}" WHERE "{fk[3]}" IS NOT NULL'
                for t in tables
                for fk in conn.execute("SELECT * FROM pragma_foreign_key_list(?)", (t,))
                if fk[2] == shared
            )
            if "parts" in tables and shared in PAYLOAD_KEYS and any(
                c == "payload" for (c,) in conn.execute("SELECT name FROM pragma_table_info('parts')")
            ):
                referenced += (
                    f" UNION SELECT j.value FROM parts p, json_tree(p.payload) j "
                    f"WHERE json_valid(p.payload) AND {PAYLOAD_KEYS[shared]}"
                )
            out |= {
                (shared, key)
                for (key,) in conn.execute(f'SELECT id FROM "{shared}" WHERE id NOT IN ({referenced})')
            }
    return out


def gc_to_the_end(path: Path) -> int:
    """gc (grace 0s) until a run deletes nothing and nothing waits; return how many runs that took."""
    for runs in range(1, 5):
        report = gc(path, grace="0s")
        if report.deleted == 0 and not any(t.waiting for t in report.tables):
            return runs
    raise AssertionError(f"gc was still deleting or waiting after {runs} runs: {report}")


def orphan_dag(path: Path) -> None:
    """Make every third conversation unreachable, with its calls and legacy rows gone."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TEMP TABLE gone AS SELECT id FROM conversations WHERE rowid % 3 = 0")
        conn.execute("CREATE TEMP TABLE gone_r AS SELECT id FROM responses WHERE conversation_id IN (SELECT id FROM gone)")
        for table in ("prompt_attachments", "prompt_fragments", "system_fragments", "tool_responses", "tool_calls", "parts"):
            conn.execute(f"DELETE FROM {table} WHERE response_id IN (SELECT id FROM gone_r)")
        conn.execute(
            "DELETE FROM tool_results_attachments WHERE tool_result_id IN "
            "(SELECT id FROM tool_results WHERE response_id IN (SELECT id FROM gone_r))"
        )
        conn.execute("DELETE FROM tool_results WHERE response_id IN (SELECT id FROM gone_r)")
        conn.execute("DELETE FROM responses WHERE id IN (SELECT id FROM gone_r)")
        conn.execute("DELETE FROM calls WHERE conversation_id IN (SELECT id FROM gone)")
        conn.execute("UPDATE conversations SET head_message_id = NULL WHERE id IN (SELECT id FROM gone)")
    conn.close()


def orphan_llm(path: Path) -> None:
    """Delete every third thread, with its turns and the rows that hang off them."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TEMP TABLE gone AS SELECT id FROM threads WHERE rowid % 3 = 0")
        conn.execute("CREATE TEMP TABLE gone_t AS SELECT id FROM turns WHERE thread_id IN (SELECT id FROM gone)")
        for table in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
            conn.execute(f"DELETE FROM {table} WHERE turn_id IN (SELECT id FROM gone_t)")
        conn.execute("DELETE FROM turns WHERE id IN (SELECT id FROM gone_t)")
        conn.execute("UPDATE threads SET forked_from = NULL WHERE forked_from IN (SELECT id FROM gone)")
        conn.execute("DELETE FROM threads WHERE id IN (SELECT id FROM gone)")
    conn.close()


def gc_lines(path: Path, mode: str) -> list[str]:
    """The lines the GC script prints, run to the end."""
    return events_of(GC, [str(path)], mode)


@dataclass(frozen=True)
class Case:
    path: Path  # the database before gc
    fmt: str
    lines: dict[str, int]  # lines a whole run prints, by mode
    first_write: dict[str, int]  # the line that says its first write transaction began (1-based), by mode
    reachable: dict[str, list[tuple]]  # reachable_rows() before gc
    unreferenced: set[tuple[str, object]]  # unreferenced() before gc
    expected: dict[str, list[tuple]]  # dump() after an uninterrupted gc_to_the_end()


def make_case(directory: Path, fmt: str, *, seen_once: bool = False) -> Case:
    start = directory / "start.db"
    if fmt == "dag":
        generate(start, seed=81, conversations=300)
        orphan_dag(start)
    else:
        from fixtures import generate_llm

        generate_llm(start, seed=82, conversations=300)
        orphan_llm(start)
        if seen_once:
            # A first run, inside its grace period, records when it found each
            # message unreachable; the next one (this test's) deletes them.
            gc(start, grace="1h")
    assert foreign_key_problems(start) == []
    assert verify(start).problems == ()
    lines, first_write = {}, {}
    for mode in MODES:
        probe = directory / f"probe-{mode}.db"
        shutil.copyfile(start, probe)
        printed = gc_lines(probe, mode)
        lines[mode], first_write[mode] = len(printed), printed.index("step: writing") + 1
    whole = directory / "whole.db"
    shutil.copyfile(start, whole)
    gc_to_the_end(whole)
    expected = dump(whole)
    assert len(expected["messages"]) < len(dump(start)["messages"]), "nothing to collect: the test would prove nothing"
    return Case(start, fmt, lines, first_write, reachable_rows(start, fmt), unreferenced(start), expected)


@pytest.fixture(scope="module")
def dag_case(tmp_path_factory) -> Case:
    return make_case(tmp_path_factory.mktemp("gc-crash-dag"), "dag")


@pytest.fixture(scope="module")
def llm_case(tmp_path_factory) -> Case:
    pytest.importorskip("llm")
    return make_case(tmp_path_factory.mktemp("gc-crash-llm"), "llm")


@pytest.fixture(scope="module")
def llm_seen_case(tmp_path_factory) -> Case:
    pytest.importorskip("llm")
    return make_case(tmp_path_factory.mktemp("gc-crash-llm-seen"), "llm", seen_once=True)


def run_and_kill(path: Path, event: int, errors: Path, mode: str = "short") -> bool:
    """Start a gc, kill -9 it at its ``event``-th event; True if it was still running."""
    with errors.open("w") as stderr:
        alive, status = kill_at(GC, [str(path)], event, mode, stderr)
    assert status in (0, -9), f"gc failed by itself: {errors.read_text()}"
    return alive


def roll_back(path: Path) -> None:
    """Open the file read-write once, as the next llm or gc does: SQLite rolls
    back the transaction a kill cut short, if its journal is hot.

    (verify opens read-only and cannot do that itself: see
    test_verify_reads_a_database_left_by_a_gc_killed_while_committing.)
    """
    conn = sqlite3.connect(path)
    conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()
    conn.close()


@pytest.mark.parametrize(
    "case_name, seed",
    [("dag_case", s) for s in range(4)] + [("llm_case", s) for s in range(3)] + [("llm_seen_case", s) for s in range(3)],
)
def test_a_killed_gc_leaves_a_database_verify_passes_and_the_next_gc_finishes_the_job(
    request, tmp_path, case_name, seed
):
    case: Case = request.getfixturevalue(case_name)
    path = tmp_path / "gc.db"
    shutil.copyfile(case.path, path)
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]  # short transactions, or steps of long ones, by seed
    killed = 0
    # Kill it a few times, once anywhere and then among its writes; every
    # state in between must be whole, and hold everything a root reaches.
    for attempt in range(3):
        low = 1 if attempt == 0 else case.first_write[mode] - 1
        killed += run_and_kill(path, rng.randint(low, case.lines[mode]), tmp_path / "stderr", mode)
        roll_back(path)
        assert verify(path).problems == ()
        assert foreign_key_problems(path) == []
        if case.fmt == "dag":
            assert integrity(path) == []
        assert reachable_rows(path, case.fmt) == case.reachable
    assert killed, "no kill interrupted a running gc: the test proved nothing"
    # A shared row whose last reference a killed run deleted goes with the
    # next run, however long the grace period: nothing is left behind that
    # the start did not already leave unreferenced.
    gc(path, grace="14d")
    assert unreferenced(path) <= case.unreferenced
    assert verify(path).problems == ()
    gc_to_the_end(path)
    assert dump(path) == case.expected
    assert verify(path).problems == ()


# Kill the gc in its first transaction that deletes messages, once SQLite
# has begun to write the file (as COMMIT does, after syncing the journal):
# the journal is hot, and the next connection that may write rolls it back.
KILLED_COMMITTING = r"""
import contextlib, os, signal, sys
import dagsync.gc
import dagsync.transactions as g
inner = g.write_transaction
count = lambda conn: next(iter(conn.execute("SELECT count(*) FROM messages")))[0]
@contextlib.contextmanager
def dying(conn):
    with inner(conn):
        before = count(conn)
        yield
        if count(conn) < before:
            conn.cache_flush()
            os.kill(os.getpid(), signal.SIGKILL)
g.write_transaction = dying
dagsync.gc.gc(sys.argv[1], grace="0s")
"""


def test_a_gc_killed_while_committing_leaves_a_file_whose_rollback_is_whole_and_verify_says_so(tmp_path, dag_case):
    path = tmp_path / "gc.db"
    shutil.copyfile(dag_case.path, path)
    run = subprocess.run([sys.executable, "-c", KILLED_COMMITTING, str(path)], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr
    assert Path(f"{path}-journal").stat().st_size > 0
    # What the next llm or gc would find, once it had rolled the journal back: all well.
    rolled_back = tmp_path / "rolled-back.db"
    shutil.copyfile(path, rolled_back)
    shutil.copyfile(f"{path}-journal", f"{rolled_back}-journal")
    roll_back(rolled_back)
    assert verify(rolled_back).problems == ()
    assert reachable_rows(rolled_back, "dag") == dag_case.reachable
    # verify, read-only, cannot roll the journal back itself: it says what to do.
    with pytest.raises(NotADatabase) as info:
        verify(path)
    assert str(info.value) == (
        f"{path} has an unfinished transaction in gc.db-journal (a process stopped while writing it); "
        "a read-only open cannot roll that back: open the file read-write once "
        f"(for example: sqlite3 '{path}' 'PRAGMA quick_check'), then try again"
    )
    roll_back(path)
    assert verify(path).problems == ()
