"""merge: copy every row of every source into a target, losing nothing.

One engine merges every table of a format, driven by the format's table
descriptions (``dagsync/formats``): how a table is keyed decides how its rows
are matched, and its foreign keys decide which columns are rewritten and in
which order tables are copied. For each source:

1. **Check** the source as untrusted input (its tables now, every page with
   ``quick_check`` in a background thread that the first write waits for:
   ``SourceChecks``), then attach it read-only to the target's connection.
2. **Plan** (reads only, writes nothing but temp tables): map every source
   message onto the target (``(mapped parent, content_hash)`` already there ->
   that row; else a new row), level by level from the root so a mapped parent
   carries its children with it; match integer-keyed rows by natural key;
   decide each mutable pointer (fast-forward, keep, or fork); find conflicts
   (a key on both sides with different content) and damage (a cycle, a
   dangling reference). Any conflict stops the merge here, before a write.
3. **Apply** in short write transactions, tables in reference order and
   messages parents-first, so that every commit point leaves no reference
   dangling and a ``kill -9`` at any moment leaves a consistent file that a
   re-run completes. No transaction holds the write lock for long: a llm
   writing the same file with a 5 s busy timeout never fails.

Re-running recomputes the plan from the files alone: rows already copied are
found by key, so a second merge writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import apsw
from ulid import ULID

from dagsync import blobs, bookkeeping, others
from dagsync.db import (
    Database,
    OpenedMeanwhile,
    Pacer,
    SourceChecks,
    long_transactions,
    open_target,
    open_unchecked_source,
    write_transaction,
)
from dagsync.errors import DagsyncError, DamagedSource, MergeConflict, UnsupportedDatabase
from dagsync.formats import Format, JsonRef, Key, Table
from dagsync.store import UlidFactory

__all__ = ["MergeReport", "SourceReport", "TableReport", "merge"]

Progress = Callable[[str, int, int], None]

# Message kinds in temp.msg_map.
SAME, MAPPED, NEW = 0, 1, 2
# The tables that hold the message DAG, however keyed.
MESSAGE_KEYS = (Key.DAG_MESSAGE, Key.HASH_MESSAGE)
# In temp tables a chain's start has parent 'root': the dag format's sentinel,
# and the llm format's NULL parent (its hashes all start "b2:").
TOP = "root"
# Pointer verdicts in temp.ptr.
FAST_FORWARD, KEEP, FORK = 1, 2, 3

# Aim for write transactions this long; chunk sizes adapt to it. Far below
# llm's 5 s busy timeout, and reads between them are bounded the same way.
TARGET_SECONDS = 0.8
# While no other process has had the target open, nobody waits for our lock,
# and one that opens it meanwhile waits for at most one transaction: write
# transactions may be this long (fewer commits, each rewriting the pages of
# the random-keyed indexes it touched). Still well inside a 5 s busy timeout.
ALONE_TARGET_SECONDS = 1.6
FIRST_CHUNK = 2000
MAX_READ_CHUNK = 100_000
# A write transaction's cost is less even than a read's (an FTS index may
# merge its segments in one of them), so write chunks stay smaller.
MAX_WRITE_CHUNK = 50_000
ALONE_MAX_WRITE_CHUNK = 200_000
MAX_CONFLICTS_SHOWN = 10
# A live writer that inserts a colliding row between plan and apply makes an
# insert fail; the merge then re-plans from the files, this many times.
ATTEMPTS = 3


@dataclass(frozen=True)
class TableReport:
    table: str
    added: int = 0  # rows copied into the target
    mapped: int = 0  # rows found in the target under another key
    existing: int = 0  # rows the target already had
    updated: int = 0  # pointers fast-forwarded
    forked: int = 0  # fork rows added for pointers that diverged


@dataclass(frozen=True)
class SourceReport:
    source: str
    format: str
    tables: tuple[TableReport, ...]

    def table(self, name: str) -> TableReport:
        return next(t for t in self.tables if t.table == name)

    @property
    def written(self) -> int:
        return sum(t.added + t.updated + t.forked for t in self.tables)


@dataclass(frozen=True)
class MergeReport:
    target: str
    created: bool
    dry_run: bool
    sources: tuple[SourceReport, ...]
    seconds: float


def merge(
    target: str | os.PathLike[str],
    sources: list[str | os.PathLike[str]],
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> MergeReport:
    """Merge each source into ``target``, in order; create ``target`` if it does not exist.

    A missing target is created (0600) with the first source's format. Sources
    are only read. With ``dry_run`` nothing is written anywhere and the report
    says what a real run would add, map and fork.

    :raises NotADatabase, UnsupportedDatabase: a file dagsync cannot read or trust.
    :raises DamagedSource: a source whose parent links or references are broken.
    :raises MergeConflict: a key with different content on the two sides.
    """
    started = time.perf_counter()
    if not sources:
        raise DagsyncError("no source databases given: merge TARGET SOURCE [SOURCE...]")
    target = Path(target)
    source_paths = [Path(s) for s in sources]
    # Check every source before writing to the target, so a bad one late in
    # the list cannot leave the target half-merged: the tables now, every
    # page (quick_check) in the background while the first source is
    # planned; nothing is written before both are done.
    formats = []
    for path in source_paths:
        if target.exists() and path.exists() and os.path.samefile(target, path):
            raise DagsyncError(f"{path} is the target itself; give another file as the source")
        with open_unchecked_source(path) as src:
            formats.append(src.format)
    checks = SourceChecks(source_paths)
    # An empty file is a target whose creation was interrupted: create it again.
    created = not target.exists() or target.stat().st_size == 0
    scratch = None
    if created and dry_run:
        # Plan against an empty database of the right format, then throw it away.
        scratch = tempfile.mkdtemp(prefix="dagsync-dry-run-")
        target_db = open_target(Path(scratch) / "target.db", create=formats[0])
    elif created:
        target_db = open_target(target, create=formats[0])
    else:
        target_db = open_target(target)
    reports: list[SourceReport] = []
    try:
        for path, fmt in zip(source_paths, formats, strict=True):
            if fmt is not target_db.format:
                raise UnsupportedDatabase(
                    f"{path} is in the {fmt.name} format but {target} is in the "
                    f"{target_db.format.name} format; dagsync merges files of the same format"
                )
            reports.append(_merge_one(target_db, path, checks, dry_run, progress))
    except BaseException:
        target_db.close()
        if created and not dry_run and not any(r.written for r in reports):
            _remove_database(target)
        raise
    finally:
        if scratch:
            target_db.close()
            shutil.rmtree(scratch, ignore_errors=True)
    target_db.close()
    return MergeReport(str(target), created, dry_run, tuple(reports), round(time.perf_counter() - started, 3))


def _remove_database(path: Path) -> None:
    """Remove a target this run created and never wrote history to."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _merge_one(
    target: Database, source: Path, checks: SourceChecks, dry_run: bool, progress: Progress | None
) -> SourceReport:
    # Marked from before the plan (which maps rows onto the target's) to the
    # end of the copy, so a gc beside it waits (see bookkeeping.merging).
    with bookkeeping.merging(target.path) if not dry_run else contextlib.nullcontext():
        return _merge_one_marked(target, source, checks, dry_run, progress)


def _merge_one_marked(
    target: Database, source: Path, checks: SourceChecks, dry_run: bool, progress: Progress | None
) -> SourceReport:
    for attempt in range(1, ATTEMPTS + 1):
        run = _SourceMerge(target, source, progress)
        try:
            try:
                run.attach()
                run.plan()
            except Exception:
                checks.wait()  # a damaged page explains any error better
                raise
            # Every source's pages checked before anything is written.
            checks.wait()
            if run.conflicts:
                shown = run.conflicts[:MAX_CONFLICTS_SHOWN]
                more = len(run.conflicts) - len(shown)
                raise MergeConflict(
                    f"{source} and {target.path} hold different content under the same "
                    f"key, so nothing was merged: {'; '.join(shown)}"
                    + (f"; and {more} more" if more > 0 else ""),
                    run.conflicts,
                )
            if not dry_run:
                # While nobody else has the target open, in long transactions.
                with long_transactions(target.conn):
                    run.apply()
                    if run.target_packed:
                        # A packed target stays packed: what arrived inline is packed
                        # with the target's settings, blobs the source has copied by key.
                        blobs.pack_new_rows(target, source_schema="src" if run.source_packed else None)
                run.flush_progress()
            return run.report()
        except OpenedMeanwhile:
            # A process opened the target in the middle of a long transaction,
            # which was rolled back for its sake; what was committed before is
            # consistent. Plan again from the files, and write politely from
            # now on (the file stays marked as opened by another: once only).
            if attempt == ATTEMPTS:
                raise DagsyncError(
                    f"another process kept opening {target.path} during the merge of {source}; "
                    "everything merged so far is consistent - run the merge again"
                ) from None
        except apsw.ConstraintError as exc:
            # Someone wrote a colliding row between plan and apply; every
            # commit so far is consistent, so plan again from the files.
            if attempt == ATTEMPTS:
                raise DagsyncError(
                    f"merging {source} into {target.path} kept colliding with rows written "
                    f"meanwhile ({exc}); everything merged so far is consistent - run the merge again"
                ) from exc
        finally:
            run.detach()
    raise AssertionError("unreachable")


