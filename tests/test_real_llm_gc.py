"""gc on a logs.db written by the real llm CLI (with the offline llm-echo model).

A user deletes some threads by hand, with SQL, the way one would: the thread
rows, their turns, and the rows that reference those turns. That leaves their
messages, parts, fragments, attachments and tools behind, unreachable. Then
``dagsync gc`` runs twice through the real CLI: the first, with a grace
period of an hour, only records when it first saw the unreachable messages
(llm's messages carry no time); the second, with ``--grace 0s``, deletes them
and what only they used. llm must then still
list, load, verify and continue every remaining thread.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

llm = pytest.importorskip("llm")
sqlite_utils = pytest.importorskip("sqlite_utils")
from llm.logs import LogStore  # noqa: E402

from tests.test_real_llm_merge import cli as llm_cli  # noqa: E402
from tests.test_real_llm_merge import png  # noqa: E402


def tool_call(name: str) -> str:
    """An echo prompt that makes the model call a tool."""
    return json.dumps({"tool_calls": [{"name": name}]})


def dagsync_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dagsync", *args], capture_output=True, text=True)


def listed(db: Path) -> dict[str, dict]:
    """``llm logs list --json -n 0``, by turn id."""
    out = json.loads(llm_cli(db.parent, "logs", "list", "--json", "-n", "0", "-d", str(db)))
    return {r["id"]: r for r in out}


def query(db: Path, sql: str, params=()) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def column(db: Path, sql: str, params=()) -> set:
    return {row[0] for row in query(db, sql, params)}


REACHABLE = (
    "WITH RECURSIVE up(hash) AS ("
    " SELECT tip_message_hash FROM threads"
    " UNION SELECT tip_message_hash FROM turns UNION SELECT parent_message_hash FROM turns"
    " UNION SELECT m.parent_hash FROM messages m JOIN up ON m.hash = up.hash"
    ") SELECT m.hash FROM messages m JOIN up USING (hash)"
)


def messages_mentioning(db: Path, word: str) -> set[str]:
    """Messages whose own parts (text or payload) contain ``word``."""
    return column(
        db,
        "SELECT message_hash FROM parts WHERE instr(coalesce(text, ''), ?) OR instr(coalesce(payload, ''), ?)",
        (word, word),
    )


def delete_threads_by_hand(db: Path, thread_ids: list[str]) -> None:
    """What a user would do in the sqlite3 shell: the threads, their turns, and what points at those turns."""
    marks = ",".join("?" * len(thread_ids))
    turns = f"SELECT id FROM turns WHERE thread_id IN ({marks})"
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA foreign_keys = ON")  # a slip in this SQL fails here, not in gc
        with conn:
            for table in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
                conn.execute(f"DELETE FROM {table} WHERE turn_id IN ({turns})", thread_ids)
            conn.execute(f"DELETE FROM turns WHERE thread_id IN ({marks})", thread_ids)
            conn.execute(f"UPDATE threads SET forked_from = NULL WHERE forked_from IN ({marks})", thread_ids)
            conn.execute(f"DELETE FROM threads WHERE id IN ({marks})", thread_ids)
    finally:
        conn.close()


def run_gc(db: Path, grace: str = "0s") -> dict:
    done = dagsync_cli("gc", str(db), "--grace", grace, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def deleted(report: dict, table: str) -> int:
    return next((t["deleted"] for t in report["tables"] if t["table"] == table), 0)


WORDS = ("zeppelin", "alpaca", "hello from the shared opening", "You are terse.")


@dataclass
class Scene:
    db: Path
    user_dir: Path
    threads: dict[str, str]  # label -> thread id
    gone: list[str]  # labels of the threads deleted by hand
    before: dict[str, dict]  # llm logs list before the deletion, by turn id
    gone_turns: set[str]
    messages_before: set[str]  # after the deletion, before gc
    reachable: set[str]  # after the deletion: what the remaining threads and turns reach
    fragments_before: dict[str, int]  # content -> id
    attachments_before: set[str]
    tools_before: dict[str, int]  # name -> id
    mentions: dict[str, set[str]]  # word -> the messages mentioning it, before gc
    first: dict  # the gc reports
    second: dict
    after_first: dict[str, set]  # fragments / attachments / tools / messages after the first run


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Scene:
    root = tmp_path_factory.mktemp("gc-llm")
    files = root / "files"
    files.mkdir()
    (files / "gone.txt").write_text("A fragment only a deleted thread used, about the narwhal.\n")
    (files / "shared.txt").write_text("A fragment a kept and a deleted thread both used, about the heron.\n")
    (files / "system.txt").write_text("A system fragment only a deleted thread used: speak like a pirate.\n")
    (files / "red.png").write_bytes(png(255, 0, 0))
    (files / "blue.png").write_bytes(png(0, 0, 255))

    user_dir = root / "llm"
    db = user_dir / "logs.db"
    threads: dict[str, str] = {}

    def prompt(label: str | None, *args: str) -> None:
        """One llm call; ``label`` names the thread it starts (None: it continues one)."""
        llm_cli(user_dir, "-m", "echo", *args)
        if label is not None:
            ((thread_id,),) = query(db, "SELECT thread_id FROM turns ORDER BY rowid DESC LIMIT 1")
            threads[label] = thread_id

    # Two threads with the same opening: its system, user and assistant messages are shared.
    prompt("kept-hello", "-s", "You are terse.", "hello from the shared opening")
    prompt(None, "-c", "the kept thread carries on about the alpaca")
    prompt("gone-hello", "-s", "You are terse.", "hello from the shared opening")
    prompt(None, "--cid", threads["gone-hello"], "the deleted thread carries on about the zeppelin")
    # Fragments: one only a deleted thread uses, one a kept and a deleted thread share, a system fragment.
    prompt("gone-fragment", "-f", str(files / "gone.txt"), "what does the narwhal fragment say")
    prompt("kept-shared-fragment", "-f", str(files / "shared.txt"), "the kept thread reads the heron fragment")
    prompt("gone-shared-fragment", "-f", str(files / "shared.txt"), "the deleted thread reads the heron fragment")
    prompt("gone-system-fragment", "--sf", str(files / "system.txt"), "a deleted thread with a pirate system fragment")
    # Attachments: red only in a deleted thread, blue in a kept and a deleted one.
    prompt("gone-red", "-a", str(files / "red.png"), "describe the red image")
    prompt("kept-blue", "-a", str(files / "blue.png"), "describe the blue image")
    prompt("gone-blue", "-a", str(files / "blue.png"), "describe the blue image once more")
    # Tools: llm_time only in a deleted thread, llm_version in a kept one.
    prompt("gone-tool", "-T", "llm_time", tool_call("llm_time"))
    prompt("kept-tool", "-T", "llm_version", tool_call("llm_version"))
    prompt("kept-thinking", "-o", "thinking", "1", "think about garbage collection")
    # A fork of a thread that is deleted later (llm's own API: the CLI has no fork command).
    store = LogStore(sqlite_utils.Database(db))
    shared_tip = store.thread_tip(threads["gone-hello"])
    ((opening_tip,),) = query(
        db, "SELECT tip_message_hash FROM turns WHERE thread_id = ? ORDER BY rowid LIMIT 1", (threads["gone-hello"],)
    )
    assert shared_tip != opening_tip
    threads["kept-fork"] = store.fork(opening_tip, name="a fork of the deleted thread", forked_from=threads["gone-hello"])
    store.db.conn.close()

    before = listed(db)
    gone = ["gone-hello", "gone-fragment", "gone-shared-fragment", "gone-system-fragment", "gone-red", "gone-blue", "gone-tool"]
    gone_ids = [threads[label] for label in gone]
    gone_turns = column(db, f"SELECT id FROM turns WHERE thread_id IN ({','.join('?' * len(gone_ids))})", gone_ids)
    delete_threads_by_hand(db, gone_ids)
    assert query(db, "PRAGMA foreign_key_check") == []

    def snapshot() -> dict[str, set]:
        return {
            "fragments": column(db, "SELECT content FROM fragments"),
            "attachments": column(db, "SELECT id FROM attachments"),
            "tools": column(db, "SELECT name FROM tools"),
            "messages": column(db, "SELECT hash FROM messages"),
        }

    messages_before = column(db, "SELECT hash FROM messages")
    reachable = column(db, REACHABLE)
    fragments_before = {content: fid for fid, content in query(db, "SELECT id, content FROM fragments")}
    attachments_before = column(db, "SELECT id FROM attachments")
    tools_before = {name: tid for tid, name in query(db, "SELECT id, name FROM tools")}
    mentions = {word: messages_mentioning(db, word) for word in WORDS}

    first = run_gc(db, "1h")
    after_first = snapshot()
    second = run_gc(db)
    return Scene(
        db=db, user_dir=user_dir, threads=threads, gone=gone, before=before, gone_turns=gone_turns,
        messages_before=messages_before, reachable=reachable, fragments_before=fragments_before,
        attachments_before=attachments_before, tools_before=tools_before, mentions=mentions,
        first=first, second=second, after_first=after_first,
    )  # fmt: skip


def fragment_content(scene: Scene, word: str) -> str:
    return next(c for c in scene.fragments_before if word in c)


def attachment_of(scene: Scene, label: str) -> str:
    """The attachment id the (deleted or kept) thread ``label`` used, from llm's own listing."""
    thread = scene.threads[label]
    (attachment,) = {a["id"] for r in scene.before.values() if r["conversation_id"] == thread for a in r["attachments"]}
    return attachment


