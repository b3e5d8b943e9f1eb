"""Forks llm can use: two machines continue one thread, and llm 0.36 itself
works with what a merge or a sync makes of it.

A laptop and a server start from one history and each continues its copy of
the same thread; the server's prompt comes last. After a merge, in either
direction, the thread continues the server's branch and a fork thread holds
the laptop's: ``llm logs --cid`` lists each branch's turns, ``llm --cid FORK``
continues the laptop's branch, ``LogStore.verify()`` is ``[]``. Either
direction gives the same threads and turns, and ``sync`` converges: a second
sync writes nothing, and neither does one after more prompts on both sides
and another sync.
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


def dagsync(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "dagsync", *args, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def logged(home: Path, thread: str) -> list[str]:
    """The prompts ``llm logs --cid`` lists for a thread, oldest first."""
    return [r["prompt"] for r in json.loads(llm(home, "logs", "list", "--cid", thread, "--json", "-n", "0"))]


THREADS = "SELECT id, name, tip_message_hash, forked_from FROM threads ORDER BY id"
TURNS = "SELECT id, thread_id, parent_message_hash, tip_message_hash FROM turns ORDER BY id"


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> tuple[Path, Path, str]:
    """Homes ``laptop`` and ``server``; the thread both continued."""
    root = tmp_path_factory.mktemp("forks")
    shared = root / "shared"
    llm(shared, "-m", "echo", "-s", "You are terse.", "the shared opening")
    llm(shared, "-m", "echo", "-c", "the shared second turn")
    (thread,) = [t for (t,) in rows(shared / "logs.db", "SELECT id FROM threads")]
    laptop, server = root / "laptop", root / "server"
    for home in (laptop, server):
        shutil.copytree(shared, home)
    llm(laptop, "-m", "echo", "-c", "the laptop carries on about the alpaca")
    llm(server, "-m", "echo", "-c", "the server carries on about the zeppelin")  # the later one
    return laptop, server, thread


def merged_into(tmp_path: Path, target_home: Path, source_home: Path) -> Path:
    home = tmp_path / target_home.name
    shutil.copytree(target_home, home)
    dagsync("merge", str(home), str(source_home))
    return home


@pytest.mark.parametrize("direction", ["server into laptop", "laptop into server"])
def test_each_branch_is_a_thread_llm_lists_and_continues(tmp_path, machines, direction):
    laptop, server, thread = machines
    target, source = (laptop, server) if direction == "server into laptop" else (server, laptop)
    home = merged_into(tmp_path, target, source)
    db = home / "logs.db"
    ((fork, name, forked_from),) = rows(db, "SELECT id, name, forked_from FROM threads WHERE forked_from IS NOT NULL")
    assert forked_from == thread and name.endswith(" (branch from laptop)")
    # The original continues the branch continued last (the server's); the fork holds the laptop's.
    assert logged(home, thread) == ["the shared opening", "the shared second turn", "the server carries on about the zeppelin"]
    assert logged(home, fork) == ["the laptop carries on about the alpaca"]
    # llm continues the fork: the new turn lands on it, after the laptop's branch.
    llm(home, "-m", "echo", "--cid", fork, "the laptop's branch goes on")
    assert logged(home, fork) == ["the laptop carries on about the alpaca", "the laptop's branch goes on"]
    store = LogStore(sqlite_utils.Database(db))
    assert store.verify() == []
    chain = store.load_chain(store.thread_tip(fork))
    assert len(chain) == 9  # the system prompt, and user and assistant for each of four prompts on this branch
    said = " ".join(getattr(p, "text", "") for m in chain for p in m.parts)
    assert "alpaca" in said and "zeppelin" not in said
    # And -c still continues the newest thread the user had, not the fork.
    assert fork < thread


def test_either_direction_gives_the_same_threads_and_turns(tmp_path, machines):
    laptop, server, _ = machines
    one = merged_into(tmp_path / "one", laptop, server) / "logs.db"
    other = merged_into(tmp_path / "other", server, laptop) / "logs.db"
    assert rows(one, THREADS) == rows(other, THREADS)
    assert rows(one, TURNS) == rows(other, TURNS)


def written(report: dict) -> int:
    legs = [report["into_a"], report["into_b"], *([report["settle"]] if report["settle"] else [])]
    return sum(
        t["added"] + t["updated"] + t["forked"] for leg in legs for s in leg["sources"] for t in s["tables"]
    )


def test_sync_converges_and_stays_converged(tmp_path, machines):
    laptop, server, thread = machines
    a, b = tmp_path / "laptop", tmp_path / "server"
    shutil.copytree(laptop, a)
    shutil.copytree(server, b)
    first = dagsync("sync", str(a), str(b))
    assert written(first) > 0
    for sql in (THREADS, TURNS):
        assert rows(a / "logs.db", sql) == rows(b / "logs.db", sql)
    assert written(dagsync("sync", str(a), str(b))) == 0
    # More prompts on both sides: the laptop on its branch (now the fork), the server on the thread.
    ((fork,),) = rows(a / "logs.db", "SELECT id FROM threads WHERE forked_from IS NOT NULL")
    llm(a, "-m", "echo", "--cid", fork, "the laptop, after the sync")
    llm(b, "-m", "echo", "--cid", thread, "the server, after the sync")
    assert written(dagsync("sync", str(a), str(b))) > 0
    for sql in (THREADS, TURNS):
        assert rows(a / "logs.db", sql) == rows(b / "logs.db", sql)
    assert written(dagsync("sync", str(a), str(b))) == 0
    for home in (a, b):
        assert LogStore(sqlite_utils.Database(home / "logs.db")).verify() == []
        assert logged(home, fork)[-1] == "the laptop, after the sync"
        assert logged(home, thread)[-1] == "the server, after the sync"


def fork_names(db: Path) -> list[str]:
    return [n for (n,) in rows(db, "SELECT name FROM threads WHERE forked_from IS NOT NULL ORDER BY id")]


def test_a_branch_a_merge_brought_keeps_the_name_of_the_machine_it_came_from(tmp_path, machines):
    laptop, server, thread = machines
    # A hub made from the laptop: the laptop's branch is the hub's head, and it is the laptop's.
    hub = tmp_path / "hub"
    hub.mkdir()
    dagsync("merge", str(hub / "logs.db"), str(laptop))
    dagsync("merge", str(hub), str(server))  # the server's branch is the later: the laptop's moves to a fork
    assert fork_names(hub / "logs.db") == ["the shared opening (branch from laptop)"]
    # Carried on: a desktop (a copy of the server) merging the hub names the laptop, not the hub.
    desktop = tmp_path / "desktop"
    shutil.copytree(server, desktop)
    other_hub = tmp_path / "other-hub"
    other_hub.mkdir()
    dagsync("merge", str(other_hub / "logs.db"), str(laptop))
    dagsync("merge", str(desktop), str(other_hub))
    assert fork_names(desktop / "logs.db") == ["the shared opening (branch from laptop)"]


def test_a_branch_continued_where_a_merge_brought_it_is_that_machines_own(tmp_path, machines):
    laptop, server, thread = machines
    hub = tmp_path / "hub"
    hub.mkdir()
    dagsync("merge", str(hub / "logs.db"), str(laptop))
    llm(hub, "-m", "echo", "--cid", thread, "the hub carries on the laptop's branch")
    later = tmp_path / "server"
    shutil.copytree(server, later)
    llm(later, "-m", "echo", "--cid", thread, "the server, later still")
    dagsync("merge", str(hub), str(later))
    assert fork_names(hub / "logs.db") == ["the shared opening (branch from hub)"]
    assert logged(hub, thread)[-1] == "the server, later still"


def test_sync_labels_name_each_files_branches(tmp_path, machines):
    laptop, server, thread = machines
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(laptop, a)
    shutil.copytree(server, b)
    report = dagsync("sync", str(a), str(b), "--label-a", "work laptop", "--label-b", "home server")
    # B into A forks the laptop's branch; A into B then copies that fork row as it is.
    assert [f["name"] for leg in ("into_a", "into_b") for s in report[leg]["sources"] for f in s["forks"]] == [
        "the shared opening (branch from work laptop)",
    ]
    assert fork_names(a / "logs.db") == fork_names(b / "logs.db") == ["the shared opening (branch from work laptop)"]


def test_a_branch_forked_at_two_points_on_two_paths_merges_and_converges(tmp_path, machines):
    """Laptop, server and desktop: a hub forks the laptop's branch, the laptop
    goes on, and a desktop gets the laptop directly and the hub as well. The
    same branch then sits on the thread in one file and on a fork in the
    other: the merge goes through, and a sync of the two converges."""
    laptop, server, thread = machines
    hub, desk, lap = tmp_path / "hub", tmp_path / "desk", tmp_path / "laptop"
    for home, copy_of in ((hub, server), (desk, server), (lap, laptop)):
        shutil.copytree(copy_of, home)
    dagsync("merge", str(hub), str(lap))  # the laptop's branch moves to a fork in the hub
    llm(lap, "-m", "echo", "-c", "the laptop goes on about the alpaca")  # on the thread, in its own file
    dagsync("merge", str(desk), str(lap))
    dagsync("merge", str(desk), str(hub))
    report = dagsync("sync", str(hub), str(desk))
    assert written(report) > 0
    for sql in (THREADS, TURNS):
        assert rows(hub / "logs.db", sql) == rows(desk / "logs.db", sql)
    # The report names each fork as its row is named (a row that arrived keeps its name).
    named = dict(rows(hub / "logs.db", "SELECT id, name FROM threads"))
    assert [(f["fork"], f["name"]) for f in report["into_a"]["sources"][0]["forks"]] == [
        (f["fork"], named[f["fork"]]) for f in report["into_a"]["sources"][0]["forks"]
    ] != []
    assert written(dagsync("sync", str(hub), str(desk))) == 0
    for home in (hub, desk):
        assert LogStore(sqlite_utils.Database(home / "logs.db")).verify() == []
        # The laptop's branch was continued last: the thread holds it, whole.
        assert logged(home, thread)[2:] == ["the laptop carries on about the alpaca", "the laptop goes on about the alpaca"]
        (server_fork,) = [
            f for (f,) in rows(home / "logs.db", "SELECT id FROM threads WHERE forked_from IS NOT NULL")
            if logged(home, f) == ["the server carries on about the zeppelin"]
        ]
        llm(home, "-m", "echo", "--cid", server_fork, "the server's branch goes on")


def test_a_branch_a_hub_forked_and_a_desktop_forked_later_is_one_fork(tmp_path, machines):
    """The same as above, but the server goes on after the laptop: the laptop's
    branch is a fork everywhere, forked at its first turn in the hub and at
    its second in the desktop. A fork is keyed by where its branch begins, so
    both files made the same fork row: it holds both of the laptop's turns,
    and llm continues it."""
    laptop, server, thread = machines
    hub, desk, lap, srv = (tmp_path / n for n in ("hub", "desk", "laptop", "server"))
    for home, copy_of in ((hub, server), (lap, laptop), (srv, server)):
        shutil.copytree(copy_of, home)
    dagsync("merge", str(hub), str(lap))
    llm(lap, "-m", "echo", "-c", "the laptop goes on about the alpaca")
    llm(srv, "-m", "echo", "-c", "the server goes on about the zeppelin")  # the later one
    shutil.copytree(srv, desk)
    dagsync("merge", str(desk), str(lap))
    dagsync("merge", str(desk), str(hub))
    dagsync("sync", str(hub), str(desk))
    for sql in (THREADS, TURNS):
        assert rows(hub / "logs.db", sql) == rows(desk / "logs.db", sql)
    assert written(dagsync("sync", str(hub), str(desk))) == 0
    alpaca = ["the laptop carries on about the alpaca", "the laptop goes on about the alpaca"]
    for home in (hub, desk):
        assert LogStore(sqlite_utils.Database(home / "logs.db")).verify() == []
        assert logged(home, thread)[2:] == ["the server carries on about the zeppelin", "the server goes on about the zeppelin"]
        ((fork,),) = rows(home / "logs.db", "SELECT id FROM threads WHERE forked_from IS NOT NULL")
        assert logged(home, fork) == alpaca
        llm(home, "-m", "echo", "--cid", fork, "and on")
        assert logged(home, fork) == [*alpaca, "and on"]
