"""gc beside a live writer: a process that keeps storing chains and pointing
conversations (threads) at them a moment later, with a 5 s busy timeout and
no retry, never has a write fail and never loses anything it wrote, however
often gc runs meanwhile and however much it deletes.

(A merge into the same file is such a writer too, and is not yet safe beside
gc: see the expected failure at the end.)"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import apsw
import pytest

import dagsync.writer
from dagsync import bookkeeping
from dagsync.transactions import write_transaction
from dagsync.gc import gc
from dagsync.verify import verify
from fixtures import family, generate

# Writes the way llm does: Python's sqlite3 with its 5 s busy timeout and no
# retry of its own, each transaction a deferred BEGIN that reads first and
# then writes (llm's LogStore checks what is stored, then inserts). Any error
# ends it with a non-zero status. Each round it stores a chain and commits,
# sleeps (so gc runs while nothing points at the chain: only the grace period
# protects it), then points a conversation (thread) at the chain's tip in a
# second transaction. A chain is new (from the start), extends one of the
# writer's conversations, or branches from a message the test has just made
# unreachable - one the next gc will delete - if it is still there.
# It prints a line per round; it stops, after a whole round, when the stop
# file appears, and dumps what it wrote.
WRITER = r"""
import json, os, random, sqlite3, sys, time
from datetime import datetime, timezone

fmt, path, stop, pool_file, out, seed = sys.argv[1:7]
rng = random.Random(int(seed))
conn = sqlite3.connect(path, timeout=5.0, isolation_level=None)

# Where a failure happened, said after its traceback: a refusal at once
# after a read means another process held the write lock as this one began
# writing (SQLite does not wait then); one after 5 s, a lock held too long.
where = {}
def said(exc_type, exc, tb):
    import traceback
    traceback.print_exception(exc_type, exc, tb)
    if where:
        print(
            f"in round {where['round']} ({where['kind']}), transaction {where['transaction']}, "
            f"{time.monotonic() - where['began']:.3f} s after its BEGIN, "
            + ("after a read" if where["read"] else "no read before"),
            file=sys.stderr,
        )
sys.excepthook = said

if fmt == "dag":
    from dagsync.canonical import content_hash
    from dagsync.message import Message, TextPart
    from dagsync.store import part_row

    START, KEY, CONVERSATIONS, POINTER = "root", "id", "conversations", "head_message_id"

    def store(n, i, parent, role, text):
        mid, m = f"writer-{n:05d}-{i}", Message(role, [TextPart(text)])
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        conn.execute(
            "INSERT INTO messages (id, parent_id, content_hash, role, provider_metadata_json, created_at) "
            "VALUES (?, ?, ?, ?, NULL, ?)",
            (mid, parent, content_hash(m), role, now),
        )
        conn.execute(
            'INSERT INTO message_parts (id, message_id, "order", part_type, content, content_json, '
            "tool_call_id, server_executed) VALUES (?, ?, 0, ?, ?, ?, ?, ?)",
            (mid + "-p", mid, *part_row(m.parts[0])),
        )
        return mid

    def point_new(cid, tip):
        conn.execute(
            "INSERT INTO conversations (id, name, model, head_message_id) VALUES (?, 'live', 'echo', ?)", (cid, tip)
        )
else:
    from llm.logs import message_hash
    from llm.parts import Message, TextPart

    START, KEY, CONVERSATIONS, POINTER = None, "hash", "threads", "tip_message_hash"

    def store(n, i, parent, role, text):
        digest = message_hash(Message(role=role, parts=[TextPart(text=text)]), parent)
        conn.execute(
            "INSERT INTO messages (hash, parent_hash, role, provider_metadata) VALUES (?, ?, ?, NULL)",
            (digest, parent, role),
        )
        conn.execute(
            "INSERT INTO parts (message_hash, position, type, tool_name, text, payload) "
            "VALUES (?, 0, 'text', NULL, ?, NULL)",
            (digest, text),
        )
        return digest

    def point_new(cid, tip):
        conn.execute(
            "INSERT INTO threads (id, name, tip_message_hash, forked_from, datetime_utc) "
            "VALUES (?, 'live', ?, NULL, ?)",
            (cid, tip, datetime.now(timezone.utc).isoformat()),
        )


