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
is read from FTS5's ``<table>_docsize`` (``fts.backfill``).

A packed target has no index over its packed columns (``fts``: pack drops
it, unpack makes it again): there is nothing to keep.
"""

from __future__ import annotations

from dagsync import bookkeeping, fts
from dagsync.formats import Table
from dagsync.merge.core import SourceMerge

__all__ = ["apply", "plan", "tables"]


def tables(run: SourceMerge) -> list[Table]:
    """The derived tables the target has: the last in the order, after their content."""
    return [t for t in run.fmt.tables if t.name in fts.indexes(run.fmt) and bookkeeping.has(run.conn, t.name)]


def plan(run: SourceMerge, table: Table) -> None:
    """Note the index for ``apply``, unless the target's own trigger indexes what is inserted.

    A trigger of that name in the target is the format's own: opening the
    target refused any other (``db.check_tables``).
    """
    content, trigger = fts.indexes(run.fmt)[table.name]
    if run.one("SELECT 1 FROM main.sqlite_schema WHERE type = 'trigger' AND name = ? AND tbl_name = ?", (trigger, content)):
        return
    run.unindexed[table.name] = content


def apply(run: SourceMerge, table: Table) -> None:
    """Index the content rows the index lacks, where no trigger does it."""
    content = run.unindexed.get(table.name)
    if content is None:
        return
    fts.backfill(run.writer, table.name, content, run.fmt.columns[table.name])
