"""gc: delete what no root reaches and keep everything else, beside a live llm.

**Roots** are the columns that point into the message DAG from outside it,
read from the format's foreign keys (``Format.roots``): conversation heads
and call heads in the dag format, thread tips and turn parent/tip hashes in
the llm format; and the dag format's sentinel ``'root'``.

**Kept**: every message a root reaches through parent links; every
unreachable message still inside the grace period, with everything it
reaches. The grace clock is the message's own time (``Format.message_time``:
the dag format's ``created_at``, either spelling; a time SQLite cannot read
counts as new) or, where messages carry no time (llm), the moment gc first
found the message unreachable, recorded in ``_dagsync_gc_seen``.

**Deleted**: the other messages, together with the rows collected with them
(``Collect.WITH_OWNER``: their parts and the parts' link rows); then shared
rows (``Collect.UNREFERENCED``: fragments, attachments, tools, tool
instances) that nothing references any more: at once when this run deleted
the rows that referenced them, else once they have been seen unreferenced
for the grace period. Everything else is never touched.

Safe beside a writer, in four steps:

1. **Mark** reads the file in short statements (none holds a lock for long)
   into temp tables: the DAG's skeleton by rowid, the roots, who references
   each shared row. It proposes candidates, leaves first. It is only a
   proposal: the file may change while it reads.
2. **Sweep** deletes candidates a chunk at a time, each chunk in one short
   exclusive transaction that first checks the file as it is now: a
   candidate is kept, with its ancestors, when a root points at it, when it
   has a child that is not a candidate of this or an earlier chunk, or when
   its own time is inside the grace period. So a message goes only together
   with everything below it: no commit point leaves a dangling parent, and
   nothing a root reaches is deleted, whatever was written since the mark.
3. **Shared rows** go in short transactions that first check again that no
   row references them.
4. **Record** first-seen times for what waits out its grace period; forget
   rows that are reachable or referenced again.

A ``kill -9`` at any point leaves a consistent file (every transaction is
whole); the next gc starts again from the file and finishes the job. Shared
rows whose last references an interrupted run deleted are marked as past
their grace period before the sweep, so the next run deletes them too.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagsync import bookkeeping
from dagsync.db import Database, Pacer, VacuumReport, open_target, rowid_ranges, vacuum as vacuum_file, write_transaction
from dagsync.errors import DagsyncError, UnsupportedDatabase
from dagsync import blobs
from dagsync.formats import Collect, Key, PackedColumn, Table

__all__ = ["DEFAULT_GRACE", "GcReport", "GcTable", "VacuumReport", "gc", "parse_grace"]

Progress = Callable[[str, int, int], None]

DEFAULT_GRACE = "14d"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# Statements and write transactions aim for this long (see db.Pacer): far
# below the 5 s a live llm waits for a lock.
TARGET_SECONDS = 0.8
FIRST_CHUNK = 2000
MAX_READ_CHUNK = 200_000
MAX_WRITE_CHUNK = 50_000

SEEN = "_dagsync_gc_seen"
MESSAGE_MAP = "_dagsync_message_map"
# Dependent-row states in temp.gc_dep.
DYING, UNREFERENCED_OLD, WAITING = 1, 2, 3


@dataclass(frozen=True)
class GcTable:
    table: str
    deleted: int = 0
    bytes: int = 0  # the deleted rows' column values, in bytes
    waiting: int = 0  # unreachable or unreferenced, kept until the grace period has passed


@dataclass(frozen=True)
class GcReport:
    path: str
    format: str
    dry_run: bool
    grace_seconds: float
    roots: int  # distinct messages roots point at
    reachable: int  # messages reached from a root
    unreachable: int  # messages no root reaches
    kept_by_grace: int  # unreachable messages kept: inside the grace period, or reached by one that is
    kept_as_new: int  # candidates the sweep found reachable again (written meanwhile)
    merge_in_progress: bool  # a merge into the file was under way: messages were left for the next run
    tables: tuple[GcTable, ...]
    deleted: int  # rows, every table
    deleted_bytes: int
    file_bytes: int
    vacuum: VacuumReport | None
    seconds: float

    def table(self, name: str) -> GcTable:
        return next((t for t in self.tables if t.table == name), GcTable(name))


def parse_grace(text: str) -> float:
    """Seconds in a grace period written like ``0s``, ``30m``, ``12h``, ``14d``, ``2w`` or ``1d12h``.

    :raises DagsyncError: anything else.
    """
    spec = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw])", spec)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhdw])", "", spec).strip():
        raise DagsyncError(
            f"invalid grace period {text!r}: give a number and a unit (s, m, h, d or w), "
            "e.g. 0s, 12h, 14d or 2w"
        )
    return float(sum(float(n) * _UNITS[unit] for n, unit in parts))


def gc(
    path: str | os.PathLike[str],
    *,
    grace: float | str = DEFAULT_GRACE,
    dry_run: bool = False,
    vacuum: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Delete from ``path`` what no root reaches, older than ``grace``; return what was (or would be) deleted.

    ``grace`` is seconds or a string for ``parse_grace``; ``now`` (unix time)
    is for tests. With ``dry_run`` nothing is written and the report says
    what a real run would delete. ``vacuum`` then returns the freed space to
    the file system (incrementally when the file allows it).

    :raises NotADatabase, UnsupportedDatabase: a file dagsync cannot read.
    :raises DagsyncError: an invalid grace period.
    """
    started = time.perf_counter()
    grace_seconds = parse_grace(grace) if isinstance(grace, str) else float(grace)
    if grace_seconds < 0:
        raise DagsyncError(f"invalid grace period {grace!r}: it cannot be negative")
    db = open_target(path)
    try:
        _check_migrations(db)
        run = _Gc(db, grace_seconds, time.time() if now is None else now, dry_run, progress)
        try:
            run.mark()
            run.sweep()
            run.sweep_shared()
            run.record()
            tables = run.tables()
        finally:
            run.drop_temp()
        vacuumed = vacuum_file(db, progress) if vacuum and not dry_run else None
        return GcReport(
            path=str(path),
            format=db.format.name,
            dry_run=dry_run,
            grace_seconds=grace_seconds,
            roots=run.root_count,
            reachable=run.reachable,
            unreachable=run.unreachable,
            kept_by_grace=run.kept_by_grace,
            kept_as_new=run.kept_as_new,
            merge_in_progress=run.merge_in_progress,
            tables=tables,
            deleted=sum(t.deleted for t in tables),
            deleted_bytes=sum(t.bytes for t in tables),
            file_bytes=Path(path).stat().st_size,
            vacuum=vacuumed,
            seconds=round(time.perf_counter() - started, 3),
        )
    finally:
        db.close()


