"""The shared core of one source's merge: the attached source, its bounds,
chunks, progress, counts and conflicts.

A ``SourceMerge`` is what every key kind's module works on. It attaches the
source read-only to the target's connection (as ``src``) and fixes, in one
read transaction, the highest rowid of each of its tables: every later read
of the source stops there, so rows a live llm writes meanwhile wait for the
next merge instead of arriving half-planned (llm writes a row's references
in the same transaction as the row, so the bounds are consistent).

Planning writes only temp tables, each named for its kind: ``temp.msg_map``
(every source message -> its target id), ``temp.msg_new`` (the messages to
insert, parents first), ``temp.msg_moved`` (only those mapped onto another
row), ``temp."map_<table>"`` (integer ids), ``temp.ptr`` (pointer verdicts).
``maps.py`` reads source columns through them.
"""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dagsync import packed
from dagsync.merge import marks
from dagsync.db import CACHE_KIB, THIN_CACHE_KIB, Database
from dagsync.errors import MergeConflict
from dagsync.formats import Format, Key, Table
from dagsync.merge.report import Counts, ForkReport, SourceReport, TableReport
from dagsync.store import UlidFactory
from dagsync.writer import Writer

__all__ = ["BOUNDARY", "MAPPED", "MAX_CONFLICTS_SHOWN", "MESSAGE_KEYS", "NEW", "SAME", "TOP", "SourceMerge", "quoted"]

# The tables that hold the message DAG, however keyed.
MESSAGE_KEYS = (Key.DAG_MESSAGE, Key.HASH_MESSAGE)
# In temp tables a chain's start has parent 'root': the dag format's sentinel,
# and the llm format's NULL parent (its hashes all start "b2:").
TOP = "root"
# Message kinds in temp.msg_map (messages.py): the target's row of the same id;
# another row of the same identity; new; and a message a thin source refers
# to without holding it, which the target has (messages._boundary).
SAME, MAPPED, NEW, BOUNDARY = 0, 1, 2, 3
MAX_CONFLICTS_SHOWN = 10


