"""forget's first step: delete the selected conversations and what hangs off them.

For a chunk of the ids in ``temp.fg_sel``, in one write transaction:

1. find the rows that go: the conversations' own rows (``Conversations.tables``)
   and, down the format's foreign keys (``Format.cascade``), their calls or
   turns, responses, search rows, tool and fragment links;
2. note in the pending table what those rows pointed at: the messages (their
   heads, tips, a turn's parent message) and the shared rows (fragments,
   attachments, tools, blobs) - what ``collect`` then deletes if nothing
   else reaches it;
3. tombstone the ids (``tombstones.record``), and delete the rows, children first.

Every transaction is whole: a ``kill -9`` leaves some conversations
forgotten, with their tombstones and pending rows, and the rest as they
were. The full-text indexes follow by llm's own triggers.

A child found through a column no index leads with (a legacy response's
``conversation_id``, say) is looked up in a snapshot of that column taken
once before the first chunk (``Lookups``), instead of a scan per chunk;
llm 0.36 writes none of those tables.
"""

from __future__ import annotations

import functools

import apsw

from dagsync import bookkeeping, packed
from dagsync.db import Database
from dagsync.forget import tombstones
from dagsync.formats import Collect
from dagsync.gc.run import _bytes
from dagsync.writer import Writer

__all__ = ["Unlink"]


def _leads_index(conn: apsw.Connection, table: str, column: str) -> bool:
    """Whether ``column`` leads some index of ``table`` (or is its integer primary key)."""
    for row in conn.execute("SELECT * FROM pragma_table_info(?)", (table,)):
        if row[1] == column and row[5] == 1 and str(row[2]).upper() == "INTEGER":
            return True
    for index in conn.execute("SELECT name FROM pragma_index_list(?)", (table,)):
        first = next(iter(conn.execute("SELECT name FROM pragma_index_info(?) WHERE seqno = 0", (index[0],))), None)
        if first is not None and first[0] == column:
            return True
    return False