def _check_migrations(db: Database) -> None:
    """Refuse a file a newer llm has migrated: its new tables may point at rows gc would delete.

    :raises UnsupportedDatabase: a migration the format does not know.
    """
    fmt = db.format
    if not fmt.migration_gate or not bookkeeping.has(db.conn, "_llm_migrations"):
        return
    number = (lambda name: name.split("_", 1)[0]) if fmt.migration_gate == "number" else (lambda name: name)
    known = {number(name) for name in fmt.migrations}
    unknown = sorted(name for (name,) in db.conn.execute("SELECT name FROM _llm_migrations") if number(name) not in known)
    if unknown:
        raise UnsupportedDatabase(
            f"{db.path} was written by a newer llm than this dagsync knows (migration(s) {', '.join(unknown)}); "
            "gc cannot tell what its new tables point at, so it deletes nothing: update dagsync"
        )


@dataclass(frozen=True)
class _Shared:
    """A table of shared rows, deleted when nothing references them (``Collect.UNREFERENCED``)."""

    name: str
    pk: str
    columns: tuple[str, ...]
    refs: tuple[tuple[str, str], ...]  # (table, column) foreign keys pointing at it
    markers: tuple[PackedColumn, ...] = ()  # packed values pointing at it (the blob store)
    keep: str = "0"  # SQL over alias d: never delete this row


def _bytes(columns: tuple[str, ...], alias: str) -> str:
    """SQL for the bytes a row's values take (text as UTF-8, numbers as written)."""
    return " + ".join(f'coalesce(length(CAST({alias}."{c}" AS BLOB)), 0)' for c in columns) or "0"