def test_the_scene_is_what_it_claims(scene):
    # Some messages are shared between a kept and a deleted thread; some only deleted threads used.
    zeppelin, alpaca = scene.mentions["zeppelin"], scene.mentions["alpaca"]
    assert zeppelin and alpaca
    assert not zeppelin & scene.reachable and alpaca <= scene.reachable
    unreachable = scene.messages_before - scene.reachable
    assert len(unreachable) >= 10
    # The shared opening is reached only through the kept threads now.
    assert scene.mentions["hello from the shared opening"] <= scene.reachable
    assert scene.mentions["You are terse."] <= scene.reachable
    assert len({r["conversation_id"] for r in scene.before.values()}) == len(scene.threads) - 1  # the fork has no turn


def test_a_run_inside_the_grace_period_deletes_nothing_and_remembers_the_unreachable(scene):
    unreachable = len(scene.messages_before - scene.reachable)
    first = scene.first
    assert (first["format"], first["dry_run"], first["grace_seconds"]) == ("llm", False, 3600.0)
    assert first["unreachable"] == unreachable
    assert first["reachable"] == len(scene.reachable)
    # llm's messages carry no time: the grace clock starts now, so nothing goes yet.
    assert first["kept_by_grace"] == unreachable
    assert deleted(first, "messages") == 0
    assert first["deleted"] == 0
    assert scene.after_first["messages"] == scene.messages_before
    assert scene.after_first["fragments"] == set(scene.fragments_before)
    assert scene.after_first["attachments"] == scene.attachments_before
    assert scene.after_first["tools"] == set(scene.tools_before)


