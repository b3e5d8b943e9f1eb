"""The delta: what a source holds beyond a target's marks, as a file of its format.

A *thin* file: a reference in it may resolve in the target alone (a new
message's parent merged before, a thread a new turn continues). ``merge``
reads it as a source (``SourceMerge(thin=True)``), so an incremental merge
keeps every guarantee of a full one; a bundle is the same file, made for a
target on another machine.

What goes in, read in one transaction of the source so that it is
consistent (``extract``):

* every row beyond its table's mark (``marks``);
* every pointer row (thread tip, conversation head) whose pointer is not
  what the target last merged from this source: llm moves them in place;
* every integer-keyed row a row in it refers to, by column or by an id
  inside JSON, and what those refer to in turn: an integer id means
  nothing outside its file, so the merge matches such rows by their natural
  keys, which it must read;
* dagsync's records of what it holds: ``_dagsync_forks`` and
  ``_dagsync_message_map`` beyond their marks, ``_dagsync_origins`` of its
  pointer rows, and every tombstone (``_dagsync_forgotten``: forget).

Rows keep their rowids, so the order the source wrote them in (parents
before children) is the delta's too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import apsw

from dagsync import bookkeeping
from dagsync.db import harden, initialise
from dagsync.formats import Format, Key, Table
from dagsync.merge.marks import file_state, marked_tables, pointer_digest, taken

__all__ = ["Extract", "extract"]


@dataclass(frozen=True)
class Extract:
    """What ``extract`` wrote: the source's marks now (what the delta brings a
    target up to), rows per table, and for a delta made without the target
    (a bundle), each pointer table's digest (``marks.pointer_digest``)."""

    now: dict[str, tuple[int, str | None]]
    rows: dict[str, int]
    digests: dict[str, tuple[int, int]]
    state: str | None = None  # the source file's state, read with ``now`` (marks.file_state)


