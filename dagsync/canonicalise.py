"""canonicalise: collapse dag-format messages that share ``(parent_id, content_hash)``.

A database without the unique index on that pair (an older or hand-made
file) can hold the same message twice under one parent. The earliest id (the
smallest ULID) survives, so the result does not depend on the order in which
rows arrived; every reference to a collapsed message (children, parts, calls,
conversation heads, dagsync's own id map) moves to the survivor, and the old
id is recorded in ``_dagsync_message_map``. Collapsing two parents can make
their children collide, so the pass works down the tree level by level until
nothing collides; then the unique index is (re)created.

Each chunk of collapsed messages is one write transaction (or step of the
writer's long one) that rewrites the references before it deletes, so every
commit point is consistent and a re-run after a crash finishes the job.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import apsw

from dagsync import bookkeeping, faults
from dagsync.db import open_target
from dagsync.errors import UnsupportedDatabase
from dagsync.formats.dag import DAG
from dagsync.writer import Writer

__all__ = ["CanonicaliseReport", "canonicalise"]


@dataclass(frozen=True)
class CanonicaliseReport:
    path: str
    dry_run: bool
    groups: int  # sets of messages with one identity, before collapsing
    collapsed: int  # messages removed (mapped onto a survivor)
    parts_removed: int
    calls_rewritten: int
    conversations_rewritten: int
    levels: int  # depth of the deepest collision
    index_created: bool
    seconds: float


@faults.named("path")
def canonicalise(path: str | os.PathLike[str], *, dry_run: bool = False) -> CanonicaliseReport:
    """Collapse duplicate messages in a dag-format database.

    :raises UnsupportedDatabase: the file is not in the dag format.
    """
    started = time.perf_counter()
    with open_target(path, check=True) as db:
        if db.format is not DAG:
            raise UnsupportedDatabase(
                f"{db.path} is in the {db.format.name} format; canonicalise works on the "
                "dag format only (llm-format messages are keyed by content already)"
            )
        writer = Writer(db.conn, dry_run=dry_run)
        # Planned again from the file if a long transaction had to give way;
        # the report is the first plan's: the job it set out to do.
        planned: list[CanonicaliseReport] = []
        index_created = writer.redo(lambda: _canonicalise(writer, str(db.path), dry_run, planned), "canonicalising it")
        return dataclasses.replace(
            planned[0], index_created=index_created, seconds=round(time.perf_counter() - started, 3)
        )


def _canonicalise(writer: Writer, path: str, dry_run: bool, planned: list[CanonicaliseReport]) -> bool:
    """Plan (into ``planned``, the first time) and collapse; whether the unique index
    is (or, in a dry run, would be) created."""
    c = writer.conn
    one = writer.one
    has_index = bool(one(
        "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND name = 'idx_messages_parent_hash_unique'"
    ))  # fmt: skip
    groups = one(
        "SELECT count(*) FROM (SELECT 1 FROM messages WHERE id != 'root' "
        "GROUP BY parent_id, content_hash HAVING count(*) > 1)"
    )
    # What an attempt that gave way dropped inside the transaction then rolled back.
    for table in ("cmap", "clvl", "losers"):
        c.execute(f"DROP TABLE IF EXISTS temp.{table}")
    # Map every message to its survivor, parents first: a message's
    # identity is (its parent's survivor, its hash).
    c.execute("CREATE TEMP TABLE cmap (src TEXT PRIMARY KEY, dst TEXT NOT NULL, depth INTEGER NOT NULL) WITHOUT ROWID")
    c.execute("CREATE INDEX temp.cmap_depth ON cmap (depth)")
    c.execute("CREATE TEMP TABLE clvl (src TEXT NOT NULL, p TEXT NOT NULL, hash TEXT)")
    c.execute("CREATE INDEX temp.clvl_identity ON clvl (p, hash)")
    c.execute("INSERT INTO temp.cmap VALUES ('root', 'root', 0)")
    depth = levels = 0
    try:
        while True:
            c.execute("DELETE FROM temp.clvl")
            c.execute(
                "INSERT INTO temp.clvl SELECT m.id, p.dst, m.content_hash FROM main.messages m "
                "JOIN temp.cmap p ON p.src = m.parent_id WHERE p.depth = ? AND m.id != 'root'",
                (depth,),
            )
            if c.changes() == 0:
                break
            c.execute(
                "INSERT INTO temp.cmap SELECT l.src, (SELECT min(l2.src) FROM temp.clvl l2 "
                "WHERE l2.p = l.p AND l2.hash IS l.hash), ? FROM temp.clvl l",
                (depth + 1,),
            )
            depth += 1
            if one("SELECT count(*) FROM temp.cmap WHERE depth = ? AND dst != src", (depth,)):
                levels = depth
        collapsed = one("SELECT count(*) FROM temp.cmap WHERE dst != src")
        c.execute("CREATE TEMP TABLE losers (seq INTEGER PRIMARY KEY, src TEXT, dst TEXT)")
        c.execute("INSERT INTO temp.losers (src, dst) SELECT src, dst FROM temp.cmap WHERE dst != src ORDER BY depth, src")
        parts = one("SELECT count(*) FROM main.message_parts WHERE message_id IN (SELECT src FROM temp.losers)")
        calls = one(
            "SELECT count(*) FROM main.calls WHERE head_input_message_id IN (SELECT src FROM temp.losers) "
            "OR head_output_message_id IN (SELECT src FROM temp.losers)"
        )
        conversations = one(
            "SELECT count(*) FROM main.conversations WHERE head_message_id IN (SELECT src FROM temp.losers)"
        )
        if not planned:
            planned.append(CanonicaliseReport(
                path, dry_run, groups, collapsed, parts, calls, conversations, levels, not has_index, 0.0
            ))  # fmt: skip
        if not dry_run:
            if collapsed:
                with writer.transaction():
                    bookkeeping.ensure(c)
                    bookkeeping.rewritten(c, "canonicalise")
            # Parents' losers before children's, a chunk per transaction.
            for low, high in writer.ranges("temp.losers", "seq", writes=True):
                with writer.transaction():
                    _collapse(c, low, high)
            if not has_index:
                with writer.transaction():
                    c.execute(
                        "CREATE UNIQUE INDEX IF NOT EXISTS idx_messages_parent_hash_unique "
                        "ON messages (parent_id, content_hash)"
                    )
    finally:
        for table in ("cmap", "clvl", "losers"):
            c.execute(f"DROP TABLE IF EXISTS temp.{table}")
    return not has_index


def _collapse(c: apsw.Connection, low: int, high: int) -> None:
    """Move every reference off one chunk of collapsed messages, then delete them.
    Call inside a write transaction."""
    chunk = "SELECT src FROM temp.losers WHERE seq BETWEEN :low AND :high"
    survivor = "(SELECT dst FROM temp.losers WHERE src = {col} AND seq BETWEEN :low AND :high)"
    p = {"low": low, "high": high}
    c.execute(
        f"UPDATE main.messages SET parent_id = {survivor.format(col='parent_id')} WHERE parent_id IN ({chunk})", p
    )
    for col in ("head_input_message_id", "head_output_message_id"):
        c.execute(f"UPDATE main.calls SET {col} = {survivor.format(col=col)} WHERE {col} IN ({chunk})", p)
    c.execute(
        f"UPDATE main.conversations SET head_message_id = {survivor.format(col='head_message_id')} "
        f"WHERE head_message_id IN ({chunk})",
        p,
    )
    c.execute(
        f"UPDATE main._dagsync_message_map SET target_id = {survivor.format(col='target_id')} "
        f"WHERE target_id IN ({chunk})",
        p,
    )
    c.execute(  # a head's recorded origin (merge.origins) stays with it
        f"UPDATE main._dagsync_origins SET head = {survivor.format(col='head')} WHERE head IN ({chunk})", p
    )
    c.execute(
        "INSERT OR REPLACE INTO main._dagsync_message_map (source_id, target_id) "
        "SELECT src, dst FROM temp.losers WHERE seq BETWEEN :low AND :high",
        p,
    )
    # The survivor has the same content (same hash), so these parts are copies.
    c.execute(f"DELETE FROM main.message_parts WHERE message_id IN ({chunk})", p)
    c.execute(f"DELETE FROM main.messages WHERE id IN ({chunk})", p)