def stored(key):
    if key is None:
        return True
    where["read"] = True
    return conn.execute(f"SELECT 1 FROM messages WHERE {KEY} = ?", (key,)).fetchone() is not None


heads = {}  # conversation -> its tip
chains = {}  # conversation -> every message this writer stored for it, oldest first
counts = {"new": 0, "extend": 0, "branch": 0, "branch, but it was gone": 0}
n = 0
while not os.path.exists(stop):
    n += 1
    texts = [("user", f"question {n} from the live writer"), ("assistant", f"answer {n} from the live writer")]
    if rng.random() < 0.5:
        texts.append(("user", f"and a follow-up to {n}"))
    kind = rng.choice(["new", "extend", "branch", "branch"]) if heads else "new"
    cid = rng.choice(sorted(heads)) if kind == "extend" else f"writer-{fmt}-{n:05d}"
    # 1. The chain, in one transaction; nothing points at it yet.
    conn.execute("BEGIN")
    where.update(round=n, kind=kind, transaction=1, began=time.monotonic(), read=False)
    if kind == "extend":
        parent = heads[cid]
        assert stored(parent), f"the tip of {cid} is gone"
    elif kind == "branch":
        pool = open(pool_file).read().split()
        parent = rng.choice(pool[-6:])
        if not stored(parent):
            kind, parent = "branch, but it was gone", START
    else:
        parent = START
        assert stored(parent)
    counts[kind] += 1
    chain = []
    for i, (role, text) in enumerate(texts):
        parent = store(n, i, parent, role, text)
        chain.append(parent)
    conn.execute("COMMIT")
    # 2. A moment later, the conversation, in a second transaction.
    time.sleep(rng.uniform(0.02, 0.1))
    conn.execute("BEGIN")
    where.update(transaction=2, began=time.monotonic(), read=True)
    head = conn.execute(f"SELECT {POINTER} FROM {CONVERSATIONS} WHERE id = ?", (cid,)).fetchone()
    if kind == "extend":
        assert head == (heads[cid],), f"{cid} points at {head}, not at {heads[cid]}"
        conn.execute(f"UPDATE {CONVERSATIONS} SET {POINTER} = ? WHERE id = ?", (parent, cid))
    else:
        assert head is None
        point_new(cid, parent)
    conn.execute("COMMIT")
    heads[cid] = parent
    chains.setdefault(cid, []).extend(chain)
    print(n, flush=True)
