"""Opening databases with APSW.

Two kinds of file pass through dagsync:

* A **source** is someone's history that we only read, and we do not trust
  it: it is opened read-only with SQLite's defensive mode on and schema trust
  off, checked with ``quick_check``, and every object dagsync will read must
  be a real table with the columns its format has. A view or trigger posing
  as one of those tables is refused before anything reads it, so no SQL the
  file carries ever runs.
* A **target** is written. It gets a busy timeout; how it is written beside
  a live llm (which waits 5 s and never retries) is ``writer``'s to decide.
  Files dagsync creates are owner-only (0600); SQLite gives its journal and
  WAL files the database file's mode.

Every refusal is a ``DagsyncError`` whose message names what was found and
what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import apsw

from dagsync import checks, others
from dagsync.checks import READ_BUSY_TIMEOUT_MS, SourceChecks, check_pages, harden, quote
from dagsync.errors import NotADatabase, UnsupportedDatabase
from dagsync.formats import Format, Key, normalise_sql
from dagsync.formats.dag import DAG
from dagsync.formats.llm import LLM
from dagsync.transactions import patient, write_transaction

__all__ = [
    "Database",
    "SourceChecks",
    "check_pages",
    "create_private_file",
    "harden",
    "open_source",
    "open_unchecked_source",
    "open_target",
]

SQLITE_HEADER = b"SQLite format 3\x00"

CACHE_KIB = 65536
# A thin source (the rows beyond a target's marks: a delta, a bundle) writes a
# few pages of each index; half the cache holds them as well, and keeps a
# nightly push's memory small (benchmarks/incremental.py).
THIN_CACHE_KIB = 32768


@dataclass
class Database:
    """An open database and the format it was found to be in."""

    conn: apsw.Connection
    path: Path
    format: Format

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_private_file(path: Path) -> None:
    """Create an empty file readable and writable by its owner only.

    SQLite would create the file with the process umask (often 0644); we make
    it first, exclusively, so it never exists with wider permissions.

    :raises FileExistsError: the file already exists.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _check_file(path: Path) -> None:
    """Refuse what is not a plausible SQLite file, before SQLite opens it."""
    if not path.exists():
        raise NotADatabase(f"{path}: no such file")
    if path.is_dir():
        raise NotADatabase(f"{path} is a directory, not a database file")
    size = path.stat().st_size
    if size == 0:
        raise NotADatabase(f"{path} is empty (0 bytes): it is not an llm database")
    with open(path, "rb") as f:
        header = f.read(100)
    if not header.startswith(SQLITE_HEADER):
        raise NotADatabase(
            f"{path} is not a SQLite database (it does not start with the SQLite header)"
        )
    if len(header) < 100:
        raise NotADatabase(f"{path} is truncated: it ends inside the SQLite header")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    page_count = int.from_bytes(header[28:32], "big")
    # The in-header size is valid only when the two change counters agree.
    if header[24:28] == header[92:96] and page_count * page_size > size:
        raise NotADatabase(
            f"{path} is truncated: its header says {page_count * page_size} bytes "
            f"but the file has {size}; restore it from a backup"
        )


@dataclass(frozen=True)
class _Schema:
    """A file's schema objects by kind: a trigger may share a table's name."""

    tables: dict[str, str]  # table name -> its CREATE statement
    views: set[str]
    triggers: dict[str, tuple[str, str]]  # trigger name -> (its table, its SQL normalised)

    @staticmethod
    def read(conn: apsw.Connection) -> _Schema:
        tables: dict[str, str] = {}
        views: set[str] = set()
        triggers: dict[str, tuple[str, str]] = {}
        for kind, name, tbl, sql in conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_schema"):
            if kind == "table":
                tables[name] = sql or ""
            elif kind == "view":
                views.add(name)
            elif kind == "trigger":
                triggers[name] = (tbl, normalise_sql(sql or ""))
        return _Schema(tables, views, triggers)


def _columns(conn: apsw.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (table,))]


def _is_rowid_alias(conn: apsw.Connection, table: str) -> bool:
    """``id INTEGER PRIMARY KEY``: the id is the rowid, so it is never NULL or repeated."""
    rows = list(conn.execute("SELECT name, type, pk FROM pragma_table_info(?)", (table,)))
    return [(n, t.upper()) for n, t, pk in rows if pk] == [("id", "INTEGER")]


def _not_a_table(path: Path, name: str, kind: str) -> UnsupportedDatabase:
    return UnsupportedDatabase(
        f"{path}: '{name}' is a {kind}, not a table; dagsync reads only real "
        "tables from a source, so it refused the file without reading it"
    )


