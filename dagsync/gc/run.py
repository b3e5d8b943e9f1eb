"""One gc of one file: what it collects (roots, shared tables), its plumbing and its tallies.

``mark.py`` and ``sweep.py`` are the phases; both work on a ``GcRun``. The
temp tables the mark leaves for the sweep:

* ``gc_node`` (rid, prid, young): the DAG's skeleton by rowid;
* ``gc_unreach`` (rid, key, prid, young, keep): messages no root reaches,
  ``keep`` for those inside the grace period and everything they reach;
* ``gc_cand`` (seq, key): the candidates, tree by tree, leaves first;
* ``gc_ref`` (tbl, key, dying) and ``gc_dep`` (tbl, key, state): who
  references each shared row, and whether it dies, is old, or waits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from dagsync import bookkeeping, packed
from dagsync.db import Database
from dagsync.formats import Collect, PackedColumn
from dagsync.gc.report import GcTable
from dagsync.writer import Progress, Writer

__all__ = ["DYING", "MESSAGE_MAP", "SEEN", "UNREFERENCED_OLD", "WAITING", "GcRun", "Shared"]

SEEN = "_dagsync_gc_seen"
MESSAGE_MAP = "_dagsync_message_map"
# Dependent-row states in temp.gc_dep.
DYING, UNREFERENCED_OLD, WAITING = 1, 2, 3


@dataclass(frozen=True)
class Shared:
    """A table of shared rows, deleted when nothing references them (``Collect.UNREFERENCED``)."""

    name: str
    pk: str
    columns: tuple[str, ...]
    refs: tuple[tuple[str, str], ...]  # (table, column) foreign keys pointing at it
    markers: tuple[PackedColumn, ...] = ()  # packed values pointing at it (the blob store)
    keep: str = "0"  # SQL over alias d: never delete this row


def _bytes(columns: tuple[str, ...], alias: str) -> str:
    """SQL for the bytes a row's values take (text as UTF-8, numbers as written).

    ``octet_length``, not ``length(CAST(... AS BLOB))``: the same number, without
    copying a value out of its overflow pages to count it."""
    return " + ".join(f'coalesce(octet_length({alias}."{c}"), 0)' for c in columns) or "0"


class GcRun:
    """What one gc reads the file for, and what it has found and done.

    ``deleted`` (table -> [rows, bytes]) counts only what is committed
    (``Writer.on_commit``), so a run that has to start again after giving
    way to another process (``Writer.redo``) carries it on.
    """

    def __init__(
        self,
        db: Database,
        grace: float,
        now: float,
        dry_run: bool,
        progress: Progress | None,
        *,
        writer: Writer | None = None,
        deleted: dict[str, list[int]] | None = None,
    ) -> None:
        self.db = db
        self.conn = db.conn
        self.fmt = db.format
        self.now = now
        self.cutoff = now - grace
        # No grace: nothing waits, not even a row gc has never seen before.
        self.no_grace = grace <= 0
        self.dry_run = dry_run
        self.writer = writer or Writer(db.conn, progress, dry_run=dry_run)
        self.progress = self.writer.progress
        self.present = {
            name for (name,) in self.conn.execute("SELECT name FROM main.sqlite_schema WHERE type = 'table'")
        }
        self.key = self.fmt.message_key
        self.parent = self.fmt.parent_column
        self.messages = next(t for t in self.fmt.tables if t.collect is Collect.UNREACHABLE)
        # Foreign keys the file itself declares, beyond the format's DDL (a
        # plugin's table, say): whatever they point at is kept too.
        file_refs = [
            (table, row[3], row[2])
            for table in sorted(self.present)
            if not table.startswith(("sqlite_", "_dagsync_"))
            for row in self.conn.execute("SELECT * FROM pragma_foreign_key_list(?)", (table,))
        ]
        collected = {t.name for t in self.fmt.tables if t.collect in (Collect.UNREACHABLE, Collect.WITH_OWNER)}
        self.roots = tuple(
            dict.fromkeys(
                [*self.fmt.roots, *((t, c) for t, c, ref in file_refs if ref == "messages" and t not in collected)]
            )
        )
        self.shared = [
            Shared(
                t.name, self.fmt.primary_key(t.name), self.fmt.columns[t.name],
                tuple(dict.fromkeys([*self.fmt.referrers(t.name), *((o, c) for o, c, ref in file_refs if ref == t.name)])),
            )
            for t in self.fmt.tables
            if t.collect is Collect.UNREFERENCED and t.name in self.present
        ]  # fmt: skip
        if packed.is_packed(self.conn):
            # The blob store (packed.py): blobs nothing refers to, then dictionaries
            # no blob uses - but never the one new rows are packed with.
            markers = tuple(c for c in self.fmt.packed if c.table in self.present)
            # Blobs name their dictionary by id (by hash in the first store: packed.py).
            dict_key = "id" if packed.dict_ids(self.conn) else "hash"
            self.shared += [
                Shared("blobs", "hash", ("hash", "size", "dict", "data"), (), markers),
                Shared(
                    "blob_dicts", dict_key, tuple(dict.fromkeys((dict_key, "hash", "data"))), (("blobs", "dict"),),
                    keep="d.hash IN (SELECT value FROM main._dagsync_meta WHERE key = 'pack_dict')",
                ),
            ]  # fmt: skip
        self.generation = packed.generation(self.conn)
        self.deleted: dict[str, list[int]] = {} if deleted is None else deleted
        self.waiting: dict[str, int] = {}
        self.root_count = self.reachable = self.unreachable = self.kept_by_grace = self.kept_as_new = 0
        self.dying_tables: set[str] = set()
        # The sweep kept a row it meant to delete (written to meanwhile).
        self.kept_back = False
        self.merge_in_progress = False
        self.refs_made = False
        self.data_version = None
        # What the sweep stamps the file as rewritten by (bookkeeping.rewritten), if anything.
        self.stamp: str | None = "gc"

    # -- plumbing ------------------------------------------------------------

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.conn.execute(sql, params):
            return row[0]
        return None

    def ranges(self, table: str, phase: str | None = None, writes: bool = False, where: str = "1"):  # noqa: ANN201
        """The writer's ranges of ``table`` (``temp.x`` or a main table), with progress."""
        return self.writer.ranges(table, where=where, phase=phase, writes=writes)

    def main_table(self, name: str) -> str:
        return f'main."{name}"'

    def delete(self, name: str, where: str, columns: tuple[str, ...] | None = None) -> None:
        """Count, then (unless a dry run) delete, the rows of table ``name`` matching ``where`` (alias ``t``).

        ``where`` is evaluated once: the rows' rowids and sizes are gathered
        first, then counted and deleted by rowid. The count is the run's
        once the transaction commits.
        """
        columns = columns or self.fmt.columns[name]
        self.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_rows (rid INTEGER PRIMARY KEY, size INTEGER)")
        self.conn.execute("DELETE FROM temp.gc_rows")
        self.conn.execute(f'INSERT INTO temp.gc_rows SELECT t.rowid, {_bytes(columns, "t")} FROM main."{name}" t WHERE {where}')
        rows, size = next(self.conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM temp.gc_rows"))
        if rows and not self.dry_run:
            self.conn.execute(f'DELETE FROM main."{name}" WHERE rowid IN (SELECT rid FROM temp.gc_rows)')
        self.writer.on_commit(functools.partial(self._count, name, rows, size))

    def _count(self, name: str, rows: int, size: int) -> None:
        tally = self.deleted.setdefault(name, [0, 0])
        tally[0] += rows
        tally[1] += size

    def drop_temp(self) -> None:
        if self.conn.in_transaction and self.dry_run:
            self.conn.execute("ROLLBACK")
        for (name,) in list(self.conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table'")):
            self.conn.execute(f'DROP TABLE temp."{name}"')

    def gone(self, table: str, alias: str) -> str:
        """SQL true for a row of a table gc keeps that goes all the same (a dry
        forget's conversations, not deleted): gc has none."""
        return "0"

    def has_seen_table(self) -> bool:
        return SEEN in self.present

    def ensure_seen(self) -> None:
        if not self.has_seen_table():
            with self.writer.transaction():
                bookkeeping.ensure(self.conn)
            self.present.add(SEEN)

    def unchanged(self) -> bool:
        """No other connection has committed to the file since the mark began."""
        return self.one("PRAGMA data_version") == self.data_version

    def young(self, alias: str) -> str:
        """SQL true when the message ``alias`` is inside the grace period by its own time."""
        if self.fmt.message_time is None:
            return "0"
        # unixepoch() reads both spellings the dag format has; NULL (unreadable) counts as new.
        return f"NOT coalesce(unixepoch({alias}.\"{self.fmt.message_time}\", 'subsec') <= {self.cutoff!r}, 0)"

    def tables(self) -> tuple[GcTable, ...]:
        names = [t.name for t in self.fmt.tables if t.name in self.deleted or t.name in self.waiting]
        extra = [n for n in [*self.deleted, *self.waiting] if n not in names]
        extra = list(dict.fromkeys(extra))
        return tuple(
            GcTable(n, *self.deleted.get(n, (0, 0)), waiting=self.waiting.get(n, 0)) for n in [*names, *extra]
        )
