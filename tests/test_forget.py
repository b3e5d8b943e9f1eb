"""forget: selected conversations go, with exactly what nothing else reaches; shared prefixes stay.

Real llm 0.36 (llm-echo) files for the llm format, MessageStore files for the dag format.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dagsync.forget import Selector, forget, restore
from dagsync.formats.dag import ROOT
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore
from dagsync.verify import verify

pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402


def llm(home: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llm", *args],
        env={**os.environ, "LLM_USER_PATH": str(home)}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def dagsync(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dagsync", *args], capture_output=True, text=True, input=stdin)


def logs(home: Path) -> list[dict]:
    return json.loads(llm(home, "logs", "list", "--json", "-n", "0"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """Three threads: A and C share their first prompt (one message row), B stands alone."""
    llm(tmp_path, "-m", "echo", "-s", "shared system", "shared first prompt")
    llm(tmp_path, "-m", "echo", "-c", "a follow-up only thread A has")
    llm(tmp_path, "-m", "echo", "an unrelated banana question")
    llm(tmp_path, "-m", "echo", "-s", "shared system", "shared first prompt")
    return tmp_path


def thread_of(home: Path, prompt: str) -> str:
    return next(r["conversation_id"] for r in logs(home) if r["prompt"] == prompt)


def messages(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {h for (h,) in conn.execute("SELECT hash FROM messages")}


def test_forgetting_a_thread_keeps_the_prefix_another_thread_shares(home: Path):
    db = home / "logs.db"
    a = thread_of(home, "a follow-up only thread A has")
    before = logs(home)
    report = forget(db, Selector(ids=(a,)))
    assert [c.id for c in report.conversations] == [a]
    after = logs(home)
    assert [r["id"] for r in after] == [r["id"] for r in before if r["conversation_id"] != a]
    assert all(r == next(b for b in before if b["id"] == r["id"]) for r in after)  # every other one, unchanged
    assert report.shared_messages >= 1  # the shared first prompt stays
    assert LogStore(sqlite_utils.Database(db)).verify() == []
    assert verify(db).problems == ()
    store = LogStore(sqlite_utils.Database(db))
    for thread in {r["conversation_id"] for r in after}:
        assert store.thread_messages(thread)  # loads whole
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM turns WHERE thread_id = ?", (a,)).fetchone() == (0,)
        assert conn.execute("SELECT key FROM _dagsync_forgotten").fetchall() == [(a,)]


def test_a_word_only_forgotten_conversations_held_is_no_longer_found(home: Path):
    db = home / "logs.db"
    assert "banana" in llm(home, "logs", "-q", "banana")
    report = forget(db, Selector(queries=("banana",)))
    assert len(report.conversations) == 1
    assert "banana" not in llm(home, "logs", "-q", "banana")
    assert "shared first prompt" in llm(home, "logs", "-q", "shared")
    assert verify(db).problems == ()


def test_forget_deletes_exactly_what_only_the_forgotten_thread_reached(home: Path):
    db = home / "logs.db"
    b = thread_of(home, "an unrelated banana question")
    with sqlite3.connect(db) as conn:
        tip = conn.execute("SELECT tip_message_hash FROM threads WHERE id = ?", (b,)).fetchone()[0]
        chain = set()
        while tip is not None:
            chain.add(tip)
            tip = conn.execute("SELECT parent_hash FROM messages WHERE hash = ?", (tip,)).fetchone()[0]
        others = set()
        for (tip,) in conn.execute("SELECT tip_message_hash FROM threads WHERE id != ?", (b,)).fetchall() + conn.execute(
            "SELECT tip_message_hash FROM turns WHERE thread_id != ? UNION SELECT parent_message_hash FROM turns WHERE thread_id != ?",
            (b, b),
        ).fetchall():
            while tip is not None:
                others.add(tip)
                tip = conn.execute("SELECT parent_hash FROM messages WHERE hash = ?", (tip,)).fetchone()[0]
    before = messages(db)
    dry = forget(db, Selector(ids=(b,)), dry_run=True)
    assert messages(db) == before  # a dry run writes nothing
    report = forget(db, Selector(ids=(b,)))
    assert before - messages(db) == chain - others
    assert report.messages == dry.messages == len(chain - others)
    assert [(t.table, t.deleted) for t in report.tables] == [(t.table, t.deleted) for t in dry.tables]


def test_forget_is_idempotent(home: Path):
    db = home / "logs.db"
    b = thread_of(home, "an unrelated banana question")
    forget(db, Selector(ids=(b,)))
    snapshot = db.read_bytes()
    again = forget(db, Selector(ids=(b,)))
    assert again.deleted == 0 and again.conversations == ()
    assert db.read_bytes() == snapshot  # nothing to do writes nothing


def test_a_fork_a_merge_made_goes_with_its_thread_and_one_made_through_llm_stays(home: Path, tmp_path_factory):
    """The laptop and the server continue thread A differently; the merge keeps
    one branch on A and gives the other a fork thread. Forgetting A forgets both
    (the fork is A on the other machine). A fork made through llm's own API is a
    thread of its own: it stays, its forked_from naming a thread since forgotten,
    and every file still merges and verifies."""
    db = home / "logs.db"
    server = tmp_path_factory.mktemp("server")
    shutil.copyfile(db, server / "logs.db")
    a = thread_of(home, "a follow-up only thread A has")
    llm(home, "-m", "echo", "--cid", a, "the laptop goes on")
    llm(server, "-m", "echo", "--cid", a, "the server goes on")
    store = LogStore(sqlite_utils.Database(db))
    own = store.fork(store.thread_tip(thread_of(home, "an unrelated banana question")), name="mine", forked_from=a)
    merge(db, [server / "logs.db"])
    with sqlite3.connect(db) as conn:
        ((branch,),) = conn.execute("SELECT fork_key FROM _dagsync_forks").fetchall()
    assert branch in {r["conversation_id"] for r in logs(home)}

    report = forget(db, Selector(ids=(a,)))
    assert {c.id for c in report.conversations} == {a, branch}
    left = {r["conversation_id"] for r in logs(home)}
    assert a not in left and branch not in left
    assert "goes on" not in json.dumps(logs(home))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT forked_from FROM threads WHERE id = ?", (own,)).fetchone() == (a,)
        assert conn.execute("SELECT key FROM _dagsync_forgotten").fetchall() == [(a,)]  # the fork goes with it
    assert verify(db).problems == ()
    assert LogStore(sqlite_utils.Database(db)).verify() == []
    fresh = tmp_path_factory.mktemp("fresh") / "logs.db"
    merge(fresh, [db])  # the dangling forked_from resolves as forgotten
    merge(server / "logs.db", [db])  # and the server forgets A and its branch too
    for path in (fresh, server / "logs.db"):
        with sqlite3.connect(path) as conn:
            assert not {a, branch} & {t for (t,) in conn.execute("SELECT id FROM threads")}
            assert conn.execute("SELECT count(*) FROM threads WHERE id = ?", (own,)).fetchone() == (1,)
        assert verify(path).problems == ()


def test_dag_format_forget_keeps_the_shared_prefix(tmp_path: Path):
    path = tmp_path / "dag.db"
    shared = [Message(role="system", parts=[TextPart(text="be brief")]), Message(role="user", parts=[TextPart(text="hello")])]
    with MessageStore.open(path) as store:
        prefix = store.save_chain(shared)
        a_head = store.save_chain([Message(role="assistant", parts=[TextPart(text="only in A")])], starting_parent_id=prefix)
        b_head = store.save_chain([Message(role="assistant", parts=[TextPart(text="only in B")])], starting_parent_id=prefix)
        a = store.start_conversation("A", "echo", a_head)
        b = store.start_conversation("B", "echo", b_head)
    report = forget(path, Selector(ids=(a,)))
    assert report.messages == 1 and report.shared_messages == 2
    with MessageStore.open(path) as store:
        assert [m.parts[0].text for m in store.load_chain(store.conversation_head(b))] == ["be brief", "hello", "only in B"]
    assert verify(path).problems == ()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM messages WHERE id != ?", (ROOT,)).fetchone() == (3,)


def test_restore_lifts_the_tombstone(home: Path):
    db = home / "logs.db"
    b = thread_of(home, "an unrelated banana question")
    forget(db, Selector(ids=(b,)))
    report = restore(db, (b,))
    assert report.restored == (b,) and report.tombstones == 0


# -- the command line ------------------------------------------------------------


def test_cli_forget_dry_run_json_and_yes(home: Path):
    db = home / "logs.db"
    dry = dagsync("forget", str(db), "-q", "banana", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["dry_run"] is True
    asked = dagsync("forget", str(db), "-q", "banana", stdin="")
    assert asked.returncode == 2
    assert "give --yes to delete without being asked (or --dry-run to see what would go)" in asked.stderr
    done = dagsync("forget", str(db), "-q", "banana", "--yes", "--quiet")
    assert (done.returncode, done.stdout) == (0, "")
    assert "banana" not in llm(home, "logs", "-q", "banana")
    through_llm = llm(home, "dagsync", "forget", "--older-than", "3650d", "--yes")
    assert "forgot 0 conversation(s)" in through_llm


def test_cli_forget_errors(home: Path):
    db = home / "logs.db"
    none = dagsync("forget", str(db))
    assert none.returncode == 1
    assert none.stderr.strip() == (
        "Error: nothing selected: give --id, --before, --older-than, --model or --query (they combine with AND)"
    )
    bad = dagsync("forget", str(db), "--before", "last tuesday", "--yes")
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "Error: invalid date 'last tuesday': give a day (2026-01-31) or a time (2026-01-31T12:00:00), in UTC"
    )
    unknown = dagsync("forget", str(db), "--restore", "nope")
    assert unknown.returncode == 1
    assert "keeps no forgotten conversation 'nope'" in unknown.stderr
    assert dagsync("forget", "--help").returncode == 0


def test_a_merge_does_not_bring_a_forgotten_conversation_back_and_sync_carries_the_forget(home: Path, tmp_path_factory):
    from dagsync.sync import sync

    work = tmp_path_factory.mktemp("m")
    laptop, server = work / "laptop.db", work / "server.db"
    laptop.write_bytes((home / "logs.db").read_bytes())
    server.write_bytes((home / "logs.db").read_bytes())
    b = thread_of(home, "an unrelated banana question")
    forget(server, Selector(ids=(b,)))
    report = merge(server, [laptop])
    assert report.sources[0].forgotten > 0  # it came with the laptop's file, and went again
    with sqlite3.connect(server) as conn:
        assert conn.execute("SELECT count(*) FROM turns WHERE thread_id = ?", (b,)).fetchone() == (0,)
    sync(laptop, server)
    for path in (laptop, server):
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT count(*) FROM threads WHERE id = ?", (b,)).fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM turn_search WHERE turn_id IN (SELECT id FROM turns WHERE thread_id = ?)", (b,)).fetchone() == (0,)
        assert verify(path).problems == ()
    # Restored on one side, and merged whole: it comes back, and stays.
    restore(server, (b,))
    source = work / "original.db"
    source.write_bytes((home / "logs.db").read_bytes())
    merge(server, [source], full=True)
    with sqlite3.connect(server) as conn:
        assert conn.execute("SELECT count(*) FROM threads WHERE id = ?", (b,)).fetchone() == (1,)


def test_a_bundle_carries_the_forget_to_the_other_machine(home: Path, tmp_path_factory):

    work = tmp_path_factory.mktemp("b")
    laptop, server = work / "laptop.db", work / "server.db"
    laptop.write_bytes((home / "logs.db").read_bytes())
    merge(server, [laptop])
    marks = dagsync("marks", "--json", str(server))
    assert marks.returncode == 0, marks.stderr
    (work / "marks.json").write_text(marks.stdout)
    b = thread_of(home, "an unrelated banana question")
    forget(laptop, Selector(ids=(b,)))
    out = work / "bundle.db"
    made = dagsync("bundle", str(laptop), str(out), "--marks", str(work / "marks.json"))
    assert made.returncode == 0, made.stderr
    report = merge(server, [out])
    assert report.sources[0].forgotten > 0
    with sqlite3.connect(server) as conn:
        assert conn.execute("SELECT count(*) FROM threads WHERE id = ?", (b,)).fetchone() == (0,)
        assert conn.execute("SELECT key FROM _dagsync_forgotten").fetchall() == [(b,)]
    assert verify(server).problems == ()


def _many(path: Path, n: int) -> None:
    """``n`` dag-format conversations, half of model 'old', sharing a system prompt."""
    with MessageStore.open(path) as store:
        system = store.save_chain([Message(role="system", parts=[TextPart(text="be brief")])])
        with store.transaction():
            for i in range(n):
                head = store.save_chain(
                    [Message(role="user", parts=[TextPart(text=f"question {i}")]),
                     Message(role="assistant", parts=[TextPart(text=f"answer {i}")])],
                    starting_parent_id=system,
                )  # fmt: skip
                store.start_conversation(f"c{i}", "old" if i % 2 else "new", head)


def _content(path: Path) -> tuple:
    with sqlite3.connect(path) as conn:
        return (
            sorted(conn.execute("SELECT id, parent_id, content_hash FROM messages")),
            sorted(conn.execute("SELECT id, name, model, head_message_id FROM conversations")),
            sorted(conn.execute('SELECT message_id, "order", content FROM message_parts')),
            sorted(conn.execute("SELECT key FROM _dagsync_forgotten")),
        )


def test_kill_9_during_forget_leaves_a_file_verify_passes_and_a_rerun_finishes(tmp_path: Path):
    import random
    import time as clock

    original = tmp_path / "original.db"
    _many(original, 15000)
    clean = tmp_path / "clean.db"
    clean.write_bytes(original.read_bytes())
    forget(clean, Selector(models=("old",)))
    expected = _content(clean)
    rng = random.Random(6)
    for round_ in range(6):
        path = tmp_path / f"killed-{round_}.db"
        path.write_bytes(original.read_bytes())
        proc = subprocess.Popen(
            [sys.executable, "-m", "dagsync", "forget", str(path), "--model", "old", "--yes", "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        clock.sleep(rng.uniform(0.15, 0.5))
        proc.kill()
        proc.wait()
        for suffix in ("-journal",):
            # The next read-write open rolls a cut-short transaction back; verify is read-only.
            if Path(f"{path}{suffix}").exists():
                sqlite3.connect(path).execute("SELECT count(*) FROM messages").fetchone()
        assert verify(path).problems == ()
        forget(path, Selector(models=("old",)))
        assert _content(path) == expected
        assert verify(path).problems == ()