def extract(
    conn: apsw.Connection,
    fmt: Format,
    since: dict[str, tuple[int, str | None]],
    present: set[str],
    out: Path,
    snapshot: int | None,
) -> Extract:
    """Write to ``out`` (a new file) what the source attached to ``conn`` as
    ``src`` holds beyond the marks ``since``.

    ``snapshot``: the target's entry (attached as ``main``) whose pointer rows
    say which of the source's moved. Without it (a bundle, made where the
    target is not), a pointer row comes if it is new, points at a new
    message, or a new call or fork names it, and the digest of every
    pointer row lets the target prove nothing else moved (``bundle``).
    """
    _create(fmt, out)
    conn.execute("ATTACH DATABASE ? AS dlt", (str(out),))
    try:
        conn.execute("PRAGMA dlt.journal_mode = OFF")
        conn.execute("PRAGMA dlt.synchronous = OFF")
        conn.execute("BEGIN")
        try:
            now = taken(conn, fmt, "src", present)
            state = file_state(conn.db_filename("src"))  # after a read: under the SHARED lock
            rows = _fill(conn, fmt, since, present, now, snapshot)
            digests = {} if snapshot is not None else {
                t.name: pointer_digest(conn, "src", t.name, t.natural_key[0], t.pointer, now[t.name][0])
                for t in fmt.merge_order if t.pointer and t.name in present
            }  # fmt: skip
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    finally:
        for (name,) in list(conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table' AND name LIKE 'dl\\_%' ESCAPE '\\'")):
            conn.execute(f'DROP TABLE temp."{name}"')
        conn.execute("DETACH DATABASE dlt")
    return Extract(now, rows, digests, state)


def _create(fmt: Format, out: Path) -> None:
    """An empty file of the format with dagsync's records: no migration or sentinel rows of its own."""
    new = apsw.Connection(str(out))
    try:
        harden(new)
        # A scratch file until it is whole: no journal, no waiting for the disk.
        new.execute("PRAGMA journal_mode = OFF")
        new.execute("PRAGMA synchronous = OFF")
        with new:
            initialise(new, fmt)
            bookkeeping.ensure(new)
            new.execute("DELETE FROM _llm_migrations")
            # The dag sentinel comes from the source with its other first rows, if at all.
            new.execute("DELETE FROM messages")
            # No full-text indexing of what is copied in: a source's index is never
            # read (merge.derived), and it was half the cost of writing responses.
            for (name,) in list(new.execute("SELECT name FROM sqlite_schema WHERE type = 'trigger'")):
                new.execute(f'DROP TRIGGER "{name}"')
    finally:
        new.close()


def _fill(
    conn: apsw.Connection,
    fmt: Format,
    since: dict[str, tuple[int, str | None]],
    present: set[str],
    now: dict[str, tuple[int, str | None]],
    snapshot: int | None,
) -> dict[str, int]:
    """Choose each table's rows (referrers before what they refer to), then copy them."""
    order = [t for t in fmt.merge_order if t.name in present]
    for table in order:
        conn.execute(f'CREATE TEMP TABLE "dl_{table.name}" (rid INTEGER PRIMARY KEY)')
        if table.key is Key.INTEGER:
            conn.execute(f'CREATE TEMP TABLE "dl_need_{table.name}" (id INTEGER PRIMARY KEY)')
    for table in reversed(order):
        name = table.name
        low = since.get(name, (0, None))[0]
        high = now[name][0]
        chosen = f'INSERT OR IGNORE INTO temp."dl_{name}" SELECT rowid FROM src."{name}"'
        conn.execute(f"{chosen} WHERE rowid > ? AND rowid <= ?", (low, high))
        if table.pointer and snapshot is not None:
            key = table.natural_key[0]
            conn.execute(
                f"{chosen} s WHERE s.rowid <= ? AND NOT EXISTS (SELECT 1 FROM main._dagsync_mark_pointers p "
                f'WHERE p.source = ? AND p.tbl = ? AND p.key = s."{key}" AND p.head IS s."{table.pointer}")',
                (high, snapshot, name),
            )
        elif table.pointer:
            _touched(conn, fmt, table, since, now, present)
        if table.key is Key.INTEGER:
            conn.execute(f'{chosen} WHERE id IN (SELECT id FROM temp."dl_need_{name}") AND rowid <= ?', (high,))
        # What the chosen rows refer to must come too: by integer id always, by
        # text key where the target lacks it.
        # The chosen rows first (CROSS JOIN keeps that order): a few, looked up by rowid.
        rows = f'temp."dl_{name}" d CROSS JOIN src."{name}" s ON s.rowid = d.rid'
        for column, ref in fmt.references[name].items():
            if ref != name and fmt.table(ref).key is Key.INTEGER and ref in present:
                conn.execute(
                    f'INSERT OR IGNORE INTO temp."dl_need_{ref}" SELECT s."{column}" FROM {rows} '
                    f'WHERE s."{column}" IS NOT NULL'
                )
            if ref != name and fmt.table(ref).key is Key.TEXT and ref in present and snapshot is not None:
                # A row referred to that the target lacks comes too, wherever it lies
                # (a content-keyed row llm logged again, moved past its mark).
                ref_key = fmt.table(ref).natural_key[0]
                conn.execute(
                    f'INSERT OR IGNORE INTO temp."dl_{ref}" SELECT r.rowid FROM src."{ref}" r '
                    f'WHERE r."{ref_key}" IN (SELECT s."{column}" FROM {rows}) AND r.rowid <= ? '
                    f'AND NOT EXISTS (SELECT 1 FROM main."{ref}" t WHERE t."{ref_key}" = r."{ref_key}")',
                    (now[ref][0],),
                )
        for json_ref in table.json_refs:
            if json_ref.table in present:
                conn.execute(
                    f'INSERT OR IGNORE INTO temp."dl_need_{json_ref.table}" '
                    f"SELECT j.value ->> '$.{json_ref.id_key}' FROM {rows}, "
                    f"json_each(CASE WHEN json_valid(s.\"{json_ref.column}\") THEN s.\"{json_ref.column}\" END, "
                    f"'$.{json_ref.list_key}') j "
                    f"WHERE s.\"{json_ref.column}\" LIKE '%\"{json_ref.list_key}\"%' "
                    f"AND j.value ->> '$.{json_ref.id_key}' IS NOT NULL"
                )
    written = {}
    for table in order:
        columns = _shared_columns(conn, table.name)
        conn.execute(
            f'INSERT INTO dlt."{table.name}" (rowid, {columns}) SELECT rowid, {columns} FROM src."{table.name}" '
            f'WHERE rowid IN (SELECT rid FROM temp."dl_{table.name}") ORDER BY rowid'
        )
        written[table.name] = conn.changes()
    for name in marked_tables(fmt, present):
        if name.startswith("_dagsync_"):
            columns = _shared_columns(conn, name)
            conn.execute(
                f'INSERT INTO dlt."{name}" ({columns}) SELECT {columns} FROM src."{name}" WHERE rowid > ? AND rowid <= ?',
                (since.get(name, (0, None))[0], now[name][0]),
            )
            written[name] = conn.changes()
    if bookkeeping.has(conn, "_dagsync_origins", "src"):
        for table in order:
            if table.pointer:
                conn.execute(
                    f"INSERT INTO dlt._dagsync_origins SELECT o.* FROM src._dagsync_origins o "
                    f'WHERE o.pointer_table = ? AND o.key IN (SELECT "{table.natural_key[0]}" FROM dlt."{table.name}")',
                    (table.name,),
                )
    if bookkeeping.has(conn, "_dagsync_forgotten", "src"):
        # Every tombstone, so a forget travels with the delta (a bundle, a push): few rows.
        conn.execute("INSERT INTO dlt._dagsync_forgotten SELECT key, forgotten_at, restored_at FROM src._dagsync_forgotten")
    return written


def _touched(
    conn: apsw.Connection,
    fmt: Format,
    table: Table,
    since: dict[str, tuple[int, str | None]],
    now: dict[str, tuple[int, str | None]],
    present: set[str],
) -> None:
    """The pointer rows a bundle carries though they lie below their mark: those
    pointing at a message beyond its mark, or named by a call or a fork beyond theirs."""
    name, key, pointer = table.name, table.natural_key[0], table.pointer
    chosen = f'INSERT OR IGNORE INTO temp."dl_{name}" SELECT rowid FROM src."{name}" s WHERE s.rowid <= ? AND '

    def beyond(other: str, column: str) -> str:
        low, high = since.get(other, (0, None))[0], now[other][0]
        return f'(SELECT x."{column}" FROM src."{other}" x WHERE x.rowid > {int(low)} AND x.rowid <= {int(high)})'

    high = now[name][0]
    conn.execute(f'{chosen} s."{pointer}" IN {beyond("messages", fmt.message_key)}', (high,))
    if fmt.call_conversation and fmt.call_table in present and table.name == fmt.conversation_table:
        conn.execute(f'{chosen} s."{key}" IN {beyond(fmt.call_table, fmt.call_conversation)}', (high,))
    if "_dagsync_forks" in present:
        for column in ("key", "fork_key"):
            conn.execute(f'{chosen} s."{key}" IN {beyond("_dagsync_forks", column)}', (high,))


def _shared_columns(conn: apsw.Connection, table: str) -> str:
    """The columns both the source's table and the delta's have, quoted."""
    mine = [row[1] for row in conn.execute(f'PRAGMA dlt.table_info("{table}")')]
    theirs = {row[1] for row in conn.execute(f'PRAGMA src.table_info("{table}")')}
    return ", ".join(f'"{c}"' for c in mine if c in theirs)
