"""forget's second step: delete exactly what nothing else reaches any more.

It is gc's sweep (``dagsync/gc/sweep.py``: chunked, leaves first, checking
the file as it is now in every transaction, polite to a live llm, waiting
for a merge) over candidates found from the forgotten conversations alone,
not from a walk of the whole file:

* ``C``: every message the pending messages (what the forgotten rows pointed
  at) reach by parent links;
* kept: a message of ``C`` that a root points at (a thread, turn,
  conversation or call that stays) or that has a child outside ``C`` (a
  thread that shares the prefix, a message a live writer has just stored
  under it, old garbage), and then everything it reaches: a shared prefix
  stays whole;
* the rest of ``C`` goes, with its parts, and so do the shared rows
  (fragments, attachments, tools, blobs) that only rows that went
  referenced.

The grace period does not keep what forget unlinked; what a live writer
stores meanwhile is a child outside ``C``, or a root, and is kept. Garbage
that was there before (unreachable, not forgotten) is left to gc.
"""

from __future__ import annotations

from dagsync.db import Database
from dagsync.forget.tombstones import PENDING
from dagsync.forget.unlink import Unlink
from dagsync.gc import mark as marking
from dagsync.gc import sweep as sweeping
from dagsync.gc.run import UNREFERENCED_OLD, WAITING, GcRun
from dagsync.writer import Writer

__all__ = ["Collect"]


class Collect(GcRun):
    """A gc run whose candidates are what only forgotten conversations reached."""

    def __init__(
        self, db: Database, now: float, dry_run: bool, writer: Writer, unlink: Unlink, pending: str
    ) -> None:
        super().__init__(db, 0.0, now, dry_run, writer.progress, writer=writer)
        self.unlink = unlink
        self.pending = pending
        # No `rewritten` stamp, unlike gc: what goes belongs to tombstoned
        # conversations alone, and the marks still hold with that gap
        # (merge.marks.forgotten_below).
        self.stamp = None
        self.shared_prefix = 0  # messages the forgotten conversations reached that stay

    def gone(self, table: str, alias: str) -> str:
        return self.unlink.gone(table, alias)

    def run(self) -> None:
        self.drop_gc_temp()
        try:
            self.mark()
            sweeping.sweep(self)
            sweeping.sweep_shared(self)
        finally:
            self.drop_gc_temp()

    def drop_gc_temp(self) -> None:
        for (name,) in list(self.conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table'")):
            if name.startswith("gc_") or name in ("fg_c", "fg_block"):
                self.conn.execute(f'DROP TABLE temp."{name}"')

    # -- the mark ------------------------------------------------------------

    def mark(self) -> None:
        self.data_version = self.one("PRAGMA data_version")
        msgs, key, parent = self.main_table("messages"), self.key, self.parent
        conn = self.conn
        conn.execute(
            "CREATE TEMP TABLE fg_c (key TEXT PRIMARY KEY, rid INTEGER, parent TEXT, prid INTEGER,"
            " blocked INTEGER NOT NULL DEFAULT 0);"
            "CREATE TEMP TABLE fg_block (key TEXT PRIMARY KEY);"
        )
        root = "" if self.fmt.root_id is None else f" WHERE key != '{self.fmt.root_id}'"
        # C: up the parent links from each pending message, each message read
        # once (its row id and parent carried along); a walk stops where an
        # earlier one passed (what it reaches is in C already).
        for low, high in self.writer.ranges(self.pending, "key", phase="forget: reading messages", where="tbl = 'messages'"):
            conn.execute(
                "WITH RECURSIVE up(key, rid, parent) AS ("
                f' SELECT m."{key}", m.rowid, m."{parent}" FROM {self.pending} p JOIN {msgs} m ON m."{key}" = p.key'
                "  WHERE p.tbl = 'messages' AND p.key BETWEEN ? AND ?"
                f' UNION SELECT m."{key}", m.rowid, m."{parent}" FROM up JOIN {msgs} m ON m."{key}" = up.parent'
                "  WHERE up.parent IS NOT NULL AND up.parent != up.key AND up.key NOT IN (SELECT key FROM temp.fg_c)"
                f") INSERT OR IGNORE INTO temp.fg_c (key, rid, parent) SELECT key, rid, parent FROM up{root}",
                (low, high),
            )
        # Every parent of a member is a member (or the root): its row id from C itself.
        conn.execute("UPDATE temp.fg_c SET prid = (SELECT p.rid FROM temp.fg_c p WHERE p.key = fg_c.parent)")
        # Kept: what a root still points at, and what has a child outside C ...
        for table, column in self.roots:
            if table not in self.present:
                continue
            for low, high in self.ranges(self.main_table(table)):
                conn.execute(
                    f'INSERT OR IGNORE INTO temp.fg_block SELECT t."{column}" FROM main."{table}" t '
                    f'WHERE t.rowid BETWEEN ? AND ? AND t."{column}" IN (SELECT key FROM temp.fg_c) '
                    f"AND NOT {self.gone(table, 't')}",
                    (low, high),
                )
        for low, high in self.ranges("temp.fg_c"):
            conn.execute(
                # CROSS JOIN: each member's children by the parent index.
                f"INSERT OR IGNORE INTO temp.fg_block SELECT c.key FROM temp.fg_c c CROSS JOIN {msgs} ch "
                f'ON ch."{parent}" = c.key WHERE c.rowid BETWEEN ? AND ? AND ch."{key}" != c.key '
                f'AND ch."{key}" NOT IN (SELECT key FROM temp.fg_c)',
                (low, high),
            )
        # ... and everything those reach.
        conn.execute(
            "WITH RECURSIVE k(key) AS ("
            " SELECT key FROM temp.fg_block"
            f" UNION SELECT m.\"{parent}\" FROM k JOIN {msgs} m ON m.\"{key}\" = k.key"
            f" WHERE m.\"{parent}\" IN (SELECT key FROM temp.fg_c) AND m.\"{parent}\" != m.\"{key}\""
            ") UPDATE temp.fg_c SET blocked = 1 WHERE key IN (SELECT key FROM k)"
        )
        self.shared_prefix = self.one("SELECT count(*) FROM temp.fg_c WHERE blocked")
        conn.execute(
            "CREATE TEMP TABLE gc_unreach (rid INTEGER PRIMARY KEY, key TEXT, prid INTEGER,"
            " young INTEGER NOT NULL, keep INTEGER NOT NULL DEFAULT 0);"
            "INSERT INTO temp.gc_unreach (rid, key, prid, young) SELECT rid, key, prid, 0 FROM temp.fg_c WHERE NOT blocked;"
        )
        self.unreachable = self.one("SELECT count(*) FROM temp.gc_unreach")
        marking._candidates(self)
        for table in self.shared:
            marking._shared(self, table)
        if self.refs_made:
            # Shared rows nothing references that forget did not unlink are
            # gc's to judge, by their grace period: not these.
            conn.execute(
                f"UPDATE temp.gc_dep SET state = {WAITING} WHERE state = {UNREFERENCED_OLD} AND NOT EXISTS "
                f"(SELECT 1 FROM {self.pending} p WHERE p.tbl = gc_dep.tbl AND p.key = gc_dep.key)"
            )

    def finish(self) -> None:
        """Empty the pending table: what it named is deleted or still in use.
        Left as it is when a merge made the sweep stop (the next forget or merge finishes)."""
        if self.dry_run or self.merge_in_progress or self.pending != f"main.{PENDING}":
            return
        if self.one(f"SELECT 1 FROM {self.pending} LIMIT 1"):
            with self.writer.transaction():
                self.conn.execute(f"DELETE FROM {self.pending}")
