"""A forget keeps the marks: the next merges of a source that still holds a
forgotten conversation read only what is new, and the one that finds a new row
referring to what the forget removed reads that source whole (merge.forgotten_below).

Real llm 0.36 (llm-echo) files; push and pull over the real sshd (tests/sshd.py).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from dagsync.bundle import make
from dagsync.errors import DagsyncError
from dagsync.forget import Selector, forget, restore
from dagsync.merge import merge
from dagsync.verify import verify
from tests.sshd import server  # noqa: F401  (the fixture)
from tests.test_forget import LogStore, dagsync, home, llm, logs, sqlite_utils, thread_of  # noqa: F401

FELL_BACK = "a row beyond the marks refers to what a forget removed from the target"


@pytest.fixture
def pair(home: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """llm's own file (the laptop), a server that merged it and then forgot the banana thread."""
    server = tmp_path / "server.db"
    merge(server, [home / "logs.db"])
    banana = thread_of(home, "an unrelated banana question")
    forget(server, Selector(ids=(banana,)))
    return home / "logs.db", server, banana


def threads(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {t for (t,) in conn.execute("SELECT id FROM threads")}


def prompts(home: Path, db: Path) -> list[str]:
    return [r["prompt"] for r in json.loads(llm(home, "logs", "list", "--json", "-n", "0", "-d", str(db)))]


def content(home: Path, db: Path) -> tuple:
    """What llm shows of ``db``, its threads' tips and its messages."""
    shown = sorted((r["id"], r["prompt"], r["response"]) for r in json.loads(llm(home, "logs", "list", "--json", "-n", "0", "-d", str(db))))
    with sqlite3.connect(db) as conn:
        tips = sorted(conn.execute("SELECT id, tip_message_hash FROM threads"))
        hashes = sorted(conn.execute("SELECT hash, parent_hash FROM messages"))
    return shown, tips, hashes


def check(home: Path, db: Path) -> None:
    """llm's own check and ours pass, and every thread loads whole."""
    store = LogStore(sqlite_utils.Database(db))
    assert store.verify() == []
    assert verify(db).problems == ()
    for thread in threads(db):
        assert store.thread_messages(thread)


def test_merges_after_a_forget_read_only_what_is_new(pair):
    laptop, server, banana = pair
    for _ in range(3):
        again = merge(server, [laptop]).sources[0]
        assert again.incremental and again.full_because is None
        assert again.forgotten == 0  # nothing of it was read, so nothing had to go again
    assert banana not in threads(server)


def test_a_forgotten_thread_continued_on_the_source_makes_one_full_merge_and_stays_forgotten(pair):
    laptop, server, banana = pair
    home = laptop.parent
    llm(home, "-m", "echo", "-c", "--cid", banana, "more about bananas")
    llm(home, "-m", "echo", "a new kiwi question")
    report = merge(server, [laptop]).sources[0]
    assert not report.incremental
    assert report.full_because is not None and report.full_because.startswith(FELL_BACK + " (message ")
    assert report.forgotten > 0
    assert banana not in threads(server)
    shown = prompts(home, server)
    assert "a new kiwi question" in shown
    assert not any("banana" in p for p in shown)
    check(home, server)
    # The marks now reach past the continuation: the next merges are incremental again.
    assert merge(server, [laptop]).sources[0].incremental
    # And the result is a full merge's: merged whole again, nothing changes.
    reference = server.parent / "reference.db"
    shutil.copyfile(server, reference)
    merge(reference, [laptop], full=True)
    assert content(home, reference) == content(home, server)


def test_a_new_thread_on_a_forgotten_prefix_comes_whole(pair):
    """The same first prompt again makes a thread whose first message is the forgotten
    thread's row (llm stores a message once, by its hash), which the server lost."""
    laptop, server, banana = pair
    home = laptop.parent
    llm(home, "-m", "echo", "an unrelated banana question")
    report = merge(server, [laptop]).sources[0]
    assert report.full_because is not None and report.full_because.startswith(FELL_BACK)
    assert banana not in threads(server)
    assert prompts(home, server).count("an unrelated banana question") == 1  # the new thread's
    assert "banana" in llm(home, "logs", "-q", "banana", "-d", str(server))
    check(home, server)


def test_a_source_that_never_forgot_still_refuses_a_reference_to_nothing(pair, tmp_path: Path):
    """Only a target that keeps tombstones reads a source whole for an unresolved reference."""
    laptop, _, _ = pair
    clean = tmp_path / "clean.db"
    merge(clean, [laptop])
    a = thread_of(laptop.parent, "a follow-up only thread A has")
    llm(laptop.parent, "-m", "echo", "-c", "--cid", a, "and one more")
    with sqlite3.connect(clean) as conn:  # lose, by hand, the message the new turn follows
        tip = conn.execute("SELECT tip_message_hash FROM threads WHERE id = ?", (a,)).fetchone()[0]
        conn.execute("DELETE FROM messages WHERE hash = ?", (tip,))
    with pytest.raises(DagsyncError) as refused:
        merge(clean, [laptop])
    assert "nothing was merged" in str(refused.value) and FELL_BACK not in str(refused.value)


def test_a_bundle_against_the_marks_is_refused_whole_and_a_whole_one_merges(pair, tmp_path: Path):
    laptop, server, banana = pair
    home = laptop.parent
    llm(home, "-m", "echo", "-c", "--cid", banana, "more about bananas")
    marks = dagsync("marks", "--json", str(server))
    assert marks.returncode == 0, marks.stderr
    (tmp_path / "marks.json").write_text(marks.stdout)
    thin = tmp_path / "thin.db"
    made = dagsync("bundle", str(laptop), str(thin), "--marks", str(tmp_path / "marks.json"))
    assert made.returncode == 0, made.stderr
    before = server.read_bytes()
    refused = dagsync("merge", str(server), str(thin))
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert line.startswith(f"Error: {thin}: ") and "\n" not in line
    assert line.endswith(
        f", which {server} no longer has: a forget there removed it, and a bundle made against the marks "
        "leaves it out; nothing was merged - make the bundle again without --marks (the whole source)"
    )
    assert server.read_bytes() == before
    whole = tmp_path / "whole.db"
    assert dagsync("bundle", str(laptop), str(whole)).returncode == 0
    report = merge(server, [whole]).sources[0]
    assert report.forgotten > 0
    assert banana not in threads(server)
    check(home, server)


def test_a_restore_makes_the_next_merge_read_the_source_whole_and_bring_it_back(pair):
    laptop, server, banana = pair
    restore(server, (banana,))
    report = merge(server, [laptop]).sources[0]
    assert not report.incremental and "restore at" in (report.full_because or "")
    assert banana in threads(server)
    assert merge(server, [laptop]).sources[0].incremental


def test_a_restore_that_arrives_by_merge_brings_the_conversation_back_too(pair, tmp_path: Path):
    laptop, server, banana = pair
    other = tmp_path / "other.db"
    shutil.copyfile(server, other)  # a second machine that had the forget too
    restore(other, (banana,))
    merge(server, [other])  # the restore travels; what the forget removed is still gone here ...
    assert banana not in threads(server)
    report = merge(server, [laptop]).sources[0]  # ... until the next merge of a file that has it
    assert not report.incremental and "restore at" in (report.full_because or "")
    assert banana in threads(server)


# -- over ssh ------------------------------------------------------------------------------


def test_push_sends_the_whole_source_when_the_far_side_forgot_what_new_rows_refer_to(pair, server):
    from dagsync.remote import Remote, Transport, push

    laptop, hub, banana = pair
    home = laptop.parent
    transport = Transport(server.rsh, server.remote_dagsync)
    remote = Remote(server.host, str(hub))
    first = push(laptop, remote, transport)  # nothing new: thin, and nothing of the forgotten thread
    assert first.why_whole is None and first.against is not None
    llm(home, "-m", "echo", "-c", "--cid", banana, "more about bananas")
    llm(home, "-m", "echo", "a new kiwi question")
    second = push(laptop, remote, transport)
    assert (second.against, second.why_whole) == (None, "the target forgot rows that new ones refer to")
    assert banana not in threads(hub)
    assert "a new kiwi question" in prompts(home, hub)
    check(home, hub)
    third = push(laptop, remote, transport)
    assert third.why_whole is None and third.written == 0


def test_pull_fetches_the_whole_source_when_this_side_forgot_what_new_rows_refer_to(pair, server):
    from dagsync.remote import Remote, Transport, pull

    laptop, desktop, banana = pair
    home = laptop.parent
    transport = Transport(server.rsh, server.remote_dagsync)
    assert pull(Remote(server.host, str(laptop)), desktop, transport).why_whole is None
    llm(home, "-m", "echo", "an unrelated banana question")
    got = pull(Remote(server.host, str(laptop)), desktop, transport)
    assert got.why_whole == "the target forgot rows that new ones refer to"
    assert banana not in threads(desktop)
    assert prompts(home, desktop).count("an unrelated banana question") == 1
    check(home, desktop)


def test_make_takes_the_request_for_the_whole_source(pair, tmp_path: Path):
    laptop, server, _ = pair
    from dagsync.bundle import marks_of

    held = marks_of(server)
    assert make(laptop, held, tmp_path / "thin.db").against is not None
    whole = make(laptop, {**held, "whole_because": "asked"}, tmp_path / "whole.db")
    assert (whole.against, whole.why_whole) == (None, "asked")