def test_the_second_run_deletes_exactly_the_unreachable_messages(scene):
    unreachable = scene.messages_before - scene.reachable
    second = scene.second
    assert second["unreachable"] == len(unreachable)
    assert second["kept_by_grace"] == 0
    assert deleted(second, "messages") == len(unreachable)
    assert column(scene.db, "SELECT hash FROM messages") == scene.reachable
    assert not messages_mentioning(scene.db, "zeppelin")
    assert messages_mentioning(scene.db, "alpaca") == scene.mentions["alpaca"]
    # Shared with a kept thread: kept.
    for word in ("hello from the shared opening", "You are terse."):
        assert messages_mentioning(scene.db, word) == scene.mentions[word]
    # The parts of deleted messages went with them.
    assert deleted(second, "parts") > 0
    assert query(scene.db, "SELECT count(*) FROM parts WHERE message_hash NOT IN (SELECT hash FROM messages)") == [(0,)]


def test_shared_rows_only_deleted_threads_used_are_gone(scene):
    fragments = column(scene.db, "SELECT content FROM fragments")
    assert fragment_content(scene, "narwhal") not in fragments
    assert fragment_content(scene, "pirate") not in fragments
    assert fragment_content(scene, "heron") in fragments
    attachments = column(scene.db, "SELECT id FROM attachments")
    red, blue = attachment_of(scene, "gone-red"), attachment_of(scene, "kept-blue")
    assert attachment_of(scene, "gone-blue") == blue
    assert red not in attachments and blue in attachments
    tools = column(scene.db, "SELECT name FROM tools")
    assert "llm_time" not in tools and "llm_version" in tools
    assert deleted(scene.second, "fragments") == 2
    assert deleted(scene.second, "attachments") == 1
    assert deleted(scene.second, "tools") == 1


