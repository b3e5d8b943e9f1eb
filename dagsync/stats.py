"""What a database holds: its format, rows per table and the shape of its DAG.

Read-only: it opens the file as a source, so it works on a read-only file
and on a database another process is writing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dagsync import faults
from dagsync.db import Database, open_source
from dagsync.formats import Key

__all__ = ["ForkRow", "Stats", "stats"]


@dataclass(frozen=True)
class ForkRow:
    """A conversation or thread that forks another: llm's own forks, and those merges added."""

    id: str
    name: str | None
    forked_from: str | None
    tip: str | None


@dataclass(frozen=True)
class Stats:
    path: str
    format: str
    file_bytes: int
    messages: int  # message rows, not counting the dag sentinel
    conversations: int  # conversations (dag) or threads (llm)
    chains: int  # messages nothing continues from: the ends of chains
    forks: int  # messages continued in two or more ways: branch points
    calls: int  # calls (dag) or turns (llm)
    tables: dict[str, int]  # rows in every table of the format that the file has
    # What the format calls them: "conversations" and "calls" (dag), "threads" and "turns" (llm).
    conversation_table: str = "conversations"
    call_table: str = "calls"
    fork_rows: tuple[ForkRow, ...] = ()


def _count(db: Database, sql: str, *args: object) -> int:
    return next(iter(db.conn.execute(sql, args)))[0]


@faults.named("path")
def stats(path: str | os.PathLike[str]) -> Stats:
    """Count what ``path`` holds.

    :raises NotADatabase, UnsupportedDatabase: as ``open_source``.
    """
    with open_source(path) as db:
        fmt = db.format
        present = {name for (name,) in db.conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        tables = {
            t.name: _count(db, f'SELECT count(*) FROM "{t.name}"')
            for t in fmt.tables
            if t.name in present and t.key is not Key.DERIVED
        }
        key, parent = fmt.message_key, fmt.parent_column
        # A message "has a parent" unless it starts a chain: its parent is the
        # dag sentinel, or NULL in the llm format. The sentinel itself is no message.
        if fmt.root_id is not None:
            is_message = f"{key} != '{fmt.root_id}'"
            has_parent = f"{parent} != '{fmt.root_id}'"
        else:
            is_message = f"{key} IS NOT NULL"
            has_parent = f"{parent} IS NOT NULL"
        return Stats(
            path=str(db.path),
            format=fmt.name,
            file_bytes=Path(db.path).stat().st_size,
            messages=_count(db, f"SELECT count(*) FROM messages WHERE {is_message}"),
            conversations=tables[fmt.conversation_table],
            chains=_count(
                db,
                f"SELECT count(*) FROM messages m WHERE m.{is_message} AND NOT EXISTS "
                f"(SELECT 1 FROM messages c WHERE c.{parent} = m.{key})",
            ),
            forks=_count(
                db,
                f"SELECT count(*) FROM (SELECT 1 FROM messages WHERE {has_parent} "
                f"GROUP BY {parent} HAVING count(*) > 1)",
            ),
            calls=tables[fmt.call_table],
            tables=tables,
            conversation_table=fmt.conversation_table,
            call_table=fmt.call_table,
            fork_rows=_fork_rows(db, present),
        )


def _fork_rows(db: Database, present: set[str]) -> tuple[ForkRow, ...]:
    """Rows a merge recorded as forks (``_dagsync_forks``), and, where the
    table says which row a fork came from (llm's ``forked_from``), those too."""
    table = db.format.table(db.format.conversation_table)
    pointer, key = table.pointer, table.natural_key[0]
    columns = db.format.columns[table.name]
    origins = []
    if "forked_from" in columns:
        origins.append(f'SELECT "{key}" AS fork, "forked_from" AS original FROM main."{table.name}" WHERE "forked_from" IS NOT NULL')
    if "_dagsync_forks" in present:
        origins.append(f"SELECT fork_key AS fork, key AS original FROM main._dagsync_forks WHERE pointer_table = '{table.name}'")
    if not origins:
        return ()
    name = '"name"' if "name" in columns else "NULL"
    rows = db.conn.execute(
        f"SELECT t.\"{key}\", {name}, o.original, t.\"{pointer}\" FROM ({' UNION '.join(origins)}) o "
        f'JOIN main."{table.name}" t ON t."{key}" = o.fork ORDER BY t."{key}"'
    )
    return tuple(ForkRow(*row) for row in rows)
