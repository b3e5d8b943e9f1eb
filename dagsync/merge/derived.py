"""Derived tables: full-text indexes, never copied, kept consistent with what is.

``responses_fts`` and, in the llm format, ``turn_search_fts`` are FTS5
indexes over a content table (``responses``, ``turn_search``). A source's
index is never read: its shadow tables are SQLite's own business, and the
rows it indexes are copied anyway. The target's own ``AFTER INSERT`` trigger
(as llm creates it) indexes every row the merge inserts into the content
table, in the same transaction.

A target whose trigger is missing (dropped by hand, or by a tool that
disables full-text search) would be left with an index that does not know
the merged rows, and ``llm logs -q`` would not find them. So then, once the
copy is done, every content row the index lacks is indexed here, in the
writer's chunks: the rows of this merge, of a merge killed before it got
this far, and any the file already had unindexed. Which rows the index has
is read from FTS5's ``<table>_docsize`` (one row per indexed document); an
index made without it (``columnsize=0``) is rebuilt instead, in one statement.
"""

from __future__ import annotations

from dagsync import bookkeeping
from dagsync.formats import Format, Table
from dagsync.merge.core import SourceMerge, quoted

__all__ = ["apply", "plan", "tables"]


def tables(run: SourceMerge) -> list[Table]:
    """The derived tables the target has: the last in the order, after their content."""
    return [t for t in run.fmt.tables if t.name in _indexers(run.fmt) and bookkeeping.has(run.conn, t.name)]


def _indexers(fmt: Format) -> dict[str, tuple[str, str]]:
    """Derived table -> (its content table, the trigger that indexes an inserted
    row), read from the format's own DDL."""
    found = {}
    for name, (content, sql) in fmt.triggers.items():
        for table in fmt.tables:
            if sql.startswith(f'create trigger "{name}" after insert') and f'insert into "{table.name}" (rowid,' in sql:
                found[table.name] = (content, name)
    return found


def plan(run: SourceMerge, table: Table) -> None:
    """Note the index for ``apply``, unless the target's own trigger indexes what is inserted.

    A trigger of that name in the target is the format's own: opening the
    target refused any other (``db.check_tables``).
    """
    content, trigger = _indexers(run.fmt)[table.name]
    if run.one("SELECT 1 FROM main.sqlite_schema WHERE type = 'trigger' AND name = ? AND tbl_name = ?", (trigger, content)):
        return
    run.unindexed[table.name] = content


def apply(run: SourceMerge, table: Table) -> None:
    """Index the content rows the index lacks, where no trigger does it."""
    content = run.unindexed.get(table.name)
    if content is None:
        return
    name = table.name
    if not bookkeeping.has(run.conn, f"{name}_docsize"):
        with run.writer.transaction():
            run.conn.execute(f"INSERT INTO main.\"{name}\" (\"{name}\") VALUES ('rebuild')")
        return
    columns = quoted(run.fmt.columns[name])
    for low, high in run.writer.ranges(f'main."{content}"', writes=True):
        with run.writer.transaction():
            run.conn.execute(
                f'INSERT INTO main."{name}" (rowid, {columns}) SELECT c.rowid, {columns} FROM main."{content}" c '
                f'WHERE c.rowid BETWEEN ? AND ? AND NOT EXISTS (SELECT 1 FROM main."{name}_docsize" d WHERE d.id = c.rowid)',
                (low, high),
            )