json.dump({"heads": heads, "chains": chains, "counts": counts}, open(out, "w"))
"""

KEY = {"dag": ("id", "parent_id"), "llm": ("hash", "parent_hash")}
POINTER = {"dag": ("conversations", "head_message_id"), "llm": ("threads", "tip_message_hash")}


def tips(conn: apsw.Connection, fmt: str, ids: list[str]) -> str:
    """The messages these conversations (threads) point at, a line each."""
    table, pointer = POINTER[fmt]
    marks = ",".join("?" * len(ids))
    return "".join(f"{t}\n" for (t,) in conn.execute(f"SELECT {pointer} FROM {table} WHERE id IN ({marks})", ids) if t)


def unreachable_slice(conn: apsw.Connection, fmt: str, ids: list[str]) -> None:
    """Make these conversations (threads) unreachable, as deleting them in llm would.

    Written the way dagsync writes (``write_transaction``), not the way llm
    does: two llm-style writers can fail each other (see docs/merge.md), and
    the writer must fail only if gc fails it.
    """
    marks = ",".join("?" * len(ids))
    with write_transaction(conn):
        if fmt == "dag":
            conn.execute(f"UPDATE conversations SET head_message_id = NULL WHERE id IN ({marks})", ids)
            conn.execute(f"DELETE FROM calls WHERE conversation_id IN ({marks})", ids)
            return
        turns = f"SELECT id FROM turns WHERE thread_id IN ({marks})"
        for linked in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations"):
            conn.execute(f"DELETE FROM {linked} WHERE turn_id IN ({turns})", ids)
        # llm's messages carry no time: say a gc found these unreachable long
        # ago, so that the next one deletes them (it forgets those still reachable).
        conn.execute(
            "WITH RECURSIVE up(h) AS ("
            f" SELECT tip_message_hash FROM threads WHERE id IN ({marks})"
            f" UNION SELECT parent_message_hash FROM turns WHERE thread_id IN ({marks})"
            f" UNION SELECT tip_message_hash FROM turns WHERE thread_id IN ({marks})"
            " UNION SELECT m.parent_hash FROM up JOIN messages m ON m.hash = up.h)"
            " INSERT OR IGNORE INTO _dagsync_gc_seen (tbl, key, first_seen)"
            " SELECT 'messages', h, 0 FROM up WHERE h IS NOT NULL",
            ids * 3,
        )
        conn.execute(f"DELETE FROM turns WHERE thread_id IN ({marks})", ids)
        conn.execute(f"UPDATE threads SET forked_from = NULL WHERE forked_from IN ({marks})", ids)
        conn.execute(f"DELETE FROM threads WHERE id IN ({marks})", ids)


def chain(conn: sqlite3.Connection, fmt: str, tip: str) -> list[str] | None:
    """The messages from ``tip`` up to the chain's start, or None if one is missing."""
    key, parent = KEY[fmt]
    out = []
    at: str | None = tip
    while at is not None and at != "root":
        row = conn.execute(f"SELECT {parent} FROM messages WHERE {key} = ?", (at,)).fetchone()
        if row is None:
            return None
        out.append(at)
        at = row[0]
    return out


def build(tmp_path: Path, fmt: str) -> Path:
    path = tmp_path / f"{fmt}.db"
    if fmt == "dag":
        generate(path, seed=91, conversations=300)
    else:
        from fixtures import generate_llm

        generate_llm(path, seed=92, conversations=300)
        # The table where gc records when it first found a message unreachable.
        conn = apsw.Connection(str(path))
        with write_transaction(conn):
            bookkeeping.ensure(conn)
        conn.close()
    return path


