"""Text that is not UTF-8: found, and named by table, column and row.

SQLite stores whatever bytes it is given as TEXT, and never checks them;
llm only ever writes UTF-8. A TEXT value that is not UTF-8 is damage (a bad
disk, a program writing bytes as text), and Python cannot read it as a
string: the first statement that hands one to Python fails. That failure
is only a symptom. ``first`` and ``values`` find the values themselves, by
their bytes, so that a command can name the row (``faults.named``) and
``verify`` can list them. A healthy file never pays for the search: it runs
only after a read has failed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import apsw

from dagsync.checks import harden
from dagsync.errors import DamagedSource

__all__ = ["NotText", "NotUtf8", "first", "found_in", "open_and_find", "values"]

FUNCTION = "dagsync_not_utf8"


class NotText(DamagedSource):
    """A TEXT value that is not UTF-8: the file is damaged."""

    def __init__(self, message: str, path: str, found: "NotUtf8") -> None:
        super().__init__(message)
        self.path, self.found = path, found


@dataclass(frozen=True)
class NotUtf8:
    """A TEXT value whose bytes are not UTF-8, and where the first bad byte is."""

    table: str
    column: str
    rowid: int | None
    why: str

    def __str__(self) -> str:
        where = f"row {self.rowid}" if self.rowid is not None else "a row without a rowid"
        return f"{self.table}.{self.column} of {where} is not UTF-8 text ({self.why})"


def found_in(path: str | os.PathLike[str], found: NotUtf8, written: str = "nothing was written") -> NotText:
    """The error naming ``found`` in the file at ``path``; ``written`` says what the command wrote."""
    return NotText(
        f"{path} is damaged: {found}; {written} - run `dagsync verify {path}` to list every such value, "
        "and restore the file from a backup",
        os.fspath(path), found,
    )


def _why(data: bytes) -> str | None:
    """None for UTF-8 bytes; else where and why they are not."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte 0x{data[exc.start]:02x} at offset {exc.start}: {exc.reason}"
    return None


def _name(data: bytes) -> str:
    return data.decode("utf-8", "backslashreplace")


def values(conn: apsw.Connection, schema: str = "main", limit: int | None = None) -> Iterator[NotUtf8]:
    """Every TEXT value of ``schema``'s tables that is not UTF-8, table by table
    (names in sqlite_schema too: a table's or column's name can be damaged)."""
    conn.create_scalar_function(FUNCTION, _why, 1, deterministic=True)
    found = 0
    tables = list(conn.execute(
        f"SELECT CAST(name AS BLOB), CAST(sql AS BLOB), {FUNCTION}(CAST(name AS BLOB)), "
        f"{FUNCTION}(CAST(sql AS BLOB)) FROM {schema}.sqlite_schema WHERE type = 'table' "
        "AND coalesce(sql, '') NOT LIKE 'CREATE VIRTUAL TABLE%' ORDER BY rowid"
    ))  # fmt: skip
    for raw, _sql, name_why, sql_why in tables:
        if name_why or sql_why:
            yield NotUtf8("sqlite_schema", "name" if name_why else "sql", None, f"the table {_name(raw)}: {name_why or sql_why}")
            found += 1
            continue
        table = raw.decode("utf-8")
        quoted = _quoted(table)
        columns = [c for (_, c, *_rest) in conn.execute(f"PRAGMA {schema}.table_info({quoted})")]
        if not columns:
            continue
        rowid = _rowid(conn, schema, quoted)
        checks = [f"CASE WHEN typeof({q}) = 'text' THEN {FUNCTION}(CAST({q} AS BLOB)) END" for q in map(_quoted, columns)]
        query = (
            f"SELECT {rowid or 'NULL'}, {', '.join(checks)} FROM {schema}.{quoted} "
            f"WHERE {' OR '.join(f'({check}) IS NOT NULL' for check in checks)}"
        )
        for row in conn.execute(query):
            for column, why in zip(columns, row[1:]):
                if why is not None:
                    yield NotUtf8(table, column, row[0], why)
                    found += 1
                    if limit is not None and found >= limit:
                        return


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _rowid(conn: apsw.Connection, schema: str, quoted: str) -> str | None:
    """``rowid``, or None for a WITHOUT ROWID table."""
    try:
        conn.execute(f"SELECT rowid FROM {schema}.{quoted} LIMIT 0").fetchall()
    except apsw.SQLError:
        return None
    return "rowid"


def first(conn: apsw.Connection, schema: str = "main") -> NotUtf8 | None:
    return next(values(conn, schema, limit=1), None)


def open_and_find(path: str | os.PathLike[str]) -> NotUtf8 | None:
    """The first value of the file at ``path`` that is not UTF-8 (opened read-only,
    hardened: only data is read), or None, also where it cannot be read."""
    try:
        conn = apsw.Connection(os.fspath(path), flags=apsw.SQLITE_OPEN_READONLY)
    except apsw.Error:
        return None
    try:
        harden(conn)
        return first(conn)
    except apsw.Error:
        return None
    finally:
        conn.close()