def detect_format(conn: apsw.Connection, path: Path) -> Format:
    """The file's format, from the columns of its ``messages`` table.

    :raises UnsupportedDatabase: no messages table, a view in its place, or
        columns of neither format.
    """
    schema = _Schema.read(conn)
    if "messages" not in schema.tables:
        if "messages" in schema.views:
            raise _not_a_table(path, "messages", "view")
        tables = sorted(schema.tables)
        if not tables:
            raise UnsupportedDatabase(f"{path} is an empty SQLite database: it has no tables")
        if "responses" in schema.tables and "_llm_migrations" in schema.tables:
            raise UnsupportedDatabase(
                f"{path} is an llm database from before the message store (it has "
                "llm's responses table but no messages table): open it once with "
                f"llm 0.32 or later (for example `llm logs -n 1 -d {path}`), which "
                "migrates it, then try again"
            )
        shown = ", ".join(tables[:6]) + (", ..." if len(tables) > 6 else "")
        raise UnsupportedDatabase(
            f"{path} is not an llm database: it has no messages table (tables: {shown})"
        )
    columns = _columns(conn, "messages")
    fmt = next((f for f in (DAG, LLM) if f.marker_columns <= set(columns)), None)
    if fmt is None:
        raise UnsupportedDatabase(
            f"{path} has a messages table of an unknown layout (columns: "
            f"{', '.join(columns)}): it is neither the dag format (id, parent_id, "
            "content_hash) nor the llm format (hash, parent_hash)"
        )
    return fmt


def check_tables(conn: apsw.Connection, path: Path, fmt: Format) -> None:
    """Every table the format describes is a real table with the format's columns.

    Tables that are optional may be absent. Triggers are allowed only where
    the format's own DDL creates them: a read-only source never fires one,
    but a file altered that way is not one we copy history from.

    :raises UnsupportedDatabase: naming the first object that fails.
    """
    schema = _Schema.read(conn)
    described = {t.name for t in fmt.tables}
    for table in fmt.tables:
        if table.name not in schema.tables:
            if table.name in schema.views:
                raise _not_a_table(path, table.name, "view")
            if table.required:
                raise UnsupportedDatabase(
                    f"{path} looks like the {fmt.name} format but has no "
                    f"{table.name} table: it is half-migrated or damaged; open it "
                    "with the llm that wrote it, then try again"
                )
            continue
        if table.key is Key.DERIVED:
            sql = schema.tables[table.name].upper()
            if not sql.startswith("CREATE VIRTUAL TABLE") or "FTS5" not in sql:
                raise UnsupportedDatabase(
                    f"{path}: '{table.name}' is not the FTS5 index llm creates; "
                    "dagsync refused the file without reading it"
                )
            continue
        if table.key is Key.INTEGER and not _is_rowid_alias(conn, table.name):
            raise UnsupportedDatabase(
                f"{path}: '{table.name}.id' is not an INTEGER PRIMARY KEY as llm makes it; "
                "dagsync refused the file without reading it"
            )
        present = set(_columns(conn, table.name))
        missing = [c for c in fmt.columns[table.name] if c not in present]
        if missing:
            raise UnsupportedDatabase(
                f"{path}: table '{table.name}' lacks column(s) {', '.join(missing)} "
                f"of the {fmt.name} format; the file is from an older llm: open it "
                "with the llm that wrote it (which migrates it), then try again"
            )
    for name, (tbl, sql) in sorted(schema.triggers.items()):
        if (tbl in described or name in described) and fmt.triggers.get(name) != (tbl, sql):
            raise UnsupportedDatabase(
                f"{path}: trigger '{name}' on table '{tbl}' is not one llm creates; "
                "dagsync does not read sources altered this way (it never runs "
                "their triggers); drop the trigger in a copy if you trust the file"
            )


def open_source(path: str | os.PathLike[str], *, quick_check: bool = True) -> Database:
    """Open a database read-only, as untrusted input, and check it before use.

    ``quick_check=False`` is for ``verify``, which runs the full
    ``integrity_check`` itself and reports what it finds.

    :raises NotADatabase: missing, empty, not SQLite, truncated or damaged.
    :raises UnsupportedDatabase: not an llm database, or one altered so that
        reading it could run SQL it carries.
    """
    path = Path(path)
    _check_file(path)
    try:
        conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    except apsw.Error as exc:
        raise NotADatabase(f"{path} cannot be opened: {exc}") from exc
    try:
        harden(conn)
        patient(conn, READ_BUSY_TIMEOUT_MS)
        if quick_check:
            checks.quick_check(conn, path)
        fmt = detect_format(conn, path)
        check_tables(conn, path, fmt)
    except apsw.ReadOnlyError as exc:
        conn.close()
        # A hot journal: only a connection that may write can roll it back.
        raise NotADatabase(
            f"{path} has an unfinished transaction in {path.name}-journal (a process stopped "
            "while writing it); a read-only open cannot roll that back: open the file read-write "
            f"once (for example: sqlite3 '{path}' 'PRAGMA quick_check'), then try again"
        ) from exc
    except BaseException:
        conn.close()
        raise
    return Database(conn, path, fmt)