@pytest.mark.parametrize("fmt", ["dag", "llm"])
def test_gc_in_a_loop_never_fails_a_live_writer_nor_loses_what_it_wrote(tmp_path, monkeypatch, fmt):
    if fmt == "llm":
        pytest.importorskip("llm")
    path = build(tmp_path, fmt)
    table, pointer = POINTER[fmt]
    # Tiny transactions: many lock acquisitions, many commit points.
    monkeypatch.setattr(dagsync.writer, "TARGET_SECONDS", 0.002)
    monkeypatch.setattr(dagsync.writer, "FIRST_CHUNK", 50)
    side = apsw.Connection(str(path))
    side.set_busy_timeout(2000)
    originals = [c for (c,) in side.execute(f"SELECT id FROM {table} ORDER BY rowid")]
    random.Random(fmt).shuffle(originals)
    pool, stop, out, errors = tmp_path / "pool", tmp_path / "stop", tmp_path / "written.json", tmp_path / "errors"
    unreachable_slice(side, fmt, originals[:40])  # old garbage, from the start
    batches = [originals[i : i + 3] for i in range(40, len(originals), 3)]
    # The writer branches from the messages the next batch points at: still
    # reachable, or just made unreachable, or already deleted by then.
    pool.write_text(tips(side, fmt, batches[0]))

    with errors.open("w") as stderr:
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, fmt, str(path), str(stop), str(pool), str(out), "7"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    rounds: list[str] = []
    reader = threading.Thread(target=lambda: rounds.extend(writer.stdout), daemon=True)
    reader.start()
    reports = []
    try:
        # gc again and again; before each run a few more conversations become
        # unreachable (old ones, past any grace period), so every run deletes
        # something while the writer writes. The writer's chains are
        # unreachable between its two transactions, and the 30 s grace period
        # (far longer than that gap, even with a 5 s wait for a lock) is all
        # that protects them.
        # Until both have done enough, however slow the machine: no count of gc
        # runs is sure to give the writer 50 rounds (gc's tiny transactions
        # here let it in seldom), so the cap is generous and in time.
        deadline = time.monotonic() + 300
        while (len(reports) < 40 or len(rounds) < 50) and writer.poll() is None and time.monotonic() < deadline:
            if batches:
                unreachable_slice(side, fmt, batches.pop(0))
                if batches:
                    with pool.open("a") as f:
                        f.write(tips(side, fmt, batches[0]))
            reports.append(gc(path, grace="30s"))
    finally:
        stop.touch()
        try:
            writer.wait(timeout=60)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            reader.join(timeout=10)
            writer.stdout.close()
            side.close()
    assert writer.returncode == 0 and errors.read_text() == "", f"the live writer failed: {errors.read_text()}"
    written = json.loads(out.read_text())
    assert len(rounds) >= 50, f"the writer stopped after {len(rounds)} rounds"
    assert sum(1 for r in reports if r.table("messages").deleted) > 1, "gc had nothing to delete: it proved nothing"

    problems = []
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        for cid, tip in written["heads"].items():
            found = conn.execute(f"SELECT {pointer} FROM {table} WHERE id = ?", (cid,)).fetchone()
            if found != (tip,):
                problems.append(f"{cid}: points at {found}, not at {tip}")
                continue
            loaded = chain(conn, fmt, tip)
            if loaded is None:
                problems.append(f"{cid}: its chain from {tip} is broken")
            elif lost := set(written["chains"][cid]) - set(loaded):
                problems.append(f"{cid}: its chain lost {lost}")
    conn.close()
    assert problems == []
    assert verify(path).problems == ()


# A merge into the same file is a writer too: it copies a source's messages,
# parents first, a chunk per transaction, and only then the conversations and
# calls that point at them. This one stops after its first transaction that
# added messages, until told to go on. It writes in short transactions from
# the start, as a merge does once another process (this gc) opens the file.
PAUSED_MERGE = r"""
import contextlib, sys
import dagsync.merge
import dagsync.transactions as m
m.long_transactions = lambda conn: contextlib.nullcontext()
inner = m.write_transaction
count = lambda conn: next(iter(conn.execute("SELECT count(*) FROM main.messages")))[0]
paused = False
@contextlib.contextmanager
def pausing(conn):
    global paused
    before = count(conn)
    with inner(conn):
        yield
    if not paused and count(conn) > before:
        paused = True
        print("paused", flush=True)
        sys.stdin.readline()
m.write_transaction = pausing
dagsync.merge.merge(sys.argv[1], sys.argv[2:])
"""


def test_gc_between_two_transactions_of_a_merge_loses_nothing_the_merge_wrote(tmp_path):
    machines = [r.path for r in family(tmp_path / "fam", seed=63, machines=2, conversations=60)]
    target = tmp_path / "target.db"
    shutil.copyfile(machines[0], target)
    merge = subprocess.Popen(
        [sys.executable, "-c", PAUSED_MERGE, str(target), str(machines[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if merge.stdout.readline() != "paused\n":
            raise RuntimeError(f"the merge did not pause: {merge.stderr.read()}")
        report = gc(target, grace="30s")
        merge.stdin.write("go on\n")
        merge.stdin.flush()
        _, errors = merge.communicate(timeout=120)
    finally:
        if merge.poll() is None:
            merge.kill()
            merge.wait()
    if merge.returncode != 0:
        raise RuntimeError(f"the merge failed: {errors}")
    assert verify(target).problems == ()
    # The copied messages look old and are unreachable until the merge's
    # last steps: gc saw the merge's marker and left them alone.
    assert report.merge_in_progress
    assert report.table("messages").deleted == 0