class _Gc:
    def __init__(self, db: Database, grace: float, now: float, dry_run: bool, progress: Progress | None) -> None:
        self.db = db
        self.conn = db.conn
        self.fmt = db.format
        self.now = now
        self.cutoff = now - grace
        self.dry_run = dry_run
        self.progress = progress or (lambda phase, done, total: None)
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
            _Shared(
                t.name, self.fmt.primary_key(t.name), self.fmt.columns[t.name],
                tuple(dict.fromkeys([*self.fmt.referrers(t.name), *((o, c) for o, c, ref in file_refs if ref == t.name)])),
            )
            for t in self.fmt.tables
            if t.collect is Collect.UNREFERENCED and t.name in self.present
        ]  # fmt: skip
        if blobs.is_packed(self.conn):
            # The blob store (blobs.py): blobs nothing refers to, then dictionaries
            # no blob uses - but never the one new rows are packed with.
            markers = tuple(c for c in self.fmt.packed if c.table in self.present)
            self.shared += [
                _Shared("blobs", "hash", ("hash", "size", "dict", "data"), (), markers),
                _Shared(
                    "blob_dicts", "hash", ("hash", "data"), (("blobs", "dict"),),
                    keep="d.hash IN (SELECT value FROM main._dagsync_meta WHERE key = 'pack_dict')",
                ),
            ]  # fmt: skip
        self.generation = blobs.generation(self.conn)
        self.deleted: dict[str, list[int]] = {}
        self.waiting: dict[str, int] = {}
        self.root_count = self.reachable = self.unreachable = self.kept_by_grace = self.kept_as_new = 0
        self.dying_tables: set[str] = set()
        # The sweep kept a row it meant to delete (written to meanwhile).
        self.kept_back = False
        self.merge_in_progress = False
        self.refs_made = False

    # -- plumbing ------------------------------------------------------------

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.conn.execute(sql, params):
            return row[0]
        return None

    def ranges(
        self, table: str, phase: str | None = None, writes: bool = False, where: str = "1"
    ) -> Iterator[tuple[int, int]]:
        """``db.rowid_ranges`` over ``table`` (``temp.x`` or a main table), with progress."""
        pacer = Pacer(MAX_WRITE_CHUNK if writes else MAX_READ_CHUNK, FIRST_CHUNK, TARGET_SECONDS)
        first = top = None
        for low, high in rowid_ranges(self.conn, table, pacer, where):
            if first is None:
                first, top = low, self.one(f"SELECT max(rowid) FROM {table} WHERE {where}")
            yield low, high
            if phase:
                self.progress(phase, min(high, top) - first + 1, top - first + 1)

    def transaction(self) -> Any:
        """A write transaction, or nothing for a dry run (which only reads)."""
        return nullcontext() if self.dry_run else write_transaction(self.conn)

    def main_table(self, name: str) -> str:
        return f'main."{name}"'

    def delete(self, name: str, where: str, columns: tuple[str, ...] | None = None) -> None:
        """Count, then (unless a dry run) delete, the rows of table ``name`` matching ``where`` (alias ``t``).

        ``where`` is evaluated once: the rows' rowids and sizes are gathered
        first, then counted and deleted by rowid.
        """
        columns = columns or self.fmt.columns[name]
        self.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_rows (rid INTEGER PRIMARY KEY, size INTEGER)")
        self.conn.execute("DELETE FROM temp.gc_rows")
        self.conn.execute(f'INSERT INTO temp.gc_rows SELECT t.rowid, {_bytes(columns, "t")} FROM main."{name}" t WHERE {where}')
        rows, size = next(self.conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM temp.gc_rows"))
        if rows and not self.dry_run:
            self.conn.execute(f'DELETE FROM main."{name}" WHERE rowid IN (SELECT rid FROM temp.gc_rows)')
        tally = self.deleted.setdefault(name, [0, 0])
        tally[0] += rows
        tally[1] += size

    def drop_temp(self) -> None:
        if self.conn.in_transaction and self.dry_run:
            self.conn.execute("ROLLBACK")
        for (name,) in list(self.conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table'")):
            self.conn.execute(f'DROP TABLE temp."{name}"')

    def has_seen_table(self) -> bool:
        return SEEN in self.present

    # -- 1. mark -------------------------------------------------------------

    def unchanged(self) -> bool:
        """No other connection has committed to the file since the mark began."""
        return self.one("PRAGMA data_version") == self.data_version

    def mark(self) -> None:
        # Before the first read: if this never changes, the mark saw one
        # consistent file and the sweep need not check it again.
        self.data_version = self.one("PRAGMA data_version")
        self.mark_messages()
        self.mark_candidates()
        for table in self.shared:
            self.mark_shared(table)

    def young(self, alias: str) -> str:
        """SQL true when the message ``alias`` is inside the grace period by its own time."""
        if self.fmt.message_time is None:
            return "0"
        # unixepoch() reads both spellings the dag format has; NULL (unreadable) counts as new.
        return f"NOT coalesce(unixepoch({alias}.\"{self.fmt.message_time}\", 'subsec') <= {self.cutoff!r}, 0)"

    def mark_messages(self) -> None:
        msgs, key, parent = self.main_table("messages"), self.key, self.parent
        self.conn.execute(
            "CREATE TEMP TABLE gc_node (rid INTEGER PRIMARY KEY, prid INTEGER, young INTEGER NOT NULL);"
            "CREATE TEMP TABLE gc_root (rid INTEGER);"
            "CREATE TEMP TABLE gc_live (rid INTEGER PRIMARY KEY);"
        )
        # The skeleton: each message's rowid, its parent's rowid, and whether it is new.
        for low, high in self.ranges(msgs, "gc: reading messages"):
            self.conn.execute(
                f'INSERT INTO temp.gc_node SELECT m.rowid, p.rowid, {self.young("m")} FROM {msgs} m '
                f'LEFT JOIN {msgs} p ON p."{key}" = m."{parent}" WHERE m.rowid BETWEEN ? AND ?',
                (low, high),
            )
        for table, column in self.roots:
            if table not in self.present:
                continue
            for low, high in self.ranges(self.main_table(table), f"gc: reading {table}"):
                self.conn.execute(
                    f'INSERT INTO temp.gc_root SELECT m.rowid FROM main."{table}" t '
                    f'JOIN {msgs} m ON m."{key}" = t."{column}" WHERE t.rowid BETWEEN ? AND ?',
                    (low, high),
                )
        if self.fmt.root_id is not None:
            self.conn.execute(
                f'INSERT INTO temp.gc_root SELECT rowid FROM {msgs} WHERE "{key}" = ?', (self.fmt.root_id,)
            )
        self.root_count = self.one("SELECT count(DISTINCT rid) FROM temp.gc_root")
        self.progress("gc: walking from the roots", 0, 1)
        self.conn.execute(
            "WITH RECURSIVE r(rid) AS ("
            " SELECT rid FROM temp.gc_root"
            " UNION SELECT n.prid FROM r JOIN temp.gc_node n ON n.rid = r.rid WHERE n.prid IS NOT NULL"
            ") INSERT INTO temp.gc_live SELECT rid FROM r"
        )
        self.conn.execute(
            "CREATE TEMP TABLE gc_unreach (rid INTEGER PRIMARY KEY, key TEXT, prid INTEGER,"
            " young INTEGER NOT NULL, keep INTEGER NOT NULL DEFAULT 0);"
            "INSERT INTO temp.gc_unreach (rid, prid, young) SELECT rid, prid, young FROM temp.gc_node"
            " WHERE rid NOT IN (SELECT rid FROM temp.gc_live);"
        )
        self.reachable = self.one("SELECT count(*) FROM temp.gc_node WHERE rid IN (SELECT rid FROM temp.gc_live)")
        self.unreachable = self.one("SELECT count(*) FROM temp.gc_unreach")
        for low, high in self.ranges("temp.gc_unreach", "gc: reading unreachable messages"):
            self.conn.execute(
                f'UPDATE temp.gc_unreach SET key = (SELECT m."{key}" FROM {msgs} m WHERE m.rowid = gc_unreach.rid) '
                "WHERE rid BETWEEN ? AND ?",
                (low, high),
            )
        if self.fmt.message_time is None:
            # No time on the rows: new until gc has seen them unreachable for the grace period.
            seen = (
                f"(SELECT key FROM main.{SEEN} WHERE tbl = 'messages' AND first_seen <= {self.cutoff!r})"
                if self.has_seen_table()
                else "(SELECT NULL WHERE 0)"
            )
            self.conn.execute(f"UPDATE temp.gc_unreach SET young = (key IS NULL OR key NOT IN {seen})")

    def mark_candidates(self) -> None:
        # A new unreachable message keeps everything it reaches.
        self.conn.execute(
            "WITH RECURSIVE y(rid) AS ("
            " SELECT rid FROM temp.gc_unreach WHERE young"
            " UNION SELECT u.prid FROM y JOIN temp.gc_unreach u ON u.rid = y.rid WHERE u.prid IS NOT NULL"
            ") UPDATE temp.gc_unreach SET keep = 1 WHERE rid IN (SELECT rid FROM y)"
        )
        self.kept_by_grace = self.one("SELECT count(*) FROM temp.gc_unreach WHERE keep")
        self.waiting["messages"] = self.kept_by_grace
        # Leaves first: depth from the candidates whose parent is not one, deepest first.
        self.conn.execute(
            "CREATE INDEX temp.gc_unreach_prid ON gc_unreach (prid);"
            "CREATE TEMP TABLE gc_cand (seq INTEGER PRIMARY KEY, key TEXT NOT NULL);"
            "WITH RECURSIVE d(rid, depth, top) AS ("
            " SELECT rid, 0, rid FROM temp.gc_unreach c WHERE NOT keep AND key IS NOT NULL"
            "   AND (prid IS NULL OR prid NOT IN (SELECT rid FROM temp.gc_unreach WHERE NOT keep))"
            " UNION ALL"
            " SELECT c.rid, d.depth + 1, d.top FROM d JOIN temp.gc_unreach c ON c.prid = d.rid"
            "   WHERE NOT c.keep AND c.rid != d.rid AND c.key IS NOT NULL"
            # Tree by tree (a deleted conversation's messages sit together in
            # the file), each leaves first: a chunk's deletes touch few pages.
            ") INSERT INTO temp.gc_cand (key) SELECT u.key FROM d JOIN temp.gc_unreach u USING (rid)"
            " ORDER BY d.top, d.depth DESC, d.rid DESC;"
            "CREATE UNIQUE INDEX temp.gc_cand_key ON gc_cand (key);"
        )

    def dying(self, table: Table, alias: str) -> str:
        """SQL true when row ``alias`` of ``table`` is to be deleted by this run: it goes with a
        candidate message, or it is a shared row classified for deletion (0 for other tables)."""
        shared = next((t for t in self.shared if t.name == table.name), None)
        if shared is not None and self.refs_made:
            return (
                f'{alias}."{shared.pk}" IN (SELECT key FROM temp.gc_dep WHERE tbl = \'{shared.name}\' '
                f"AND state IN ({DYING}, {UNREFERENCED_OLD}))"
            )
        if table.collect is not Collect.WITH_OWNER or table.owned_by is None:
            return "0"
        owner = self.fmt.table(self.fmt.references[table.name][table.owned_by])
        if owner.collect is Collect.UNREACHABLE:
            return f'{alias}."{table.owned_by}" IN (SELECT key FROM temp.gc_cand)'
        column = self.fmt.referenced_columns[table.name][table.owned_by]
        dying = f"gc_dying_{owner.name}"
        if dying not in self.dying_tables:
            # The owner's dying keys, gathered once (a candidate's parts, say).
            self.conn.execute(f"CREATE TEMP TABLE {dying} (key PRIMARY KEY)")
            inner = self.dying(owner, "o")
            for low, high in self.ranges(self.main_table(owner.name)):
                self.conn.execute(
                    f'INSERT OR IGNORE INTO temp.{dying} SELECT o."{column}" FROM main."{owner.name}" o '
                    f"WHERE o.rowid BETWEEN ? AND ? AND {inner}",
                    (low, high),
                )
            self.dying_tables.add(dying)
        return f'{alias}."{table.owned_by}" IN (SELECT key FROM temp.{dying})'

    def mark_shared(self, table: _Shared) -> None:
        """Classify each row of a shared table: referenced by a survivor, only by dying rows, or by nothing."""
        if not self.refs_made:
            self.conn.execute(
                "CREATE TEMP TABLE gc_ref (tbl TEXT, key, dying INTEGER);"
                "CREATE INDEX temp.gc_ref_key ON gc_ref (tbl, key, dying);"
                "CREATE TEMP TABLE gc_dep (tbl TEXT, key, state INTEGER, PRIMARY KEY (tbl, key));"
            )
            self.refs_made = True
        for other, column in table.refs:
            if other not in self.present:
                continue
            referrer = next((t for t in self.fmt.tables if t.name == other), Table(other, Key.TEXT))
            for low, high in self.ranges(self.main_table(other), f"gc: reading {other}"):
                self.conn.execute(
                    f'INSERT INTO temp.gc_ref SELECT ?, t."{column}", {self.dying(referrer, "t")} '
                    f'FROM main."{other}" t WHERE t.rowid BETWEEN ? AND ? AND t."{column}" IS NOT NULL',
                    (table.name, low, high),
                )
        for ref in self.fmt.payload_refs:
            if ref.target != table.name or ref.table not in self.present:
                continue
            referrer = self.fmt.table(ref.table)
            needle = '"' + re.split(r"[.\[]", ref.path.removeprefix("$."))[0] + '"'
            value = f't."{ref.column}"'
            packed = next((c for c in self.fmt.packed if (c.table, c.column) == (ref.table, ref.column)), None)
            if packed is not None and blobs.is_packed(self.conn):
                # A packed payload is read through its blob.
                blobs.register_functions(self.conn)
                value = f"(CASE WHEN {blobs.marker_sql(packed, 't')} THEN CAST(dagsync_unpack({value}, 'text') AS TEXT) ELSE {value} END)"
            for low, high in self.ranges(self.main_table(ref.table), f"gc: reading {ref.table}.{ref.column}"):
                self.conn.execute(
                    f'INSERT INTO temp.gc_ref SELECT ?, j.value, {self.dying(referrer, "t")} '
                    f"FROM main.\"{ref.table}\" t, json_tree({value}) j "
                    f"WHERE t.rowid BETWEEN ? AND ? AND instr({value}, ?) "
                    # SQLite quotes some labels in fullkey ($."text_ref"[0]): compare without quotes.
                    f"AND json_valid({value}) AND replace(j.fullkey, '\"', '') GLOB ?",
                    (table.name, low, high, needle, ref.glob),
                )
        for packed in table.markers:
            referrer = self.fmt.table(packed.table)
            ref = f'substr(CAST(t."{packed.column}" AS TEXT), {len(blobs.PREFIX) + 1})'
            for low, high in self.ranges(self.main_table(packed.table), f"gc: reading {packed.table}.{packed.column}"):
                self.conn.execute(
                    f'INSERT INTO temp.gc_ref SELECT ?, {ref}, {self.dying(referrer, "t")} FROM main."{packed.table}" t '
                    f"WHERE t.rowid BETWEEN ? AND ? AND {blobs.marker_sql(packed, 't')}",
                    (table.name, low, high),
                )
        pk = table.pk
        seen = (
            f"(SELECT first_seen FROM main.{SEEN} s WHERE s.tbl = ?1 AND s.key = CAST(d.\"{pk}\" AS TEXT))"
            if self.has_seen_table()
            else "NULL"
        )
        for low, high in self.ranges(self.main_table(table.name), f"gc: reading {table.name}"):
            self.conn.execute(
                f'INSERT INTO temp.gc_dep SELECT ?1, d."{pk}", CASE '
                f'WHEN EXISTS (SELECT 1 FROM temp.gc_ref r WHERE r.tbl = ?1 AND r.key = +d."{pk}") THEN {DYING} '
                f"WHEN {seen} <= ?4 THEN {UNREFERENCED_OLD} ELSE {WAITING} END "
                f'FROM main."{table.name}" d WHERE d.rowid BETWEEN ?2 AND ?3 AND NOT ({table.keep}) AND NOT EXISTS '
                # +d.pk: no affinity on the right, so the index on gc_ref (tbl, key)
                # is used for the key too (an INTEGER id would make it numeric).
                f'(SELECT 1 FROM temp.gc_ref r WHERE r.tbl = ?1 AND r.key = +d."{pk}" AND NOT r.dying)',
                (table.name, low, high, self.cutoff),
            )
        self.waiting[table.name] = self.one(
            "SELECT count(*) FROM temp.gc_dep WHERE tbl = ? AND state = ?", (table.name, WAITING)
        )

    # -- 2. sweep ------------------------------------------------------------

    def sweep(self) -> None:
        if not self.dry_run and self.shared:
            self.mark_dying_as_old()
        self.conn.execute("CREATE TEMP TABLE gc_chunk (key TEXT PRIMARY KEY)")
        total = self.one("SELECT count(*) FROM temp.gc_cand")
        done = 0
        for low, high in self.ranges("temp.gc_cand", writes=True):
            with self.transaction():
                if bookkeeping.merge_running(self.db.path):
                    # Messages a merge has copied look old and unreachable until
                    # its last steps point at them: leave the rest to the next run.
                    self.merge_in_progress = self.kept_back = True
                    break
                self.conn.execute("DELETE FROM temp.gc_chunk")
                self.conn.execute("INSERT INTO temp.gc_chunk SELECT key FROM temp.gc_cand WHERE seq BETWEEN ? AND ?", (low, high))
                self.protect(high)
                where = f't."{self.key}" IN (SELECT key FROM temp.gc_chunk)'
                self.delete_owned(self.messages, where)
                self.delete(self.messages.name, where)
                if not self.dry_run:
                    if MESSAGE_MAP in self.present:
                        self.conn.execute(f"DELETE FROM main.{MESSAGE_MAP} WHERE target_id IN (SELECT key FROM temp.gc_chunk)")
                    if self.has_seen_table():
                        self.conn.execute(
                            f"DELETE FROM main.{SEEN} WHERE tbl = 'messages' AND key IN (SELECT key FROM temp.gc_chunk)"
                        )
            done += high - low + 1
            self.progress("gc: deleting messages", done, total)

    def protect(self, high: int) -> None:
        """Take out of the chunk (and the candidates) every message the file as it is now still needs.

        Kept: a message a root points at, one that is new by its own time,
        and one with a child that is not a candidate of this or an earlier
        chunk (written since the mark, or kept) - and then its parent, and so on.
        """
        if self.unchanged():
            return  # nothing but this gc has written since the mark: it stands as it is
        msgs = self.main_table("messages")
        found = [
            f'SELECT t."{column}" FROM main."{table}" t WHERE t."{column}" IN (SELECT key FROM temp.gc_chunk)'
            for table, column in self.roots
            if table in self.present
        ]
        if self.fmt.message_time is not None:
            found.append(
                f'SELECT m."{self.key}" FROM {msgs} m WHERE m."{self.key}" IN (SELECT key FROM temp.gc_chunk) '
                f"AND {self.young('m')}"
            )
        children = (
            # CROSS JOIN: look each chunk member's children up by the parent index
            # (left to itself the planner may scan every message per chunk).
            f'SELECT c.key FROM temp.gc_chunk c CROSS JOIN {msgs} ch ON ch."{self.parent}" = c.key '
            f'WHERE ch."{self.key}" != c.key AND NOT EXISTS '
            f'(SELECT 1 FROM temp.gc_cand k WHERE k.key = ch."{self.key}" AND k.seq <= {int(high)})'
        )
        query = " UNION ".join([*found, children])
        self.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_kept (key TEXT PRIMARY KEY)")
        while True:
            self.conn.execute("DELETE FROM temp.gc_kept")
            self.conn.execute(f"INSERT INTO temp.gc_kept {query}")
            kept = self.one("SELECT count(*) FROM temp.gc_kept")
            if not kept:
                return
            self.kept_as_new += kept
            self.kept_back = True
            self.conn.execute("DELETE FROM temp.gc_cand WHERE key IN (SELECT key FROM temp.gc_kept)")
            self.conn.execute("DELETE FROM temp.gc_chunk WHERE key IN (SELECT key FROM temp.gc_kept)")
            # Their parents in this chunk now have a child that stays: look again.
            query = children

    def delete_owned(self, table: Table, where: str) -> None:
        """Delete the rows collected with the rows of ``table`` matching ``where``, deepest first."""
        for child in self.fmt.tables:
            if child.collect is not Collect.WITH_OWNER or child.name not in self.present:
                continue
            if self.fmt.references[child.name].get(child.owned_by or "") != table.name:
                continue
            column = self.fmt.referenced_columns[child.name][child.owned_by]  # type: ignore[index]
            if table is self.messages and column == self.key:
                keys = "temp.gc_chunk"  # the chunk's own keys
            else:
                # The owners' keys, gathered once for every child and grandchild.
                keys = f'temp."gc_keys_{table.name}_{column}"'
                self.conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {keys.removeprefix('temp.')} (key PRIMARY KEY)")
                self.conn.execute(f"DELETE FROM {keys}")
                self.conn.execute(
                    f'INSERT OR IGNORE INTO {keys} SELECT t."{column}" FROM main."{table.name}" t WHERE {where}'
                )
            child_where = f't."{child.owned_by}" IN (SELECT key FROM {keys})'
            self.delete_owned(child, child_where)
            self.delete(child.name, child_where)

    def mark_dying_as_old(self) -> None:
        """Record the shared rows only candidates reference as past their grace period.

        If this run is interrupted after deleting their last references, the
        next run finds them unreferenced and old, and deletes them.
        """
        self.ensure_seen()
        for low, high in self.ranges("temp.gc_dep", writes=True, where=f"state = {DYING}"):
            with write_transaction(self.conn):
                self.conn.execute(
                    f"INSERT OR REPLACE INTO main.{SEEN} (tbl, key, first_seen) "
                    f"SELECT tbl, CAST(key AS TEXT), 0 FROM temp.gc_dep WHERE state = {DYING} AND rowid BETWEEN ? AND ?",
                    (low, high),
                )

    def ensure_seen(self) -> None:
        if not self.has_seen_table():
            with write_transaction(self.conn):
                bookkeeping.ensure(self.conn)
            self.present.add(SEEN)

    # -- 3. shared rows --------------------------------------------------------

    def sweep_shared(self) -> None:
        if not self.shared:
            return
        self.conn.execute("CREATE TEMP TABLE gc_dep_chunk (key PRIMARY KEY)")
        for table in self.shared:
            pk = table.pk
            where = f"tbl = '{table.name}' AND state IN ({DYING}, {UNREFERENCED_OLD})"
            for low, high in self.ranges("temp.gc_dep", writes=True, where=where):
                with self.transaction():
                    self.conn.execute("DELETE FROM temp.gc_dep_chunk")
                    self.conn.execute(
                        f"INSERT INTO temp.gc_dep_chunk SELECT key FROM temp.gc_dep WHERE {where} AND rowid BETWEEN ? AND ?",
                        (low, high),
                    )
                    if not self.dry_run:
                        before = self.one("SELECT count(*) FROM temp.gc_dep_chunk")
                        if bookkeeping.merge_running(self.db.path):
                            # A merge's plan may have matched these rows: next run.
                            self.merge_in_progress = self.kept_back = True
                            self.conn.execute("DELETE FROM temp.gc_dep_chunk")
                        if table.markers and blobs.generation(self.conn) != self.generation:
                            # Blob references are not indexed, so they are not looked
                            # up again here: if pack or merge wrote some since the
                            # mark, leave the store to the next run.
                            self.conn.execute("DELETE FROM temp.gc_dep_chunk")
                        if self.kept_back:
                            # The sweep kept rows it meant to delete; what only they
                            # used may be referenced in ways not looked up again here
                            # (inside JSON, by blob reference): keep it this time.
                            self.conn.execute(
                                f"DELETE FROM temp.gc_dep_chunk WHERE key IN (SELECT key FROM temp.gc_dep "
                                f"WHERE tbl = ? AND state = {DYING})",
                                (table.name,),
                            )
                        # A reference written since the mark, or kept by the sweep, keeps the row.
                        for other, column in table.refs if self.kept_back or not self.unchanged() else ():
                            if other in self.present:
                                self.conn.execute(
                                    f'DELETE FROM temp.gc_dep_chunk WHERE key IN (SELECT t."{column}" '
                                    f'FROM main."{other}" t WHERE t."{column}" IN (SELECT key FROM temp.gc_dep_chunk))'
                                )
                        if self.one("SELECT count(*) FROM temp.gc_dep_chunk") != before:
                            self.kept_back = True
                    self.delete(table.name, f't."{pk}" IN (SELECT key FROM temp.gc_dep_chunk)', table.columns)
                    if not self.dry_run:
                        self.conn.execute(
                            f"DELETE FROM main.{SEEN} WHERE tbl = ? AND key IN "
                            "(SELECT CAST(key AS TEXT) FROM temp.gc_dep_chunk)",
                            (table.name,),
                        )
                self.progress(f"gc: deleting {table.name}", high, high)

    # -- 4. record -------------------------------------------------------------

    def record(self) -> None:
        """Start the grace clock for what waits; forget what is reachable or referenced again."""
        if self.dry_run:
            return
        timeless = self.fmt.message_time is None
        waiting = (timeless and self.kept_by_grace) or any(self.waiting.get(t.name) for t in self.shared)
        if not waiting and not self.has_seen_table():
            return  # nothing to remember, and no table to tidy: write nothing
        self.ensure_seen()
        if timeless:
            for low, high in self.ranges("temp.gc_unreach", writes=True, where="keep AND key IS NOT NULL"):
                with write_transaction(self.conn):
                    self.conn.execute(
                        f"INSERT OR IGNORE INTO main.{SEEN} (tbl, key, first_seen) SELECT 'messages', key, ? "
                        "FROM temp.gc_unreach WHERE keep AND key IS NOT NULL AND rowid BETWEEN ? AND ?",
                        (self.now, low, high),
                    )
        for low, high in self.ranges("temp.gc_dep", writes=True, where=f"state = {WAITING}"):
            with write_transaction(self.conn):
                self.conn.execute(
                    f"INSERT OR IGNORE INTO main.{SEEN} (tbl, key, first_seen) SELECT tbl, CAST(key AS TEXT), ? "
                    f"FROM temp.gc_dep WHERE state = {WAITING} AND rowid BETWEEN ? AND ?",
                    (self.now, low, high),
                )
        # Entries for rows this run found reachable or referenced.
        self.conn.execute("CREATE TEMP TABLE gc_unseen (tbl TEXT, key TEXT, PRIMARY KEY (tbl, key))")
        self.conn.execute("CREATE INDEX temp.gc_unreach_key ON gc_unreach (key)")
        has_dep = self.refs_made
        for low, high in self.ranges(f"main.{SEEN}"):
            self.conn.execute(
                f"INSERT INTO temp.gc_unseen SELECT s.tbl, s.key FROM main.{SEEN} s WHERE s.rowid BETWEEN ? AND ? AND "
                "CASE WHEN s.tbl = 'messages' THEN s.key NOT IN (SELECT key FROM temp.gc_unreach WHERE key IS NOT NULL) "
                + (
                    "ELSE NOT EXISTS (SELECT 1 FROM temp.gc_dep d WHERE d.tbl = s.tbl AND CAST(d.key AS TEXT) = s.key) END"
                    if has_dep
                    else "ELSE 1 END"
                ),
                (low, high),
            )
        for low, high in self.ranges("temp.gc_unseen", writes=True):
            with write_transaction(self.conn):
                self.conn.execute(
                    f"DELETE FROM main.{SEEN} WHERE (tbl, key) IN "
                    "(SELECT tbl, key FROM temp.gc_unseen WHERE rowid BETWEEN ? AND ?)",
                    (low, high),
                )

    def tables(self) -> tuple[GcTable, ...]:
        names = [t.name for t in self.fmt.tables if t.name in self.deleted or t.name in self.waiting]
        extra = [n for n in [*self.deleted, *self.waiting] if n not in names]
        extra = list(dict.fromkeys(extra))
        return tuple(
            GcTable(n, *self.deleted.get(n, (0, 0)), waiting=self.waiting.get(n, 0)) for n in [*names, *extra]
        )