def _quoted(columns: tuple[str, ...] | list[str], alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(f'{prefix}"{c}"' for c in columns)


def _message_conflict(src: str, id_parent: str, id_hash: str | None, parent: str, content_hash: str | None) -> str:
    return (
        f"message {src} is (parent {id_parent}, hash {(id_hash or '')[:12]}) in the target "
        f"but (parent {parent}, hash {(content_hash or '')[:12]}) in the source"
    )


@dataclass
class _Counts:
    added: int = 0
    mapped: int = 0
    existing: int = 0
    updated: int = 0
    forked: int = 0


class _SourceMerge:
    """One source into one target: plan, then apply."""

    def __init__(self, target: Database, source: Path, progress: Progress | None) -> None:
        self.db = target
        self.conn = target.conn
        self.fmt: Format = target.format
        self.source = source
        self.on_progress = progress or (lambda phase, done, total: None)
        self.pending_progress: tuple[str, int, int] | None = None
        self.conflicts: list[str] = []
        self.counts: dict[str, _Counts] = {t.name: _Counts() for t in self.fmt.merge_order}
        self.new_id = UlidFactory()
        self.attached = False
        self.columns = {t.name: self.fmt.columns[t.name] for t in self.fmt.merge_order}
        self.moved = 0  # source messages mapped onto another row (plan_messages)
        # New rows whose references resolve nowhere, by table, where a plan counted them.
        self.dangling_counted: dict[str, int] = {}

    # -- plumbing ------------------------------------------------------------

    def progress(self, phase: str, done: int, total: int) -> None:
        """Tell the caller, but only while no transaction is open: a callback
        that blocks (a terminal paused with Ctrl-S) must never hold the write
        lock. Inside a long transaction the latest report waits for a commit."""
        if self.conn.in_transaction:
            self.pending_progress = (phase, done, total)
            return
        self.pending_progress = None
        self.on_progress(phase, done, total)

    def flush_progress(self) -> None:
        if self.pending_progress is not None:
            self.progress(*self.pending_progress)

    def attach(self) -> None:
        uri = "file:" + urllib.parse.quote(str(self.source.resolve())) + "?mode=ro"
        self.conn.execute("ATTACH DATABASE ? AS src", (uri,))
        self.attached = True
        self.source_tables = {
            name for (name,) in self.conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")
        }
        self.source_packed = blobs.is_packed(self.conn, "src")
        self.target_packed = blobs.is_packed(self.conn, "main")
        self.packed_columns = {(c.table, c.column): c for c in self.fmt.packed}
        blobs.register_functions(self.conn)
        # The source may be a live llm database. Every read of it is bounded by
        # the highest rowid each table had at one instant (one read
        # transaction), so rows written during the merge wait for the next one
        # instead of arriving half-planned. llm writes a row's references in
        # the same transaction as the row, so the bounds are consistent.
        self.bounds: dict[str, int] = {}
        self.conn.execute("BEGIN")
        try:
            for table in self.fmt.merge_order:
                if table.name in self.source_tables:
                    self.bounds[table.name] = self.one(f'SELECT coalesce(max(rowid), 0) FROM src."{table.name}"')
        finally:
            self.conn.execute("COMMIT")

    def detach(self) -> None:
        if not self.attached:
            return
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        for (name,) in list(self.conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table'")):
            self.conn.execute(f'DROP TABLE temp."{name}"')
        self.conn.execute("DETACH DATABASE src")
        self.attached = False

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.conn.execute(sql, params):
            return row[0]
        return None

    def changes(self) -> int:
        return self.conn.changes()

    def chunks(
        self, schema_table: str, column: str = "rowid", phase: str | None = None, writes: bool = False
    ) -> Iterator[tuple[int, int]]:
        """Consecutive inclusive ``column`` ranges of about ``pacer.size`` rows each.

        Statements run one range at a time, so none holds a lock on a file
        for long, however big the table. A source table is read only up to
        its bound (see ``attach``). With ``phase``, progress is reported
        after each range. ``writes`` caps the range size lower: a write
        transaction's cost is less even (an FTS index merging its segments).
        """
        # Each loop learns its own pace from a small start: rows of one table
        # cost very differently from another's (an FTS-indexed response versus
        # a link row), and reads from writes.
        pacer = Pacer(MAX_WRITE_CHUNK if writes else MAX_READ_CHUNK, FIRST_CHUNK, TARGET_SECONDS)
        bound = ""
        source_table = schema_table.removeprefix("src.").strip('"') if schema_table.startswith("src.") else None
        if source_table in self.bounds:
            # The snapshot bound is on the rowid, whatever column the chunks follow.
            bound = f" AND rowid <= {int(self.bounds[source_table])}"
        low = self.one(f"SELECT min({column}) FROM {schema_table} WHERE 1{bound}")
        first = low
        arithmetic = isinstance(low, int) and (not bound or column in ("rowid", "id"))
        total = 0
        if phase and arithmetic:
            # Progress in key ranges: counting rows would read the whole table.
            total = self.one(f"SELECT max({column}) FROM {schema_table} WHERE 1{bound}") - low + 1
        elif phase:
            total = self.one(f"SELECT count(*) FROM {schema_table} WHERE 1{bound}")
        done = 0
        while low is not None:
            if arithmetic:
                # Integer keys are dense in practice: a range of the pacer's
                # size needs no scan to find its end (gaps only make it lighter).
                # A source's bound is on the rowid, which "id" is in an
                # integer-keyed table; callers' statements do not repeat it.
                high = low + pacer.size - 1
                if bound:
                    high = min(high, int(self.bounds[source_table]))
            else:
                high = self.one(
                    f"SELECT {column} FROM {schema_table} WHERE {column} >= ?{bound} "
                    f"ORDER BY {column} LIMIT 1 OFFSET ?",
                    (low, pacer.size - 1),
                )
                if high is None:
                    high = self.one(f"SELECT max({column}) FROM {schema_table} WHERE 1{bound}")
            started = time.perf_counter()
            yield low, high
            if writes:
                alone = not others.may_be_waiting(self.conn.filename)
                pacer.target = ALONE_TARGET_SECONDS if alone else TARGET_SECONDS
                pacer.largest = ALONE_MAX_WRITE_CHUNK if alone else MAX_WRITE_CHUNK
            pacer.timed(time.perf_counter() - started)
            if phase:
                if arithmetic:
                    done = min(total, high - first + 1)
                else:
                    done += self.one(f"SELECT count(*) FROM {schema_table} WHERE {column} BETWEEN ? AND ?", (low, high))
                self.progress(phase, done, total)
            low = self.one(f"SELECT min({column}) FROM {schema_table} WHERE {column} > ?{bound}", (high,))

    def present(self, table: Table) -> bool:
        return table.name in self.source_tables

    # -- how a source column becomes a target value ------------------------------

    def expr(self, table: Table, column: str, alias: str = "s", written: bool = False) -> str:
        """SQL for ``column`` of a source row, rewritten into the target's keys.

        ``written``: the value is written to the target. A reference to a
        message then comes from the plan's map, so a message the plan did not
        see (a live source's row changed since) is NULL, never dangling.
        """
        ref = self.fmt.references[table.name].get(column)
        if ref is not None and ref != table.name:
            ref_table = self.fmt.table(ref)
            if ref_table.key in MESSAGE_KEYS and written:
                return f'(SELECT dst FROM temp.msg_map WHERE src = {alias}."{column}")'
            if ref_table.key in MESSAGE_KEYS:
                # To compare or match: only messages mapped onto another row
                # move; most keep their id (check_dangling checks the source has them).
                raw = f'{alias}."{column}"'
                if not self.moved:
                    return raw
                return f"coalesce((SELECT dst FROM temp.msg_moved WHERE src = {raw}), {raw})"
            if ref_table.key is Key.INTEGER:
                return f'(SELECT dst FROM temp."map_{ref}" WHERE src = {alias}."{column}")'
        value = self.payload(table, column, alias)
        for json_ref in table.json_refs:
            if json_ref.column == column:
                # Only JSON that can hold ids goes through Python.
                return (
                    f"CASE WHEN {value} LIKE '%\"{json_ref.list_key}\"%' "
                    f"THEN {self.json_function(json_ref)}({value}) ELSE {value} END"
                )
        return value

    def payload(self, table: Table, column: str, alias: str = "s") -> str:
        """SQL for a source column as llm wrote it: a packed source's blob references
        resolved (a packed target packs them again after the merge)."""
        packed = self.packed_columns.get((table.name, column))
        value = f'{alias}."{column}"'
        if packed is not None and self.source_packed:
            # Only references go through Python; CAST keeps the payload's exact bytes.
            kind = "TEXT" if packed.holds == "text" else "BLOB"
            return (
                f"CASE WHEN {blobs.marker_sql(packed, alias)} "
                f"THEN CAST(dagsync_unpack_src({value}, '{packed.holds}') AS {kind}) ELSE {value} END"
            )
        return value

    def json_function(self, json_ref: JsonRef) -> str:
        """A SQL function rewriting ``json_ref``'s ids through the referenced table's map."""
        name = f"dagsync_remap_{json_ref.table}"

        def new_id(old: int) -> int:
            dst = self.one(f'SELECT dst FROM temp."map_{json_ref.table}" WHERE src = ?', (old,))
            if dst is None or dst < 0:
                raise DamagedSource(f"{self.source}: a {json_ref.column} refers to {json_ref.table} {old}, which is not mapped")
            return dst

        self.conn.create_scalar_function(name, lambda text: json_ref.rewrite(text, new_id), 1)
        return name

    def column_list(self, table: Table) -> str:
        return _quoted(self.columns[table.name])

    def natural_key(self, table: Table) -> tuple[str, ...]:
        if table.natural_key:
            return table.natural_key
        return tuple(c for c in self.columns[table.name] if c != "id")

    # -- plan ----------------------------------------------------------------------

    def plan(self) -> None:
        if self.fmt.migration_gate:
            self.check_migrations()
        order = [t for t in self.fmt.merge_order if self.present(t)]
        for step, table in enumerate(order):
            self.progress(f"planning {table.name}", step, len(order))
            if table.key in MESSAGE_KEYS:
                self.plan_messages(table)
            elif table.owner is not None:
                self.plan_owned(table)
            elif table.key is Key.INTEGER:
                self.plan_integer(table)
            else:
                self.plan_keyed(table)
            self.check_dangling(table)
            if table.pointer:
                self.plan_pointer(table)
        self.progress("planned", len(order), len(order))

    def check_migrations(self) -> None:
        """A source migrated further than the target may hold what the target's schema cannot."""
        if "_llm_migrations" not in self.source_tables:
            return
        same = "name" if self.fmt.migration_gate == "name" else "substr(name, 1, instr(name || '_', '_'))"
        ahead = [
            name for (name,) in self.conn.execute(
                f"SELECT name FROM src._llm_migrations WHERE {same} NOT IN "
                f"(SELECT {same} FROM main._llm_migrations) ORDER BY name"
            )
        ]  # fmt: skip
        if ahead:
            target = self.db.path
            raise UnsupportedDatabase(
                f"{self.source} was written by a newer llm than {target}: it has migration(s) "
                f"{', '.join(ahead)} that {target} lacks; open {target} once with that newer llm "
                f"(for example `llm logs -n 1 -d {target}`), which migrates it, then merge again"
            )

    def plan_messages(self, table: Table) -> None:
        """Map every source message onto the target, parents before children."""
        c = self.conn
        key, parent = self.fmt.message_key, self.fmt.parent_column
        if table.key is Key.DAG_MESSAGE:
            # Identity is (parent, content_hash): look for it under the mapped parent.
            identity = "content_hash"
            match = (
                "SELECT min(t.id) FROM main.messages t WHERE t.parent_id = lvl.p "
                f"AND t.content_hash = lvl.hash AND t.id != '{TOP}'"
            )
        else:
            # The key is a hash over parent and content: the key is the identity.
            identity = key
            match = f"SELECT t.{key} FROM main.messages t WHERE t.{key} = lvl.src"
        c.execute(
            "CREATE TEMP TABLE src_msg (rid INTEGER PRIMARY KEY, id TEXT NOT NULL, parent_id TEXT, hash TEXT)"
        )
        for low, high in self.chunks("src.messages"):
            c.execute(
                f"INSERT INTO temp.src_msg SELECT rowid, {key}, coalesce({parent}, '{TOP}'), {identity} "
                f"FROM src.messages WHERE rowid BETWEEN ? AND ? AND {key} != '{TOP}'",
                (low, high),
            )
        c.execute(
            "CREATE TEMP TABLE msg_map (src TEXT PRIMARY KEY, dst TEXT NOT NULL, parent TEXT NOT NULL, "
            "depth INTEGER NOT NULL, kind INTEGER NOT NULL) WITHOUT ROWID"
        )
        c.execute("CREATE INDEX temp.msg_map_depth ON msg_map (depth)")
        c.execute(f"INSERT INTO temp.msg_map VALUES ('{TOP}', '{TOP}', '{TOP}', 0, 0)")
        # A message the target holds under its own id, with the same parent
        # and identity, is that row whatever its depth (its parent is there
        # too, by the same token). One bounded pass settles all of those - in
        # a re-merge, everything - and the levels below start from them.
        if table.key is Key.DAG_MESSAGE:
            unchanged = f"coalesce(t.{parent}, '{TOP}') = s.parent_id AND t.{identity} IS s.hash"
        else:
            unchanged = "1"  # the hash covers the parent: the same hash is the same message
        # In key order, so the lookups walk the target's key index in order too.
        c.execute("CREATE UNIQUE INDEX temp.src_msg_id ON src_msg (id)")
        for low, high in self.chunks("temp.src_msg", "id"):
            c.execute(
                f"INSERT INTO temp.msg_map SELECT s.id, s.id, s.parent_id, 0, {SAME} FROM temp.src_msg s "
                f"JOIN main.messages t ON t.{key} = s.id WHERE s.id BETWEEN ? AND ? AND {unchanged} "
                "ORDER BY s.id",
                (low, high),
            )
        c.execute(
            "CREATE TEMP TABLE lvl (src TEXT NOT NULL, p TEXT NOT NULL, hash TEXT, match TEXT, "
            "id_exists INTEGER, id_parent TEXT, id_hash TEXT)"
        )
        c.execute("CREATE INDEX temp.lvl_identity ON lvl (p, hash)")
        total = self.one("SELECT count(*) FROM temp.src_msg")
        # "depth" counts rounds out from what is settled: a row's parent is
        # always settled a round before it, so round order is parents first.
        depth, done = 0, self.one("SELECT count(*) FROM temp.msg_map") - 1
        # The first round starts from what is left unsettled (in a re-merge,
        # nothing), not from everything settled so far; later rounds from the
        # round before.
        # In key order, so the lookups walk msg_map's key in order too.
        c.execute(
            "CREATE TEMP TABLE unsettled AS SELECT s.rid, s.id, s.parent_id, s.hash FROM temp.src_msg s "
            "WHERE NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = s.id) ORDER BY s.id"
        )
        settled = table.key is Key.HASH_MESSAGE and self.all_new_in_order()
        # Children are looked up by parent only below what is settled (in a
        # re-merge, nothing is left), and only by the rounds.
        if not settled and self.one("SELECT 1 FROM temp.unsettled LIMIT 1"):
            c.execute("CREATE INDEX temp.src_msg_parent ON src_msg (parent_id)")
        if settled:
            # Keyed by identity: what the target lacks is new, as itself, and
            # the source's order already puts parents first. No rounds needed
            # (the rounds are also what name a dangling parent or a cycle).
            c.execute(f"INSERT INTO temp.msg_map SELECT id, id, parent_id, 1, {NEW} FROM temp.unsettled ORDER BY id")
        # A new message's descendants are new (see settle_below_new); only the
        # hash format, whose key is the identity, settles them without rounds.
        below_new = table.key is Key.DAG_MESSAGE
        while not settled:
            c.execute("DELETE FROM temp.lvl")
            if depth == 0:
                c.execute(
                    "INSERT INTO temp.lvl (src, p, hash) SELECT u.id, m.dst, u.hash FROM temp.unsettled u "
                    "JOIN temp.msg_map m ON m.src = u.parent_id"
                )
            else:
                c.execute(
                    "INSERT INTO temp.lvl (src, p, hash) SELECT s.id, m.dst, s.hash FROM temp.src_msg s "
                    "JOIN temp.msg_map m ON m.src = s.parent_id WHERE m.depth = ? AND s.id NOT IN "
                    "(SELECT src FROM temp.msg_map)",
                    (depth,),
                )
            if self.changes() == 0:
                break
            for low, high in self.chunks("temp.lvl"):
                # Look the level up in the target: by identity, and by id.
                c.execute(
                    f"UPDATE temp.lvl SET match = ({match}), "
                    f"(id_exists, id_parent, id_hash) = (SELECT 1, coalesce(t.{parent}, '{TOP}'), t.{identity} "
                    f"FROM main.messages t WHERE t.{key} = lvl.src) "
                    "WHERE rowid BETWEEN ? AND ?",
                    (low, high),
                )
            for src, id_parent, id_hash, p, h in c.execute(
                "SELECT src, id_parent, id_hash, p, hash FROM temp.lvl WHERE id_exists "
                "AND (id_parent IS NOT p OR id_hash IS NOT hash) LIMIT ?",
                (MAX_CONFLICTS_SHOWN * 10,),
            ):
                self.conflicts.append(_message_conflict(src, id_parent, id_hash, p, h))
            # The message's own id when the target has it unchanged; else the
            # target's row with its identity; else a new row - the smallest
            # source id among source rows with the same identity, so duplicates
            # in a source without the unique index collapse as canonicalise would.
            c.execute(
                "INSERT INTO temp.msg_map (src, dst, parent, depth, kind) "
                "SELECT src, dst, p, ?, CASE WHEN dst = src AND NOT found THEN ? "
                "WHEN dst = src THEN ? ELSE ? END FROM ("
                "  SELECT l.src, l.p, "
                "  CASE WHEN l.id_exists AND l.id_parent IS l.p AND l.id_hash IS l.hash THEN l.src "
                "       WHEN l.match IS NOT NULL THEN l.match "
                "       ELSE (SELECT min(l2.src) FROM temp.lvl l2 WHERE l2.p = l.p AND l2.hash IS l.hash) "
                "  END AS dst, "
                "  (l.match IS NOT NULL OR coalesce(l.id_exists, 0)) AS found "
                "  FROM temp.lvl l)",
                (depth + 1, NEW, SAME, MAPPED),
            )
            done += self.one("SELECT count(*) FROM temp.lvl")
            if below_new:
                settled_below = self.settle_below_new(depth + 1)
                if settled_below is None:
                    below_new = False  # twins under a new parent: level by level from here
                else:
                    done += settled_below
            self.progress("mapping messages", done, total)
            depth += 1
        # Every map row but the root's is a settled source message.
        unreachable = total - (self.one("SELECT count(*) FROM temp.msg_map") - 1)
        if unreachable:
            example, parent = next(iter(c.execute(
                "SELECT id, parent_id FROM temp.src_msg WHERE id NOT IN (SELECT src FROM temp.msg_map) "
                "ORDER BY id LIMIT 1"
            )))  # fmt: skip
            dangling = self.one(
                f"SELECT count(*) FROM temp.src_msg s WHERE s.parent_id != '{TOP}' AND NOT EXISTS "
                "(SELECT 1 FROM temp.src_msg p WHERE p.id = s.parent_id)"
            )
            why = "a parent that does not exist" if dangling else "a cycle in the parent links"
            raise DamagedSource(
                f"{self.source}: {unreachable} message(s) do not lead back to the root "
                f"({why}; for example message {example} has parent {parent}); "
                "nothing was merged - run `dagsync verify` on the source"
            )
        c.execute("CREATE TEMP TABLE msg_new (seq INTEGER PRIMARY KEY, src TEXT NOT NULL, parent TEXT NOT NULL)")
        # New messages are inserted parents first, so every commit leaves each
        # one's parent in place. The source's own row order is that order in
        # any file written a message at a time (and it is the order of the
        # ids, so inserts land near each other in every index); where it is
        # not, depth order is.
        if settled:
            # Without rounds: every unsettled message is new, and
            # all_new_in_order found each one's parent settled or earlier.
            c.execute("INSERT INTO temp.msg_new (src, parent) SELECT id, parent_id FROM temp.unsettled ORDER BY rid")
        else:
            backwards = self.one(
                "SELECT count(*) FROM temp.msg_map c JOIN temp.src_msg cs ON cs.id = c.src "
                "JOIN temp.msg_map p ON p.src = cs.parent_id JOIN temp.src_msg ps ON ps.id = cs.parent_id "
                "WHERE c.kind = ? AND p.kind = ? AND ps.rid > cs.rid",
                (NEW, NEW),
            )
            order = "s.rid" if not backwards else "m.depth, m.src"
            c.execute(
                "INSERT INTO temp.msg_new (src, parent) SELECT m.src, m.parent FROM temp.msg_map m "
                f"JOIN temp.src_msg s ON s.id = m.src WHERE m.kind = ? ORDER BY {order}",
                (NEW,),
            )
        # Where a reference to a message goes: elsewhere only if it was mapped.
        c.execute("CREATE TEMP TABLE msg_moved (src TEXT PRIMARY KEY, dst TEXT NOT NULL) WITHOUT ROWID")
        c.execute("INSERT INTO temp.msg_moved SELECT src, dst FROM temp.msg_map WHERE kind = ? ORDER BY src", (MAPPED,))
        self.moved = self.changes()
        # "Is this message new?" is asked of every part and reference.
        c.execute("CREATE UNIQUE INDEX temp.msg_new_src ON msg_new (src)")
        counts = self.counts[table.name]
        for kind, n in c.execute(f"SELECT kind, count(*) FROM temp.msg_map WHERE src != '{TOP}' GROUP BY kind"):
            if kind == NEW:
                counts.added = n
            elif kind == MAPPED:
                counts.mapped = n
            else:
                counts.existing = n

    def settle_below_new(self, depth: int) -> int | None:
        """Settle every descendant of the messages the last round found new, at once.

        Below a message the target lacks, the target has nothing (no row of
        it has a parent it lacks), so no descendant can match one of its
        rows: each is new, under its own parent, unless two siblings share an
        identity (a source without the unique index), which the rounds
        collapse. Returns how many were settled, or None when such twins are
        there (nothing is settled then). A descendant whose id the target
        holds for another message is a conflict, as in the rounds.
        """
        c = self.conn
        c.execute("DROP TABLE IF EXISTS temp.below_new")
        c.execute(
            "CREATE TEMP TABLE below_new AS WITH RECURSIVE d(src, parent, hash, depth) AS ("
            "  SELECT s.id, s.parent_id, s.hash, m.depth + 1 FROM temp.msg_map m "
            "  JOIN temp.src_msg s ON s.parent_id = m.src WHERE m.depth = ? AND m.kind = ? "
            "  AND NOT EXISTS (SELECT 1 FROM temp.msg_map x WHERE x.src = s.id) "
            "  UNION ALL "
            "  SELECT s.id, s.parent_id, s.hash, d.depth + 1 FROM d JOIN temp.src_msg s ON s.parent_id = d.src "
            "  WHERE NOT EXISTS (SELECT 1 FROM temp.msg_map x WHERE x.src = s.id)"
            ") SELECT src, parent, hash, depth FROM d",
            (depth, NEW),
        )
        twins_below = self.one("SELECT 1 FROM temp.below_new GROUP BY parent, hash HAVING count(*) > 1 LIMIT 1")
        # A twin the last round mapped onto a new message: its children must
        # meet that message's children in one round.
        twins_now = self.one(
            "SELECT 1 FROM temp.msg_map m JOIN temp.msg_map n ON n.src = m.dst "
            "WHERE m.depth = ? AND m.kind = ? AND n.kind = ? LIMIT 1",
            (depth, MAPPED, NEW),
        )
        if twins_below or twins_now:
            return None
        for src, id_parent, id_hash, p, h in c.execute(
            f"SELECT b.src, coalesce(t.{self.fmt.parent_column}, '{TOP}'), t.content_hash, b.parent, b.hash "
            f"FROM temp.below_new b JOIN main.messages t ON t.{self.fmt.message_key} = b.src LIMIT ?",
            (MAX_CONFLICTS_SHOWN * 10,),
        ):
            self.conflicts.append(_message_conflict(src, id_parent, id_hash, p, h))
        # In key order: msg_map is keyed by src.
        c.execute(f"INSERT INTO temp.msg_map SELECT src, src, parent, depth, {NEW} FROM temp.below_new ORDER BY src")
        return self.changes()

    def all_new_in_order(self) -> bool:
        """Every unsettled message's parent is settled or unsettled-and-earlier in
        the source: no dangling parent, no cycle, and source order is parents first."""
        c = self.conn
        c.execute("CREATE INDEX temp.unsettled_id ON unsettled (id, rid)")  # covering: no row fetched
        # The earlier-unsettled parent first: it is most messages' (new chains).
        out_of_order = self.one(
            "SELECT count(*) FROM temp.unsettled u WHERE u.parent_id != ? "
            "AND NOT EXISTS (SELECT 1 FROM temp.unsettled p WHERE p.id = u.parent_id AND p.rid < u.rid) "
            "AND NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = u.parent_id)",
            (TOP,),
        )
        return out_of_order == 0

    def plan_owned(self, table: Table) -> None:
        """Rows that travel with their owner: counted for new owners, checked for clashes."""
        column, _ = table.owner  # type: ignore[misc]
        key = table.natural_key[0]
        added = 0
        rows = f'temp.msg_new n JOIN src."{table.name}" s ON s."{column}" = n.src'
        for low, high in self.chunks("temp.msg_new", "seq"):
            # One pass counts them and the ones whose key the target has.
            count, clashes = next(iter(self.conn.execute(
                f'SELECT count(*), count(t."{key}") FROM {rows} LEFT JOIN main."{table.name}" t '
                f'ON t."{key}" = s."{key}" WHERE n.seq BETWEEN ? AND ?',
                (low, high),
            )))  # fmt: skip
            added += count
            if not clashes:
                continue
            for (clash,) in self.conn.execute(
                f'SELECT s."{key}" FROM {rows} JOIN main."{table.name}" t ON t."{key}" = s."{key}" '
                "WHERE n.seq BETWEEN ? AND ? LIMIT ?",
                (low, high, MAX_CONFLICTS_SHOWN),
            ):
                self.conflicts.append(f"{table.name} {clash} belongs to a new message but is already in the target")
        self.counts[table.name].added = added

    def plan_integer(self, table: Table) -> None:
        """Match integer-keyed rows by natural key; the rest get new ids when applied.

        Equal rows are matched by rank: the k-th source row with a natural key
        (in id order) is the k-th target row with it. Two identical tool calls
        in one response stay two rows, and a merge cut short after copying the
        first copies only the second when re-run.
        """
        c = self.conn
        name = table.name
        nk = self.natural_key(table)
        keys = _quoted(nk)
        # "bad": a new row with a reference that resolves nowhere (where counted, see check_dangling).
        c.execute(
            f'CREATE TEMP TABLE "map_{name}" (src INTEGER PRIMARY KEY, dst INTEGER, new INTEGER NOT NULL, bad INTEGER)'
        )
        if self.unique_in_target(name, nk):
            self.plan_integer_unique(table, nk)
            return
        ranked = f"row_number() OVER (PARTITION BY {keys} ORDER BY id)"
        # The target's keys (and the source's, rewritten into the target's
        # terms) copied into indexed temp tables, read in bounded slices.
        c.execute(f'CREATE TEMP TABLE "tk_{name}" AS SELECT id, {keys}, 1 AS rnk FROM main."{name}" WHERE 0')
        for low, high in self.chunks(f'main."{name}"', "id"):
            c.execute(
                f'INSERT INTO temp."tk_{name}" SELECT id, {keys}, 1 FROM main."{name}" WHERE id BETWEEN ? AND ?',
                (low, high),
            )
        c.execute(
            f'CREATE TEMP TABLE "sk_{name}" (seq INTEGER PRIMARY KEY, id INTEGER NOT NULL, '
            f"{keys}, rnk INTEGER DEFAULT 1)"
        )
        mapped = ", ".join(self.expr(table, k) for k in nk)
        for low, high in self.chunks(f'src."{name}"', "id"):
            c.execute(
                f'INSERT INTO temp."sk_{name}" (id, {keys}) SELECT s.id, {mapped} FROM src."{name}" s '
                "WHERE s.id BETWEEN ? AND ? ORDER BY s.id",
                (low, high),
            )
        for side in ("tk", "sk"):
            # Every rank is 1 unless a key repeats (rare): only then count them.
            if self.one(f'SELECT 1 FROM temp."{side}_{name}" GROUP BY {keys} HAVING count(*) > 1 LIMIT 1'):
                c.execute(
                    f'UPDATE temp."{side}_{name}" SET rnk = r.n FROM (SELECT id, {ranked} AS n '
                    f'FROM temp."{side}_{name}") r WHERE "{side}_{name}".id = r.id'
                )
        c.execute(f'CREATE INDEX temp."tk_{name}_nk" ON "tk_{name}" ({keys}, rnk)')
        same = " AND ".join(f't."{k}" IS s."{k}"' for k in nk)
        # A new row's placeholder (-seq) is below every real id, so nothing
        # that refers to it can match a target row until apply gives it an id.
        c.execute(
            f'INSERT INTO temp."map_{name}" (src, dst, new) SELECT s.id, coalesce(m, -s.seq), m IS NULL FROM '
            f'(SELECT s.id, s.seq, (SELECT t.id FROM temp."tk_{name}" t WHERE {same} AND t.rnk = s.rnk) AS m '
            f'FROM temp."sk_{name}" s) s'
        )
        self.count_integer(name)

    def count_integer(self, name: str) -> None:
        counts = self.counts[name]
        counts.added = self.one(f'SELECT count(*) FROM temp."map_{name}" WHERE new')
        counts.mapped = self.one(f'SELECT count(*) FROM temp."map_{name}" WHERE NOT new AND dst != src')
        counts.existing = self.one(f'SELECT count(*) FROM temp."map_{name}" WHERE NOT new AND dst = src')

    def unique_in_target(self, table: str, columns: tuple[str, ...]) -> bool:
        """The target has a unique index on exactly these columns."""
        for _, index, unique, *_ in list(self.conn.execute(f'SELECT * FROM main.pragma_index_list("{table}")')):
            if unique and tuple(
                row[2] for row in self.conn.execute("SELECT * FROM main.pragma_index_info(?)", (index,))
            ) == tuple(columns):
                return True
        return False

    def plan_integer_unique(self, table: Table, nk: tuple[str, ...]) -> None:
        """A natural key the target keeps unique: look each source row up by it directly."""
        name = table.name
        low_id = self.one(f'SELECT coalesce(min(id), 0) FROM src."{name}"')
        same = " AND ".join(f't."{k}" IS {self.expr(table, k)}' for k in nk)
        found = f'(SELECT t.id FROM main."{name}" t WHERE {same})'
        # In natural-key order, so the lookups walk the target's unique index
        # in order; chunks of equal first-key values stay together.
        first = nk[0]
        # The same pass marks new rows whose references resolve nowhere.
        dangles = self.dangling_sql(table)
        insert = (
            f'INSERT INTO temp."map_{name}" (src, dst, new, bad) SELECT id, coalesce(m, ? - 1 - id), m IS NULL, '
            f"CASE WHEN m IS NULL THEN bad END FROM (SELECT s.id, {found} AS m, ({dangles}) AS bad "
            f'FROM src."{name}" s WHERE s.id <= ? AND '
        )
        for low, high in self.chunks(f'src."{name}"', f'"{first}"'):
            # Placeholders -1, -2, ... for new rows, below every real id.
            self.conn.execute(
                insert + f's."{first}" BETWEEN ? AND ? ORDER BY s."{first}")',
                (low_id, self.bounds.get(name, 0), low, high),
            )
        # A NULL first key is in no range above.
        self.conn.execute(insert + f's."{first}" IS NULL)', (low_id, self.bounds.get(name, 0)))
        self.count_integer(name)
        self.dangling_counted[name] = self.one(f'SELECT count(*) FROM temp."map_{name}" WHERE bad')

    def plan_keyed(self, table: Table) -> None:
        """Text and composite keys: rows whose key is new are added; the rest are compared."""
        name = table.name
        key = table.natural_key
        compare = table.compare
        if compare is None:
            compare = tuple(c for c in self.columns[name] if c not in key and c != table.pointer)
        if table.key is not Key.TEXT:
            compare = ()  # a composite row is all key
        match = self.key_match(table)
        differs = " OR ".join(self.differs(table, c) for c in compare) or "0"
        # The same pass counts new rows with a reference that resolves nowhere
        # (see check_dangling, which names one only if there are any).
        dangles = self.dangling_sql(table)
        added = existing = dangling = 0
        for low, high in self.chunks(f'src."{name}"'):
            new, old, conflicting, bad = next(iter(self.conn.execute(
                f"SELECT count(*) - count(t.rowid), count(t.rowid), "
                f"coalesce(sum(t.rowid IS NOT NULL AND ({differs})), 0), "
                f"coalesce(sum(CASE WHEN t.rowid IS NULL THEN ({dangles}) ELSE 0 END), 0) "
                f'FROM src."{name}" s LEFT JOIN main."{name}" t ON {match} WHERE s.rowid BETWEEN ? AND ?',
                (low, high),
            )))  # fmt: skip
            added, existing, dangling = added + new, existing + old, dangling + bad
            if conflicting and len(self.conflicts) < MAX_CONFLICTS_SHOWN * 10:
                for (k,) in self.conn.execute(
                    f'SELECT s."{key[0]}" FROM src."{name}" s JOIN main."{name}" t ON {match} '
                    f"WHERE s.rowid BETWEEN ? AND ? AND ({differs}) LIMIT ?",
                    (low, high, MAX_CONFLICTS_SHOWN),
                ):
                    self.conflicts.append(f"{name} {k} differs between the two files")
        counts = self.counts[name]
        counts.added, counts.existing = added, existing
        self.dangling_counted[name] = dangling

    def differs(self, table: Table, column: str) -> str:
        """SQL true when target row ``t`` holds another ``column`` than source row ``s``."""
        value = self.expr(table, column)
        raw = f's."{column}"'
        ref = self.fmt.references[table.name].get(column)
        if value == raw or ref is None or self.fmt.table(ref).key not in MESSAGE_KEYS:
            return f't."{column}" IS NOT {value}'
        # A message keeps its id in every file unless mapped, and the target
        # holds no reference to a message it lacks: the map is only asked when
        # the raw values differ. (Not so for integer ids, which are per file.)
        return f'CASE WHEN t."{column}" IS {raw} THEN 0 ELSE t."{column}" IS NOT {value} END'

    def key_match(self, table: Table, target_alias: str = "t") -> str:
        """SQL true when the target row ``target_alias`` has the source row's key."""
        return " AND ".join(f'{target_alias}."{k}" IS {self.expr(table, k)}' for k in table.natural_key)

    def is_new(self, table: Table) -> str:
        """SQL true for a source row ``s`` that apply will insert."""
        # EXISTS, not IN (SELECT ...): SQLite then looks each row up, instead
        # of walking the whole new-message list for every chunk.
        if table.key in MESSAGE_KEYS:
            return f"EXISTS (SELECT 1 FROM temp.msg_new n WHERE n.src = s.{self.fmt.message_key})"
        if table.owner is not None:
            return f'EXISTS (SELECT 1 FROM temp.msg_new n WHERE n.src = s."{table.owner[0]}")'
        if table.key is Key.INTEGER:
            return f'(SELECT new FROM temp."map_{table.name}" WHERE src = s.id)'
        return f'NOT EXISTS (SELECT 1 FROM main."{table.name}" t WHERE {self.key_match(table)})'

    def check_dangling(self, table: Table) -> None:
        """A reference in a row about to be copied that resolves nowhere would
        dangle in the target: refuse the source, naming the first one."""
        if not self.counts[table.name].added:
            return  # no row of it is copied (fork rows point where the source's row did)
        checks = self.dangling_checks(table)
        if checks and self.dangling_counted.get(table.name) != 0:
            self.find_dangling(table, checks)
        self.check_json_refs(table)

    def dangling_checks(self, table: Table) -> list[tuple[str, str, str, str]]:
        """(column, referenced table, SQL true when the source row ``s``'s reference
        resolves nowhere, why) for each reference a copied row must resolve."""
        checks: list[tuple[str, str, str, str]] = []
        for column, ref in self.fmt.references[table.name].items():
            ref_table = self.fmt.table(ref)
            if ref == table.name and ref_table.key in MESSAGE_KEYS:
                continue  # parent links: plan_messages checked them
            if table.owner is not None and column == table.owner[0]:
                continue  # the rows checked are those of new owners: this resolves
            if ref_table.key in MESSAGE_KEYS or ref_table.key is Key.INTEGER:
                # Mapped from the source's own rows: the source must have the row.
                fails = f"{self.expr(table, column, written=True)} IS NULL"
                why = f"which {self.source.name} does not have"
            else:
                ref_key = ref_table.natural_key[0]
                in_source = (
                    f'EXISTS (SELECT 1 FROM src."{ref}" r WHERE r."{ref_key}" = s."{column}")'
                    if self.present(ref_table)
                    else "0"
                )
                in_target = f'EXISTS (SELECT 1 FROM main."{ref}" r WHERE r."{ref_key}" = s."{column}")'
                fails = f"NOT ({in_source} OR {in_target})"
                why = "which neither file has"
            checks.append((column, ref, f'(s."{column}" IS NOT NULL AND {fails})', why))
        return checks

    def dangling_sql(self, table: Table) -> str:
        """SQL true for a source row ``s`` with a reference that resolves nowhere."""
        return " OR ".join(f for _, _, f, _ in self.dangling_checks(table)) or "0"

    def find_dangling(self, table: Table, checks: list[tuple[str, str, str, str]]) -> None:
        """Raise ``DamagedSource`` naming the first reference that resolves nowhere."""
        failing = " OR ".join(f for _, _, f, _ in checks)
        values = ", ".join(f's."{col}", {f}' for col, _, f, _ in checks)
        if table.owner is not None:
            # Only the rows of new messages are copied: walk those alone.
            rows, slices = (
                f'temp.msg_new n JOIN src."{table.name}" s ON s."{table.owner[0]}" = n.src '
                "WHERE n.seq BETWEEN ? AND ?",
                self.chunks("temp.msg_new", "seq"),
            )
        else:
            rows, slices = (
                f'src."{table.name}" s WHERE s.rowid BETWEEN ? AND ? AND {self.is_new(table)}',
                self.chunks(f'src."{table.name}"'),
            )
        for low, high in slices:
            for row in self.conn.execute(
                f"SELECT {values} FROM {rows} AND ({failing}) LIMIT 1",
                (low, high),
            ):
                for i, (column, ref, _, why) in enumerate(checks):
                    if row[2 * i + 1]:
                        raise DamagedSource(
                            f"{self.source}: {table.name}.{column} refers to {ref} {row[2 * i]!r}, {why}; "
                            "nothing was merged - run `dagsync verify` on the source"
                        )

    def check_json_refs(self, table: Table) -> None:
        """Ids inside a JSON column of a copied row must be mapped, as columns are."""
        for json_ref in table.json_refs:
            piece = f"j.value ->> '$.{json_ref.id_key}'"
            for low, high in self.chunks(f'src."{table.name}"'):
                for (bad,) in self.conn.execute(
                    f'SELECT {piece} FROM src."{table.name}" s, '
                    f"json_each({self.payload(table, json_ref.column)}, '$.{json_ref.list_key}') j "
                    f"WHERE s.rowid BETWEEN ? AND ? AND {self.payload(table, json_ref.column)} LIKE '%\"{json_ref.list_key}\"%' "
                    f"AND {self.is_new(table)} AND {piece} IS NOT NULL AND NOT EXISTS "
                    f'(SELECT 1 FROM temp."map_{json_ref.table}" m WHERE m.src = {piece}) LIMIT 1',
                    (low, high),
                ):
                    raise DamagedSource(
                        f"{self.source}: a {table.name}.{json_ref.column} refers to {json_ref.table} {bad!r}, "
                        f"which {self.source.name} does not have; nothing was merged - run `dagsync verify` on the source"
                    )

    def plan_pointer(self, table: Table) -> None:
        """Decide each pointer both sides have but set differently.

        The candidates in the target are the row itself and the fork rows
        earlier merges added for it. If the source's head is on a candidate's
        chain, the target already has it: keep. If a candidate's head is on
        the source head's chain, that candidate fast-forwards (the row itself
        first). Otherwise the heads diverged: add a fork row. Whatever order
        files are merged in, every head ends up on exactly the chains it would
        have in any other order.
        """
        c = self.conn
        name, pointer = table.name, table.pointer
        key = table.natural_key[0]
        head = self.expr(table, pointer, written=True)  # NULL for a head the plan did not see: ignored
        c.execute(
            "CREATE TEMP TABLE ptr (key TEXT PRIMARY KEY, s_raw TEXT, s_head TEXT, t_head TEXT, "
            "verdict INTEGER, row TEXT, row_head TEXT)"
        )
        for low, high in self.chunks(f'src."{name}"'):
            c.execute(
                f'INSERT INTO temp.ptr (key, s_raw, s_head, t_head) SELECT s."{key}", s."{pointer}", {head}, '
                f't."{pointer}" FROM src."{name}" s JOIN main."{name}" t ON t."{key}" = s."{key}" '
                f"WHERE s.rowid BETWEEN ? AND ? AND {head} IS NOT NULL AND {head} IS NOT t.\"{pointer}\"",
                (low, high),
            )
        c.execute("UPDATE temp.ptr SET verdict = ?, row = key WHERE t_head IS NULL", (FAST_FORWARD,))
        c.execute("CREATE TEMP TABLE cand (key TEXT NOT NULL, row TEXT NOT NULL, head TEXT)")
        c.execute("INSERT INTO temp.cand SELECT key, key, t_head FROM temp.ptr WHERE verdict IS NULL")
        if bookkeeping.has(c, "_dagsync_forks"):
            c.execute(
                f'INSERT INTO temp.cand SELECT p.key, f.fork_key, t."{pointer}" FROM temp.ptr p '
                f"JOIN main._dagsync_forks f ON f.pointer_table = ? AND f.key = p.key "
                f'JOIN main."{name}" t ON t."{key}" = f.fork_key WHERE p.verdict IS NULL',
                (name,),
            )
        c.execute("CREATE INDEX temp.cand_key ON cand (key, head)")
        # The source's head is a candidate's own head (a re-merge, or the same
        # divergence merged before): the target has it, no chains to walk.
        c.execute(
            "UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL AND EXISTS "
            "(SELECT 1 FROM temp.cand c WHERE c.key = ptr.key AND c.head = ptr.s_head)",
            (KEEP,),
        )
        mkey, parent, root = self.fmt.message_key, self.fmt.parent_column, self.fmt.root_id
        not_root = f"m.{mkey} != '{root}'" if root else "1"
        c.execute("CREATE TEMP TABLE s_up (key TEXT NOT NULL, dst TEXT)")
        c.execute("CREATE TEMP TABLE t_up (key TEXT NOT NULL, cur TEXT)")
        for low, high in self.chunks("temp.ptr"):
            # Every message on each candidate's chain, up to the source's head
            # (finding it is all the chain is asked for). A head the target
            # lacks is on none of its chains: no walk.
            c.execute(
                f"INSERT INTO temp.t_up WITH RECURSIVE up(k, cur, stop) AS (SELECT c.key, c.head, p.s_head "
                f"FROM temp.cand c JOIN temp.ptr p ON p.key = c.key WHERE p.verdict IS NULL "
                f"AND p.rowid BETWEEN ? AND ? AND (SELECT kind FROM temp.msg_map WHERE src = p.s_raw) IS NOT {NEW} "
                f"UNION SELECT up.k, m.{parent}, up.stop FROM up JOIN main.messages m ON m.{mkey} = up.cur "
                f"WHERE {not_root} AND up.cur IS NOT up.stop) SELECT k, cur FROM up",
                (low, high),
            )
        c.execute("CREATE INDEX temp.t_up_key ON t_up (key, cur)")
        c.execute(
            "UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL AND EXISTS "
            "(SELECT 1 FROM temp.t_up u WHERE u.key = ptr.key AND u.cur = ptr.s_head)",
            (KEEP,),
        )
        for low, high in self.chunks("temp.ptr"):
            # What is left (not kept): every message on the source head's
            # chain, in the target's ids, up to the row's own head: past it,
            # nothing can change the verdict (the row itself is the
            # fast-forward preferred).
            c.execute(
                f"INSERT INTO temp.s_up WITH RECURSIVE up(k, cur, stop) AS (SELECT key, s_raw, t_head "
                f"FROM temp.ptr WHERE verdict IS NULL AND rowid BETWEEN ? AND ? "
                f"UNION SELECT up.k, m.{parent}, up.stop FROM up JOIN src.messages m ON m.{mkey} = up.cur "
                f"WHERE {not_root} AND (SELECT dst FROM temp.msg_map WHERE src = up.cur) IS NOT up.stop) "
                "SELECT up.k, mm.dst FROM up JOIN temp.msg_map mm ON mm.src = up.cur",
                (low, high),
            )
        c.execute("CREATE INDEX temp.s_up_key ON s_up (key, dst)")
        c.execute(
            "UPDATE temp.ptr SET verdict = ?, (row, row_head) = (SELECT c.row, c.head FROM temp.cand c "
            "JOIN temp.s_up u ON u.key = c.key AND u.dst = c.head WHERE c.key = ptr.key "
            "ORDER BY c.row != ptr.key, c.row LIMIT 1) "
            "WHERE verdict IS NULL AND EXISTS (SELECT 1 FROM temp.cand c JOIN temp.s_up u "
            "ON u.key = c.key AND u.dst = c.head WHERE c.key = ptr.key)",
            (FAST_FORWARD,),
        )
        c.execute("UPDATE temp.ptr SET verdict = ? WHERE verdict IS NULL", (FORK,))
        counts = self.counts[name]
        counts.updated = self.one("SELECT count(*) FROM temp.ptr WHERE verdict = ?", (FAST_FORWARD,))
        counts.forked = self.one("SELECT count(*) FROM temp.ptr WHERE verdict = ?", (FORK,))

    # -- apply ---------------------------------------------------------------------

    def apply(self) -> None:
        order = [t for t in self.fmt.merge_order if self.present(t) and t.owner is None]
        written = {name: _Counts() for name in self.counts}
        for step, table in enumerate(order):
            self.progress(f"copying {table.name}", step, len(order))
            planned = self.counts[table.name]
            if table.key in MESSAGE_KEYS:
                self.apply_messages(table, written)
            elif not planned.added:
                pass  # nothing to copy: no write transaction at all
            elif table.key is Key.INTEGER:
                self.apply_integer(table, written)
            else:
                self.apply_keyed(table, written)
            if table.pointer and (planned.updated or planned.forked):
                self.apply_pointer(table, written)
        self.progress("copied", len(order), len(order))
        # Report what was done, which is what the plan said unless a live
        # writer got there first.
        for name, done in written.items():
            counts = self.counts[name]
            counts.added, counts.updated, counts.forked = done.added, done.updated, done.forked

    def apply_messages(self, table: Table, written: dict[str, _Counts]) -> None:
        c = self.conn
        cols = self.columns[table.name]
        key, parent = self.fmt.message_key, self.fmt.parent_column
        top = "n.parent" if self.fmt.root_id == TOP else f"NULLIF(n.parent, '{TOP}')"
        select = ", ".join(top if col == parent else f's."{col}"' for col in cols)
        owned = [t for t in self.fmt.merge_order if t.owner and t.owner[1] == table.name and self.present(t)]
        for low, high in self.chunks("temp.msg_new", "seq", "copying messages", writes=True):
            with write_transaction(c):
                # Parents first (msg_new's order, see plan_messages) from one
                # transaction to the next, so every commit leaves each inserted
                # message's parent in place. Inside one, the order is free: in
                # the order of the random-keyed index, each of its pages is
                # visited once.
                c.execute(
                    f"INSERT INTO main.messages ({self.column_list(table)}) SELECT {select} "
                    f"FROM temp.msg_new n JOIN src.messages s ON s.{key} = n.src "
                    f"WHERE n.seq BETWEEN ? AND ? ORDER BY {self.insert_order(table)}",
                    (low, high),
                )
                written[table.name].added += self.changes()
                for part in owned:
                    c.execute(
                        f'INSERT INTO main."{part.name}" ({self.column_list(part)}) '
                        f'SELECT {", ".join(self.payload(part, col) for col in self.columns[part.name])} '
                        f'FROM temp.msg_new n JOIN src."{part.name}" s ON s."{part.owner[0]}" = n.src '
                        "WHERE n.seq BETWEEN ? AND ?",
                        (low, high),
                    )
                    written[part.name].added += self.changes()
        # Record where each mapped message went, for holders of its old id.
        source_map = bookkeeping.has(c, "_dagsync_message_map", "src")
        if self.moved or source_map:
            with write_transaction(c):
                bookkeeping.ensure(c)
            for low, high in self.chunks("temp.msg_moved", "src", writes=True):
                with write_transaction(c):
                    c.execute(
                        "INSERT OR IGNORE INTO main._dagsync_message_map (source_id, target_id) "
                        "SELECT src, dst FROM temp.msg_moved WHERE src BETWEEN ? AND ?",
                        (low, high),
                    )
            if source_map:
                # The source's own records of old ids, carried over to where they
                # landed - unless the old id is itself a message here.
                for low, high in self.chunks("src._dagsync_message_map", writes=True):
                    with write_transaction(c):
                        c.execute(
                            "INSERT OR IGNORE INTO main._dagsync_message_map (source_id, target_id) "
                            "SELECT s.source_id, m.dst FROM src._dagsync_message_map s "
                            "JOIN temp.msg_map m ON m.src = s.target_id WHERE s.rowid BETWEEN ? AND ? "
                            f"AND NOT EXISTS (SELECT 1 FROM main.messages t WHERE t.{key} = s.source_id)",
                            (low, high),
                        )

    def insert_order(self, table: Table) -> str:
        """The order to insert one transaction's new messages in.

        llm's messages are keyed by a hash, so in key order each page of the
        key's index is visited once. dag messages are keyed by ULIDs, in
        time order like the source's rows; there, ordering by the one random
        index (content_hash) measured slower, as the others lose their order.
        """
        return f"s.{self.fmt.message_key}" if table.key is Key.HASH_MESSAGE else "n.seq"

    def apply_integer(self, table: Table, written: dict[str, _Counts]) -> None:
        c = self.conn
        name = table.name
        cols = self.columns[name]
        select = ", ".join("m.dst" if col == "id" else self.expr(table, col, written=True) for col in cols)
        for low, high in self.chunks(f'temp."map_{name}"', "src", f"copying {name}", writes=True):
            with write_transaction(c):
                # Ids are taken under the write lock, after the target's highest.
                base = self.one(f'SELECT coalesce(max(id), 0) FROM main."{name}"')
                c.execute(
                    f'UPDATE temp."map_{name}" SET dst = ? + r.n FROM (SELECT src, row_number() OVER '
                    f'(ORDER BY src) AS n FROM temp."map_{name}" WHERE new AND src BETWEEN ? AND ?) r '
                    f'WHERE "map_{name}".src = r.src',
                    (base, low, high),
                )
                c.execute(
                    f'INSERT INTO main."{name}" ({self.column_list(table)}) SELECT {select} '
                    f'FROM temp."map_{name}" m JOIN src."{name}" s ON s.id = m.src '
                    "WHERE m.new AND m.src BETWEEN ? AND ? ORDER BY m.src",
                    (low, high),
                )
                written[name].added += self.changes()

    def apply_keyed(self, table: Table, written: dict[str, _Counts]) -> None:
        c = self.conn
        name = table.name
        select = ", ".join(self.expr(table, col, written=True) for col in self.columns[name])
        match = self.key_match(table)
        for low, high in self.chunks(f'src."{name}"', phase=f"copying {name}", writes=True):
            with write_transaction(c):
                c.execute(
                    f'INSERT INTO main."{name}" ({self.column_list(table)}) SELECT {select} '
                    f'FROM src."{name}" s WHERE s.rowid BETWEEN ? AND ? '
                    f'AND NOT EXISTS (SELECT 1 FROM main."{name}" t WHERE {match})',
                    (low, high),
                )
                written[name].added += self.changes()

    def apply_pointer(self, table: Table, written: dict[str, _Counts]) -> None:
        c = self.conn
        name, pointer = table.name, table.pointer
        key = table.natural_key[0]
        with write_transaction(c):
            # Only where the row still points where the plan saw it.
            c.execute(
                f'UPDATE main."{name}" SET "{pointer}" = p.s_head FROM temp.ptr p '
                f'WHERE p.verdict = ? AND main."{name}"."{key}" = p.row '
                f'AND main."{name}"."{pointer}" IS p.row_head',
                (FAST_FORWARD,),
            )
            written[name].updated += self.changes()
            # A live writer moved a pointer we meant to fast-forward: the
            # source's head is kept as a fork instead of being dropped.
            c.execute(
                f'UPDATE temp.ptr SET verdict = ? WHERE verdict = ? AND NOT EXISTS (SELECT 1 FROM main."{name}" t '
                f'WHERE t."{key}" = ptr.row AND t."{pointer}" IS ptr.s_head)',
                (FORK, FAST_FORWARD),
            )
        forks = list(c.execute("SELECT key, s_head FROM temp.ptr WHERE verdict = ?", (FORK,)))
        if not forks:
            return
        suffix = f" (diverged on {self.source.name})"
        with write_transaction(c):
            bookkeeping.ensure(c)
            for original, s_head in forks:
                fork_key = self.fork_key(name, key, original, s_head)
                # A copy of the source's row under a new key, pointing where the
                # source pointed, named so a person can see where it came from
                # (and, in the llm format, saying which thread it forked from).
                values: dict[str, tuple[str, tuple[Any, ...]]] = {
                    col: (f's."{col}"', ()) for col in self.columns[name]
                }
                values[key] = ("?", (fork_key,))
                values[pointer] = ("?", (s_head,))
                if "name" in values:
                    values["name"] = ("coalesce(s.\"name\", 'conversation') || ?", (suffix,))
                if "forked_from" in values:
                    values["forked_from"] = ("?", (original,))
                exprs = ", ".join(sql for sql, _ in values.values())
                params = [p for _, ps in values.values() for p in ps]
                c.execute(
                    f'INSERT INTO main."{name}" ({_quoted(list(values))}) SELECT {exprs} '
                    f'FROM src."{name}" s WHERE s."{key}" = ?',
                    (*params, original),
                )
                if not self.changes():
                    continue  # the source row is gone; nothing to record
                c.execute(
                    "INSERT INTO main._dagsync_forks (pointer_table, key, head, fork_key) VALUES (?, ?, ?, ?)",
                    (name, original, s_head, fork_key),
                )
                written[name].forked += 1

    def fork_key(self, table: str, key: str, original: str, head: str) -> str:
        """A key for the fork of row ``original`` that sorts just before it.

        llm continues (``llm -c``) the thread or conversation with the highest
        id; a fork row has no turns of its own, so it must never be the newest.
        A ULID one millisecond older than the original's, its random part
        taken from (original, head), does that, and is the same in every merge
        of the same divergence. Anything else gets a new ULID.
        """
        try:
            ms = ULID.from_str(original.upper()).milliseconds
        except (ValueError, TypeError):
            return self.new_id()
        # Everything the fork row is made of: the same divergence merged from
        # another file (another name in the row) is another fork.
        digest = hashlib.sha256(f"{original}\0{head}\0{self.source.name}".encode()).digest()[:10]
        candidate = str(ULID.from_bytes(max(ms - 1, 0).to_bytes(6, "big") + digest)).lower()
        if self.one(f'SELECT 1 FROM main."{table}" WHERE "{key}" = ?', (candidate,)):
            return self.new_id()
        return candidate

    # -- report ----------------------------------------------------------------------

    def report(self) -> SourceReport:
        tables = tuple(
            TableReport(name, c.added, c.mapped, c.existing, c.updated, c.forked)
            for name, c in self.counts.items()
            if self.present(self.fmt.table(name))
        )
        return SourceReport(str(self.source), self.fmt.name, tables)
