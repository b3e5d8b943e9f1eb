"""fts: the full-text indexes llm keeps over a content table, and what pack does with them.

``responses_fts`` (both formats) and, in the llm format, ``turn_search_fts``
are FTS5 indexes over a content table, kept by llm's triggers: a row
inserted, updated or deleted is indexed, re-indexed or taken out with the
values it holds. ``merge.derived`` keeps a target's index whole when rows
arrive.

A packed file holds blob references where the payloads were. Kept by its
triggers, an index over a packed column would index the references (and
forget the words), so ``pack`` drops every index of the format that covers
a packed column, triggers and all, in its first transaction, and names it
in ``_dagsync_meta`` (``pack_dropped_indexes``). ``unpack`` makes each one
again from the format's own DDL once the payloads are back, and indexes
every row, a chunk at a time. A packed file is an archive for dagsync; llm
reads it (and searches it) only after ``unpack``.
"""

from __future__ import annotations

import apsw

from dagsync import bookkeeping
from dagsync.formats import Format, PackedColumn
from dagsync.writer import Writer

__all__ = ["DROPPED", "backfill", "drop", "dropped", "indexes", "over_packed", "restore"]

# The ``_dagsync_meta`` key naming the indexes pack dropped (comma-separated).
DROPPED = "pack_dropped_indexes"


def indexes(fmt: Format) -> dict[str, tuple[str, str]]:
    """Index -> (its content table, the trigger that indexes an inserted row), read from the format's DDL."""
    found = {}
    for name, (content, sql) in fmt.triggers.items():
        for table in fmt.tables:
            if sql.startswith(f'create trigger "{name}" after insert') and f'insert into "{table.name}" (rowid,' in sql:
                found[table.name] = (content, name)
    return found


def indexed_columns(fmt: Format, name: str) -> tuple[str, ...]:
    """The content columns index ``name`` holds (its own columns, by the FTS5 convention)."""
    return fmt.columns[name]


def over_packed(fmt: Format, columns: list[PackedColumn]) -> list[str]:
    """The format's indexes that cover one of ``columns``."""
    packed = {(c.table, c.column) for c in columns}
    return sorted(
        name for name, (content, _) in indexes(fmt).items()
        if any((content, column) in packed for column in indexed_columns(fmt, name))
    )  # fmt: skip


def dropped(conn: apsw.Connection) -> list[str]:
    """The indexes pack dropped from this file, which unpack makes again."""
    from dagsync.packed import meta  # packed builds on bookkeeping, as this does

    return [n for n in (meta(conn, DROPPED) or "").split(",") if n]


def _triggers(conn: apsw.Connection, fmt: Format, name: str) -> list[str]:
    """The file's triggers that write index ``name`` (the format's: check_tables refused any other)."""
    content = indexes(fmt)[name][0]
    return [
        trigger for (trigger,) in conn.execute(
            "SELECT name FROM main.sqlite_schema WHERE type = 'trigger' AND tbl_name = ?", (content,)
        )
        if trigger in fmt.triggers and f'"{name}"' in fmt.triggers[trigger][1]
    ]  # fmt: skip


def drop(conn: apsw.Connection, fmt: Format, name: str) -> None:
    """Drop index ``name`` and the triggers that keep it, and note it for unpack (inside the caller's transaction)."""
    for trigger in _triggers(conn, fmt, name):
        conn.execute(f'DROP TRIGGER "{trigger}"')
    conn.execute(f'DROP TABLE IF EXISTS main."{name}"')
    names = sorted({*dropped(conn), name})
    bookkeeping.ensure(conn)
    conn.execute("INSERT OR REPLACE INTO _dagsync_meta (key, value) VALUES (?, ?)", (DROPPED, ",".join(names)))


def restore(writer: Writer, fmt: Format, name: str) -> None:
    """Make index ``name`` and its triggers again, as the format's DDL does, then index every row.

    The index and its triggers come first, in one transaction, so that a row
    written meanwhile is indexed by its trigger; the rows already there are
    indexed after, a chunk at a time (``backfill``). A run cut short leaves
    the rest to the next (the note in ``_dagsync_meta`` stays until unpack
    removes the store).
    """
    conn = writer.conn
    content, _ = indexes(fmt)[name]
    if not bookkeeping.has(conn, name):
        with writer.transaction():
            conn.execute(fmt.object_sql(name))
            for trigger in fmt.triggers_on(content):
                if f'"{name}"' in fmt.triggers[trigger][1]:
                    conn.execute(fmt.object_sql(trigger))
    backfill(writer, name, content, indexed_columns(fmt, name))


def backfill(writer: Writer, name: str, content: str, columns: tuple[str, ...]) -> None:
    """Index the rows of ``content`` that index ``name`` lacks, in the writer's chunks.

    Which rows the index has is read from FTS5's ``<name>_docsize`` (one row
    per indexed document); an index made without it (``columnsize=0``) is
    rebuilt instead, in one statement.
    """
    conn = writer.conn
    if not bookkeeping.has(conn, f"{name}_docsize"):
        with writer.transaction():
            conn.execute(f"INSERT INTO main.\"{name}\" (\"{name}\") VALUES ('rebuild')")
        return
    listed = ", ".join(f'"{c}"' for c in columns)
    for low, high in writer.ranges(f'main."{content}"', phase=f"indexing {content}", writes=True):
        with writer.transaction():
            conn.execute(
                f'INSERT INTO main."{name}" (rowid, {listed}) SELECT c.rowid, {listed} FROM main."{content}" c '
                f'WHERE c.rowid BETWEEN ? AND ? AND NOT EXISTS (SELECT 1 FROM main."{name}_docsize" d WHERE d.id = c.rowid)',
                (low, high),
            )
