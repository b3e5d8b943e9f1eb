"""Opening databases with APSW.

Two kinds of file pass through dagsync:

* A **source** is someone's history that we only read, and we do not trust
  it: it is opened read-only with SQLite's defensive mode on and schema trust
  off, checked with ``quick_check``, and every object dagsync will read must
  be a real table with the columns its format has. A view or trigger posing
  as one of those tables is refused before anything reads it, so no SQL the
  file carries ever runs.
* A **target** is written. It gets a busy timeout, and write transactions
  retry on our side, because the llm CLI may be writing the same file with a
  5 s timeout and no retry of its own: we wait, it must not have to. Files
  dagsync creates are owner-only (0600); SQLite gives its journal and WAL
  files the database file's mode.

Every refusal is a ``DagsyncError`` whose message names what was found and
what to do.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import apsw

from dagsync import others
from dagsync.errors import NotADatabase, UnsupportedDatabase
from dagsync.formats import Format, Key, format_for_message_columns, normalise_sql

__all__ = [
    "Database",
    "OpenedMeanwhile",
    "Pacer",
    "SourceChecks",
    "create_private_file",
    "long_transactions",
    "open_source",
    "open_unchecked_source",
    "open_target",
    "rowid_ranges",
    "run_without_waiting",
    "vacuum",
    "VacuumReport",
    "write_transaction",
]

SQLITE_HEADER = b"SQLite format 3\x00"

# How long one statement waits for a lock before SQLite gives up, and how long
# a write transaction keeps retrying after that. The first is short so that we
# never queue ahead of llm for long; the second is our patience.
BUSY_TIMEOUT_MS = 2000
WRITE_RETRY_SECONDS = 120.0
CACHE_KIB = 65536
# Inside ``long_transactions``, while nobody else has the file open, commit
# this often. Whoever the open alarm cannot hear (a process of another user,
# or of another PID namespace, that had the file open before) waits for at
# most this plus one step plus the commit: well inside llm's 5 s.
LONG_COMMIT_SECONDS = 2.0


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


def _harden(conn: apsw.Connection) -> None:
    """No SQL stored in the file runs with more power than plain data needs."""
    conn.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, 1)
    conn.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0)


def _quick_check(conn: apsw.Connection, path: Path) -> None:
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
    except (apsw.CorruptError, apsw.NotADBError) as exc:
        problems = [str(exc)]
    if problems != ["ok"]:
        raise NotADatabase(
            f"{path} is damaged: PRAGMA quick_check says: {problems[0]}; "
            f"restore it from a backup, or recover a copy with `sqlite3 {path} .recover`"
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
    fmt = format_for_message_columns(set(columns))
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
        missing = [c for c in fmt.columns[table.name] if c not in _columns(conn, table.name)]
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
        _harden(conn)
        if quick_check:
            _quick_check(conn, path)
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


class SourceChecks:
    """``PRAGMA quick_check`` of source files, run in a thread while the caller reads them.

    quick_check reads every page, which is a second or more per GiB; a merge
    only reads (plans) until it first writes, so it checks its sources
    meanwhile, on its own connection (SQLite runs without the GIL), and waits
    for the verdict before that first write. Reading a damaged file is safe
    (SQLite reports the damage as an error); writing anything from one is
    what must not happen.
    """

    def __init__(self, paths: list[Path]) -> None:
        self._failure: NotADatabase | None = None
        self._thread = threading.Thread(target=self._run, args=(list(paths),), name="quick_check", daemon=True)
        self._thread.start()

    def _run(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
            except apsw.Error as exc:
                self._failure = NotADatabase(f"{path} cannot be opened: {exc}")
                return
            try:
                _harden(conn)
                _quick_check(conn, path)
            except NotADatabase as exc:
                self._failure = exc
                return
            except apsw.Error as exc:
                self._failure = NotADatabase(f"{path} cannot be checked: {exc}")
                return
            finally:
                conn.close()

    def wait(self) -> None:
        """Block until every source is checked.

        :raises NotADatabase: the first source quick_check found damaged.
        """
        self._thread.join()
        if self._failure is not None:
            raise self._failure


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
    conn = apsw.Connection(str(path.absolute()) if str(path).startswith("file:") else str(path), flags=flags)
    _harden(conn)
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)
    conn.execute("PRAGMA foreign_keys = OFF")
    # Merges insert into several indexes at once; SQLite's default 2 MiB
    # page cache makes that re-read pages it just wrote.
    conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    return conn


def open_target(
    path: str | os.PathLike[str], *, create: Format | None = None, adopt: bool = False
) -> Database:
    """Open a database to write to.

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