def test_nothing_waits_after_the_second_run(scene):
    assert all(t["waiting"] == 0 for t in scene.second["tables"])
    assert query(scene.db, "SELECT count(*) FROM _dagsync_gc_seen") == [(0,)]


def test_llm_lists_every_remaining_turn_as_before(scene):
    after = listed(scene.db)
    assert set(after) == set(scene.before) - scene.gone_turns
    assert scene.gone_turns and set(after)
    for turn_id, row in after.items():
        assert (row["prompt"], row["response"]) == (scene.before[turn_id]["prompt"], scene.before[turn_id]["response"])
        # Everything llm shows of the turn: fragments, attachments, tools, reasoning ...
        assert row == scene.before[turn_id]


def test_llm_verifies_and_loads_every_remaining_thread(scene):
    store = LogStore(sqlite_utils.Database(scene.db))
    assert store.verify() == []
    for (tip,) in query(scene.db, "SELECT tip_message_hash FROM threads"):
        assert store.load_chain(tip)


def test_no_foreign_key_is_broken(scene):
    assert query(scene.db, "PRAGMA foreign_key_check") == []
    assert query(scene.db, "PRAGMA integrity_check") == [("ok",)]
    # The fork of a deleted thread survives, pointing nowhere.
    assert query(scene.db, "SELECT forked_from FROM threads WHERE id = ?", (scene.threads["kept-fork"],)) == [(None,)]


def test_dagsync_verify_passes(scene):
    done = dagsync_cli("verify", str(scene.db))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_third_run_deletes_nothing(tmp_path, scene):
    copy = tmp_path / "logs.db"
    shutil.copyfile(scene.db, copy)
    third = run_gc(copy)
    assert third["deleted"] == 0 and third["unreachable"] == 0


def test_llm_continues_a_remaining_thread_after_gc(tmp_path, scene):
    user_dir = tmp_path / "llm"
    user_dir.mkdir()
    db = user_dir / "logs.db"
    shutil.copyfile(scene.db, db)
    thread = scene.threads["kept-hello"]
    ((tip,),) = query(db, "SELECT tip_message_hash FROM threads WHERE id = ?", (thread,))
    out = llm_cli(user_dir, "-m", "echo", "--cid", thread, "the kept thread goes on after gc")
    assert "goes on after gc" in out
    ((parent, new_tip),) = query(
        db, "SELECT parent_message_hash, tip_message_hash FROM turns WHERE thread_id = ? ORDER BY rowid DESC LIMIT 1",
        (thread,),
    )  # fmt: skip
    assert query(db, "SELECT parent_hash FROM messages WHERE hash = ?", (parent,)) == [(tip,)]
    assert query(db, "SELECT tip_message_hash FROM threads WHERE id = ?", (thread,)) == [(new_tip,)]
    # A shared fragment gc kept is used again without being stored again.
    llm_cli(user_dir, "-m", "echo", "-f", str(Path(fragment_source(scene))), "the heron fragment once more")
    assert query(db, "SELECT count(*) FROM fragments WHERE instr(content, 'heron')") == [(1,)]
    assert LogStore(sqlite_utils.Database(db)).verify() == []
    assert query(db, "PRAGMA foreign_key_check") == []


def fragment_source(scene: Scene) -> str:
    ((source,),) = query(scene.db, "SELECT source FROM fragments WHERE instr(content, 'heron')")
    return source