def quoted(columns: tuple[str, ...] | list[str], alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(f'{prefix}"{c}"' for c in columns)


def source_label(path: Path) -> str:
    """What fork names call a source: its file's name without the suffix, or,
    for llm's own file names (logs.db, dag.db), the home directory holding it,
    or this machine's name when that is llm's default directory."""
    path = Path(path)
    if path.stem not in ("logs", "dag"):
        return path.stem
    home = path.resolve().parent
    if home.name in ("io.datasette.llm", ""):
        return socket.gethostname()
    return home.name


class SourceMerge:
    """One source into one target: what planning and writing share."""

    def __init__(
        self,
        target: Database,
        source: Path,
        writer: Writer,
        label: str | None = None,
        target_label: str | None = None,
        *,
        file: Path | None = None,
        thin: bool = False,
    ) -> None:
        self.db = target
        self.conn = target.conn
        self.fmt: Format = target.format
        self.source = source  # what errors and the report name
        # The file read: the source, or the delta of it that an incremental merge
        # reads (merge.delta), which is thin: what it refers to may be in the target alone.
        self.file = file or source
        self.thin = thin
        # The source's marks as this merge read it (merge.marks.taken); None for a delta.
        self.taken: dict[str, tuple[int, str | None]] | None = None
        # The source file's state, read with them (merge.marks.file_state).
        self.state: str | None = None
        self.full_because: str | None = None  # why the source is read whole (merge.marks.decide)
        self.label = label or source_label(source)
        self.target_label = target_label or source_label(target.path)
        self.forks: list[ForkReport] = []  # fork rows written (pointers.apply)
        # branches.plan made temp.branch (source calls onto forks) and temp.tmove (target calls).
        self.branches = False
        # branches.families made temp.fam (each fork row -> the conversation it forked from).
        self.families = False
        self.writer = writer
        self.conflicts: list[str] = []
        # What the plan found, then (once applied) what was written.
        self.counts: dict[str, Counts] = {t.name: Counts() for t in self.fmt.merge_order}
        self.written: dict[str, Counts] = {t.name: Counts() for t in self.fmt.merge_order}
        # ``written`` as it was at the last commit: what an attempt cut short has for good.
        self.committed: dict[str, Counts] = {}
        self.new_id = UlidFactory()
        self.attached = False
        self.columns = {t.name: self.fmt.columns[t.name] for t in self.fmt.merge_order}
        self.moved = 0  # source messages mapped onto another row (messages.plan)
        self.boundary = 0  # messages a thin source refers to and the target holds (messages.plan)
        # New rows whose references resolve nowhere, by table, where a plan counted them.
        self.dangling_counted: dict[str, int] = {}
        # Keyed tables whose new rows skip the target's keys by its unique index (keyed.plan).
        self.upsert: set[str] = set()
        self.bounds: dict[str, int] = {}
        # Derived tables no trigger of the target keeps -> their content table.
        self.unindexed: dict[str, str] = {}
        self.source_tables: set[str] = set()

    # -- the attached source -------------------------------------------------------

    def attach(self) -> None:
        uri = "file:" + urllib.parse.quote(str(self.file.resolve())) + "?mode=ro"
        self.conn.execute(f"PRAGMA main.cache_size = -{THIN_CACHE_KIB if self.thin else CACHE_KIB}")
        self.conn.execute("ATTACH DATABASE ? AS src", (uri,))
        self.attached = True
        self.source_tables = {
            name for (name,) in self.conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")
        }
        self.source_packed = packed.is_packed(self.conn, "src")
        self.target_packed = packed.is_packed(self.conn, "main")
        self.packed_columns = {(c.table, c.column): c for c in self.fmt.packed}
        packed.register_functions(self.conn)
        # Every read of the source stops at these rowids (see the module docstring).
        self.conn.execute("BEGIN")
        try:
            if self.thin:
                for table in self.fmt.merge_order:
                    if table.name in self.source_tables:
                        self.bounds[table.name] = self.one(f'SELECT coalesce(max(rowid), 0) FROM src."{table.name}"')
            else:
                self.taken = marks.taken(self.conn, self.fmt, "src", self.source_tables)
                self.state = marks.file_state(self.file)  # after a read: under the SHARED lock
                self.bounds = {name: high for name, (high, _) in self.taken.items()}
                # The pointer rows as of these bounds, for the marks (marks.save).
                for table in self.order:
                    if table.pointer:
                        self.conn.execute(
                            f'CREATE TEMP TABLE "marked_{table.name}" AS SELECT "{table.natural_key[0]}", '
                            f'"{table.pointer}" FROM src."{table.name}" WHERE rowid <= ?',
                            (self.bounds[table.name],),
                        )
        except BaseException:
            # An I/O error has rolled the read back already.
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
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

    def present(self, table: Table) -> bool:
        return table.name in self.source_tables

    @property
    def order(self) -> list[Table]:
        """The source's tables in reference order: each after the tables it references."""
        return [t for t in self.fmt.merge_order if self.present(t)]

    # -- plumbing --------------------------------------------------------------------

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.conn.execute(sql, params):
            return row[0]
        return None

    def changes(self) -> int:
        return self.conn.changes()

    def progress(self, phase: str, done: int, total: int) -> None:
        self.writer.progress(phase, done, total)

    def chunks(
        self, schema_table: str, column: str = "rowid", phase: str | None = None, writes: bool = False
    ) -> Iterator[tuple[int, int]]:
        """The writer's ranges over ``schema_table``; a source table is read only
        up to its bound (see ``attach``)."""
        bound = None
        if schema_table.startswith("src."):
            bound = self.bounds.get(schema_table.removeprefix("src.").strip('"'))
        return self.writer.ranges(schema_table, column, rowid_bound=bound, phase=phase, writes=writes)

    def column_list(self, table: Table) -> str:
        return quoted(self.columns[table.name])

    def natural_key(self, table: Table) -> tuple[str, ...]:
        if table.natural_key:
            return table.natural_key
        return tuple(c for c in self.columns[table.name] if c != "id")

    # -- what was found ------------------------------------------------------------

    def conflict(self, description: str) -> None:
        if description not in self.conflicts:  # a role, say, is found by the plan and by merge.shared
            self.conflicts.append(description)

    def raise_conflicts(self) -> None:
        """:raises MergeConflict: listing the first conflicts found, if any."""
        if not self.conflicts:
            return
        shown = self.conflicts[:MAX_CONFLICTS_SHOWN]
        more = len(self.conflicts) - len(shown)
        raise MergeConflict(
            f"{self.source} and {self.db.path} hold different content under the same "
            f"key, so nothing was merged: {'; '.join(shown)}" + (f"; and {more} more" if more > 0 else ""),
            self.conflicts,
        )

    def report(self) -> SourceReport:
        tables = tuple(
            TableReport(name, c.added, c.mapped, c.existing, c.updated, c.forked, c.moved)
            for name, c in self.counts.items()
            if self.present(self.fmt.table(name))
        )
        return SourceReport(
            str(self.source), self.fmt.name, tables, tuple(self.forks), self.label, self.thin, self.full_because
        )