class Unlink:
    """The selected conversations' rows, found and deleted a chunk of ids at a time."""

    def __init__(self, db: Database, writer: Writer, present: set[str], pending: str, dry_run: bool) -> None:
        self.db = db
        self.conn = db.conn
        self.fmt = db.format
        self.writer = writer
        self.dry_run = dry_run
        self.pending = pending  # main._dagsync_forget_pending, or a temp table in a dry run
        spec = self.fmt.conversations
        assert spec is not None
        self.tables = [t for t in spec.tables if t in present]
        self.edges = [e for e in self.fmt.cascade if e[0] in present and e[2] in present]
        self.order = list(dict.fromkeys([*self.tables, *(child for child, _, _, _ in self.edges)]))
        self.deleted: dict[str, list[int]] = {}
        shared = {t.name for t in self.fmt.tables if t.collect is Collect.UNREFERENCED and t.name in present}
        # What the rows that go point at: (table, column, pending tbl).
        self.pointing = [
            (table, column, "messages" if ref == "messages" else ref)
            for table in self.order
            for column, ref in self.fmt.references[table].items()
            if ref == "messages" or ref in shared
        ]
        self.markers = (
            [c for c in self.fmt.packed if c.table in self.order] if packed.is_packed(self.conn) else []
        )
        for table in self.order:
            self.conn.execute(f'CREATE TEMP TABLE IF NOT EXISTS "fg_rows_{table}" (rid INTEGER PRIMARY KEY)')
        self.lookups: dict[tuple[str, str], str] = {}
        for child, column, _, _ in self.edges:
            if (child, column) not in self.lookups and not _leads_index(self.conn, child, column):
                name = f"fg_look_{child}_{column}"
                self.conn.execute(f'CREATE TEMP TABLE "{name}" (value, rid INTEGER)')
                for low, high in writer.ranges(f'main."{child}"'):
                    self.conn.execute(
                        f'INSERT INTO temp."{name}" SELECT "{column}", rowid FROM main."{child}" '
                        f'WHERE rowid BETWEEN ? AND ? AND "{column}" IS NOT NULL',
                        (low, high),
                    )
                self.conn.execute(f'CREATE INDEX temp."{name}_value" ON "{name}" (value)')
                self.lookups[(child, column)] = name

    def find(self, keys: str) -> None:
        """Add to ``temp.fg_rows_<table>`` the rows of the conversations ``keys`` (SQL selecting ids)."""
        for table in self.tables:
            self.conn.execute(
                f'INSERT OR IGNORE INTO temp."fg_rows_{table}" SELECT t.rowid FROM main."{table}" t '
                f'WHERE t."id" IN ({keys})'
            )
        for child, column, parent, parent_column in self.edges:
            values = (
                f'SELECT p."{parent_column}" FROM main."{parent}" p '
                f'WHERE p.rowid IN (SELECT rid FROM temp."fg_rows_{parent}")'
            )
            lookup = self.lookups.get((child, column))
            if lookup is not None:
                found = f'SELECT l.rid FROM temp."{lookup}" l WHERE l.value IN ({values})'
            else:
                found = f'SELECT c.rowid FROM main."{child}" c WHERE c."{column}" IN ({values})'
            self.conn.execute(f'INSERT OR IGNORE INTO temp."fg_rows_{child}" {found}')

    def note(self) -> None:
        """Record in the pending table what the found rows point at."""
        for table, column, tbl in self.pointing:
            self.conn.execute(
                f'INSERT OR IGNORE INTO {self.pending} (tbl, key) SELECT ?, t."{column}" FROM main."{table}" t '
                f'WHERE t.rowid IN (SELECT rid FROM temp."fg_rows_{table}") AND t."{column}" IS NOT NULL',
                (tbl,),
            )
        for column in self.markers:
            self.conn.execute(
                f"INSERT OR IGNORE INTO {self.pending} (tbl, key) SELECT 'blobs', "
                f'{packed.blob_hash_sql(column, "t")} FROM main."{column.table}" t '
                f'WHERE t.rowid IN (SELECT rid FROM temp."fg_rows_{column.table}") AND {packed.marker_sql(column, "t")}'
            )

    def delete(self) -> int:
        """Count, then (unless a dry run) delete, the found rows, children first; empty the sets.
        Return how many rows were found."""
        found = 0
        for table in reversed(self.order):
            rows, size = next(
                self.conn.execute(
                    f'SELECT count(*), coalesce(sum({_bytes(self.fmt.columns[table], "t")}), 0) FROM main."{table}" t '
                    f'WHERE t.rowid IN (SELECT rid FROM temp."fg_rows_{table}")'
                )
            )
            if rows and not self.dry_run:
                self.conn.execute(f'DELETE FROM main."{table}" WHERE rowid IN (SELECT rid FROM temp."fg_rows_{table}")')
                self.conn.execute(f'DELETE FROM temp."fg_rows_{table}"')
            self.writer.on_commit(functools.partial(self._count, table, rows, size))
            found += rows
        return found

    def _count(self, table: str, rows: int, size: int) -> None:
        tally = self.deleted.setdefault(table, [0, 0])
        tally[0] += rows
        tally[1] += size

    def run(self, now: float, tombstone: bool, progress_phase: str = "forget: deleting conversations") -> None:
        """Every conversation in ``temp.fg_sel``, a chunk of ids per write transaction."""
        self.conn.execute("CREATE TEMP TABLE IF NOT EXISTS fg_chunk (key TEXT PRIMARY KEY, fork INTEGER NOT NULL)")
        total = next(self.conn.execute("SELECT count(*) FROM temp.fg_sel"))[0]
        done = 0
        for low, high in self.writer.ranges("temp.fg_sel", writes=True):
            with self.writer.transaction():
                self.conn.execute("DELETE FROM temp.fg_chunk")
                self.conn.execute("INSERT INTO temp.fg_chunk SELECT key, fork FROM temp.fg_sel WHERE rowid BETWEEN ? AND ?", (low, high))
                self.find("SELECT key FROM temp.fg_chunk")
                if not self.dry_run:
                    bookkeeping.ensure(self.conn)
                    if tombstone:
                        # A merge's fork goes with its conversation, whose tombstone names it.
                        tombstones.record(self.conn, "SELECT key FROM temp.fg_chunk WHERE NOT fork", now)
                self.note()
                # No `rewritten` stamp: the marks still hold (merge.marks.forgotten_below).
                self.delete()
                if not self.dry_run:
                    self._drop_origins("SELECT key FROM temp.fg_chunk")
            done += next(self.conn.execute("SELECT count(*) FROM temp.fg_sel WHERE rowid BETWEEN ? AND ?", (low, high)))[0]
            self.writer.progress(progress_phase, done, total)

    def _drop_origins(self, keys: str) -> None:
        """Where the conversations ``keys`` had their heads from (merge.origins) goes with
        them: a name for a fork of a row that is no longer there."""
        if not bookkeeping.has(self.conn, "_dagsync_origins"):
            return
        for table in self.tables:
            self.conn.execute(f"DELETE FROM main._dagsync_origins WHERE pointer_table = ? AND key IN ({keys})", (table,))

    def gone(self, table: str, alias: str) -> str:
        """SQL true for a row of ``table`` this (dry) run found to go, but did not delete."""
        if not self.dry_run or table not in self.order:
            return "0"
        return f'{alias}.rowid IN (SELECT rid FROM temp."fg_rows_{table}")'