class Pacer:
    """Chunk sizes that keep each statement or transaction near ``target_seconds``.

    Start small, grow fourfold while a chunk takes under a quarter of the
    target and double while under half, halve when one takes over twice it:
    rows of one table cost very differently from another's (an FTS-indexed
    response versus a link row). ``target`` and ``largest`` may change
    between chunks.
    """

    def __init__(self, largest: int, first: int, target_seconds: float) -> None:
        self.size = min(first, largest)
        self.largest = largest
        self.target = target_seconds

    def timed(self, seconds: float) -> None:
        if seconds < self.target / 4:
            self.size = min(self.size * 4, self.largest)  # far below: get there sooner
        elif seconds < self.target / 2:
            self.size = min(self.size * 2, self.largest)
        elif seconds > self.target * 2:
            self.size = max(self.size // 2, 50)
        self.size = min(self.size, self.largest)


def rowid_ranges(conn: apsw.Connection, table: str, pacer: Pacer, where: str = "1") -> Iterator[tuple[int, int]]:
    """Consecutive inclusive rowid ranges of ``table`` (``schema."name"``) with about
    ``pacer.size`` rows each, among rows matching ``where``.

    The caller runs its statements (or a transaction) on one range per step;
    the time each step takes sizes the next, so none holds a lock on the file
    for long however big the table. Each bound is found by its own short read.
    """

    def one(sql: str, params: tuple = ()) -> Any:
        return next(iter(conn.execute(sql, params)), (None,))[0]

    low = one(f"SELECT min(rowid) FROM {table} WHERE {where}")
    while low is not None:
        high = one(
            f"SELECT rowid FROM {table} WHERE rowid >= ? AND {where} ORDER BY rowid LIMIT 1 OFFSET ?",
            (low, pacer.size - 1),
        )
        if high is None:
            high = one(f"SELECT max(rowid) FROM {table} WHERE {where}")
        started = time.perf_counter()
        yield low, high
        pacer.timed(time.perf_counter() - started)
        low = one(f"SELECT min(rowid) FROM {table} WHERE rowid > ? AND {where}", (high,))


@contextlib.contextmanager
def write_transaction(conn: apsw.Connection) -> Iterator[None]:
    """An exclusive write transaction that a running llm waits for rather than fails on.

    Joins an enclosing transaction if one is open; rolls back on any exception.

    llm writes with ``BEGIN`` (deferred): it reads, then upgrades to write.
    In rollback-journal mode SQLite refuses that upgrade at once, busy
    timeout or not, when another connection holds the write lock (waiting
    could deadlock). So:

    * we take the lock EXCLUSIVE: while we write, llm cannot even start
      reading, and its busy timeout makes it wait instead of failing;
    * we never wait for it while holding it: the lock is tried with no busy
      timeout, and if a reader is active we let go and try again later, so
      a reader half-way to writing finishes first;
    * after each commit we pause for a quarter of the transaction's length
      (at most 0.1 s): a waiting llm, sleeping in steps of at most 100 ms,
      gets its turn before our next transaction. The pause is skipped while
      no other process has had the file open since the first write
      (``others.may_be_waiting``): then nobody can be waiting.

    Inside ``long_transactions``, while nobody else has the file open, each
    one is a step of one long transaction instead.
    """
    long = _LONG.get(id(conn))
    if long is not None:
        with long.step():
            yield
        return
    if conn.in_transaction:
        yield
        return
    _begin_exclusive(conn)
    started = time.monotonic()
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    # A busy COMMIT leaves the transaction open, so it is safe to try again.
    _retry_busy(conn, "COMMIT")
    if others.may_be_waiting(conn.filename):
        time.sleep(min(0.1, (time.monotonic() - started) / 4))


class OpenedMeanwhile(Exception):
    """Another process opened the file in the middle of a statement of a long
    transaction: the statement was interrupted and the transaction rolled back.
    Everything committed before is consistent; the caller redoes the rest politely."""


@contextlib.contextmanager
def long_transactions(conn: apsw.Connection) -> Iterator[None]:
    """Let the ``write_transaction`` steps inside this block share long transactions
    while no other process has the file open.

    Short transactions are for a live writer's sake; with nobody else having
    the file open they only cost time: each commit rewrites every page of a
    random-keyed index (``content_hash``) that its rows touched. So, when an
    ``others.OpenAlarm`` can be had and nobody has had the file open, one
    exclusive transaction spans the steps, committed at a step's end every
    LONG_COMMIT_SECONDS. Steps keep their order, so every commit point is
    one that short transactions would have had.

    The moment another process opens the file (an llm about to write, which
    waits at most 5 s), the alarm interrupts the running statement. Between
    statements, the next step's end commits and the rest goes in short,
    polite transactions; inside one, the statement fails, the transaction is
    rolled back and ``OpenedMeanwhile`` is raised. Either way the newcomer
    waits for a rollback or a commit, not for the work.
    """
    path = conn.filename
    if conn.in_transaction or id(conn) in _LONG:
        yield  # already inside one: its owner decides
        return
    long = _LongTransaction(conn)
    # The alarm first: an open after it is heard, one before it is seen here.
    alarm = others.OpenAlarm.start(path, long.opened) if path else None
    if alarm is not None and others.may_be_waiting(path):
        alarm.close()
        alarm = None
    if alarm is None:
        yield  # somebody may be waiting, or could not be heard in time: short transactions
        return
    _LONG[id(conn)] = long
    try:
        try:
            yield
            if conn.in_transaction:
                _retry_busy(conn, "COMMIT")
        except apsw.InterruptError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if long.interrupted.is_set():
                raise OpenedMeanwhile(f"another process opened {path}") from exc
            raise
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    finally:
        _LONG.pop(id(conn), None)
        alarm.close()


class _LongTransaction:
    """The state of one ``long_transactions`` block: when its transaction began,
    and whether another process has opened the file since."""

    def __init__(self, conn: apsw.Connection) -> None:
        self.conn = conn
        self.began = 0.0
        self.interrupted = threading.Event()
        # The flag and the interrupt are one act: seen together or not at all.
        self.lock = threading.Lock()
        self.depth = 0  # write_transaction blocks open; the outermost is a step

    def opened(self) -> None:
        """From the alarm's thread: stop the running statement (a no-op between statements)."""
        with self.lock:
            self.interrupted.set()
            self.conn.interrupt()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step, outermost ``write_transaction`` block. A step that fails is
        not rolled back here: ``long_transactions`` rolls back the whole."""
        if self.depth == 0 and self.heard():
            # Heard between steps: the last step's end was a consistent point.
            self.let_in()
            with write_transaction(self.conn):  # a polite one, _LONG no longer names us
                yield
            return
        if self.depth == 0 and not self.conn.in_transaction:
            _begin_exclusive(self.conn)
            self.began = time.monotonic()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.step_done()

    def heard(self) -> bool:
        with self.lock:
            return self.interrupted.is_set()

    def let_in(self) -> None:
        """Somebody is waiting: commit now, and be polite from here on."""
        _LONG.pop(id(self.conn), None)
        if self.conn.in_transaction:
            _retry_busy(self.conn, "COMMIT")

    def step_done(self) -> None:
        """At a step's end, a point at which the file is consistent."""
        if self.heard():
            self.let_in()
        elif time.monotonic() - self.began >= LONG_COMMIT_SECONDS:
            _retry_busy(self.conn, "COMMIT")  # the next step begins the next one


# The connections inside ``long_transactions`` now, by id().
_LONG: dict[int, _LongTransaction] = {}


def _begin_exclusive(conn: apsw.Connection) -> None:
    """Take the write lock without ever waiting for it inside SQLite (see above)."""
    run_without_waiting(conn, "BEGIN EXCLUSIVE")


def run_without_waiting(conn: apsw.Connection, sql: str) -> None:
    """Run a statement that takes the write lock (``BEGIN EXCLUSIVE``, ``VACUUM``)
    with no busy timeout inside SQLite, retrying on our side (see ``write_transaction``).

    It is not even tried while another process holds a lock on the file: a
    try takes RESERVED and PENDING for a moment before it finds the reader
    and lets go, and an llm reader that tries to start writing in that
    moment is refused at once ("database is locked"), busy timeout or not.
    """
    conn.set_busy_timeout(0)
    try:
        _retry_busy(conn, sql, first_delay=0.005, idle=lambda: not others.holds_lock(conn.filename))
    finally:
        conn.set_busy_timeout(BUSY_TIMEOUT_MS)


def _retry_busy(
    conn: apsw.Connection, sql: str, first_delay: float = 0.01, idle: Callable[[], bool] = lambda: True
) -> None:
    """Run ``sql`` until the database is not busy, backing off, for WRITE_RETRY_SECONDS.

    ``sql`` is only tried when ``idle()`` says so (and always at the deadline).
    """
    deadline = time.monotonic() + WRITE_RETRY_SECONDS
    delay = first_delay
    while True:
        try:
            if idle() or time.monotonic() > deadline:
                conn.execute(sql)
                return
        except apsw.BusyError:
            if time.monotonic() > deadline:
                raise
        # Jitter so two waiting writers do not retry in lockstep.
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.2)