def open_unchecked_source(path: str | os.PathLike[str]) -> Database:
    """``open_source`` without its quick_check, for a caller that runs ``SourceChecks``.

    A file too damaged even to read its schema gets quick_check's verdict now.
    """
    try:
        return open_source(path, quick_check=False)
    except apsw.Error:
        with open_source(path):  # raises NotADatabase naming the damage...
            pass
        raise  # ...or, if quick_check finds none, the error itself


def _connect_target(path: Path) -> apsw.Connection:
    # URI filenames let a merge ATTACH its sources read-only (``?mode=ro``);
    # the target's own path is passed as a plain path, never a URI.
    flags = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI
    with others.own_open(str(path)):  # this process's own open: nobody waiting for its locks
        conn = apsw.Connection(str(path.absolute()) if str(path).startswith("file:") else str(path), flags=flags)
    harden(conn)
    patient(conn)
    conn.execute("PRAGMA foreign_keys = OFF")
    # Merges insert into several indexes at once; SQLite's default 2 MiB
    # page cache makes that re-read pages it just wrote.
    conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    return conn


def open_target(
    path: str | os.PathLike[str], *, create: Format | None = None, adopt: bool = False, check: bool = False
) -> Database:
    """Open a database to write to.

    With ``check``, an existing file's pages are checked first (``check_pages``),
    so that nothing is ever written into a damaged file.

    With ``create``, a missing or empty file is made (0600) and given that
    format's schema. With ``adopt`` as well, an existing SQLite file that has
    no messages table (an llm database from before the message store) gets
    the format's tables added, as llm's own migration would. Otherwise an
    existing file must already be in a format dagsync knows.

    :raises NotADatabase: missing (and not asked to create), or not SQLite.
    :raises UnsupportedDatabase: a SQLite file in no known format.
    """
    path = Path(path)
    if create is not None and not path.exists():
        create_private_file(path)
    if create is None or path.stat().st_size > 0:
        _check_file(path)
    conn = _connect_target(path)
    try:
        if check and path.stat().st_size > 0:
            check_pages(conn, path)
        has_messages = any(conn.execute("SELECT 1 FROM sqlite_schema WHERE name = 'messages'"))
        is_empty = not any(conn.execute("SELECT 1 FROM sqlite_schema"))
        if create is not None and (is_empty or (adopt and not has_messages)):
            with write_transaction(conn):
                initialise(conn, create)
        fmt = detect_format(conn, path)
        check_tables(conn, path, fmt)
    except BaseException:
        conn.close()
        raise
    return Database(conn, path, fmt)


def initialise(conn: apsw.Connection, fmt: Format) -> None:
    """Give an empty (or partly built) database the format's schema.

    Idempotent: every CREATE is IF NOT EXISTS and the rows it adds are
    INSERT OR IGNORE. Call inside a write transaction.
    """
    new = not any(conn.execute("SELECT 1 FROM sqlite_schema WHERE name = '_llm_migrations'"))
    conn.execute(fmt.schema_sql)
    if new:
        # A file we create records the migrations its schema embodies, so the
        # llm that reads it does not try to migrate it again.
        conn.executemany(
            "INSERT OR IGNORE INTO _llm_migrations (name, applied_at) "
            "VALUES (?, strftime('%Y-%m-%d %H:%M:%f', 'now'))",
            [(name,) for name in fmt.migrations],
        )
    for table in fmt.tables:
        # Older llm files have a conversations table without the head pointer.
        if table.pointer and table.pointer not in _columns(conn, table.name):
            conn.execute(f'ALTER TABLE "{table.name}" ADD COLUMN "{table.pointer}" TEXT')
    if fmt.root_id is not None:
        conn.execute(
            f"INSERT OR IGNORE INTO messages ({fmt.message_key}, {fmt.parent_column}, "
            "content_hash, role, created_at) VALUES (?, ?, '', 'root', ?)",
            (fmt.root_id, fmt.root_id, "1970-01-01T00:00:00Z"),
        )