@dataclass(frozen=True)
class VacuumReport:
    mode: str  # "incremental", "full" (a one-time rewrite that makes later ones incremental), "auto"
    bytes_before: int
    bytes_after: int


def vacuum(db: Database, progress: Callable[[str, int, int], None] | None = None) -> VacuumReport:
    """Return free pages to the file system without holding the write lock for long.

    A file in incremental auto-vacuum mode is shrunk in short steps. Any
    other file needs one full ``VACUUM`` (a rewrite, holding the lock for its
    whole length), which also switches it to incremental mode so that every
    later ``--vacuum`` is short.
    """
    conn = db.conn
    path = Path(db.path)
    before = path.stat().st_size
    mode = next(conn.execute("PRAGMA auto_vacuum"))[0]
    if mode == 1:  # FULL: SQLite already gave the pages back at each commit.
        return VacuumReport("auto", before, path.stat().st_size)
    if mode == 0:
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        if progress:
            progress("vacuum (full, once)", 0, 1)
        run_without_waiting(conn, "VACUUM")
        return VacuumReport("full", before, path.stat().st_size)
    pacer = Pacer(1_000_000, 2000, 0.5)
    free = next(conn.execute("PRAGMA freelist_count"))[0]
    total = free
    while free:
        started = time.perf_counter()
        with write_transaction(conn):
            # The pragma frees pages as its statement is stepped: run it to the end.
            conn.execute(f"PRAGMA incremental_vacuum({int(pacer.size)})").fetchall()
        pacer.timed(time.perf_counter() - started)
        free = next(conn.execute("PRAGMA freelist_count"))[0]
        if progress:
            progress("vacuum", total - free, total)
    return VacuumReport("incremental", before, path.stat().st_size)
