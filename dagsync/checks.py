"""What dagsync checks of a file before it trusts what it reads or writes into it.

* a **hardened** connection: no SQL stored in the file (a view, a trigger)
  runs with more power than plain data needs;
* **every page** (``PRAGMA quick_check``): a damaged file is refused with
  one line, before anything is written into it (``check_pages``) or copied
  from it (``quick_check``, ``SourceChecks`` in a thread while a merge plans).
"""

from __future__ import annotations

import threading
from pathlib import Path

import apsw

from dagsync import others
from dagsync.errors import NotADatabase
from dagsync.transactions import patient

__all__ = ["READ_BUSY_TIMEOUT_MS", "SourceChecks", "check_pages", "harden", "quick_check", "quote", "said"]

# How long a reader of a source waits for a writer's commit (llm holds its
# lock for milliseconds; a source being written is waited for, not refused).
READ_BUSY_TIMEOUT_MS = 10_000


def harden(conn: apsw.Connection) -> None:
    """No SQL stored in the file runs with more power than plain data needs."""
    conn.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, 1)
    conn.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0)


def quick_check(conn: apsw.Connection, path: Path) -> None:
    _refuse_damage(path, _checked(conn, ["PRAGMA quick_check"]), "")


def check_pages(conn: apsw.Connection, path: Path) -> None:
    """``PRAGMA quick_check`` of every table, one table at a time, before a command writes.

    One table at a time, because a check holds a read lock for as long as it
    runs, and in llm's rollback-journal mode a read lock holds off llm's
    commit: a whole-file check of a file of a few GB would outlast llm's 5 s
    wait. One table's check is the longest lock this takes (2.1 s for the
    largest table of a 1.25 GB file, measured; 3.4 s for all of them).

    :raises NotADatabase: naming the first damage found; nothing was written.
    """
    try:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")]
    except (apsw.CorruptError, apsw.NotADBError) as exc:
        _refuse_damage(path, str(exc), "nothing was written - ")
    checks = [f"PRAGMA quick_check({quote(name)})" for name in tables]
    _refuse_damage(path, _checked_on_two_cores(conn, path, checks), "nothing was written - ")


# The page cache of a page check (KiB): each page is read once, so a big cache
# would only raise the peak memory of the command that checks.
CHECK_CACHE_KIB = 2048


def _checked_on_two_cores(conn: apsw.Connection, path: Path, checks: list[str]) -> str:
    """``_checked``, the checks shared between ``conn`` and a second, read-only
    connection in a thread (SQLite runs without the GIL): what the first of
    ``checks`` to find damage says, as one connection would, or "ok".

    Two readers lock no longer than one: a writer that wants the file (llm)
    takes its PENDING lock, which lets no new check begin, and waits for the
    checks under way, one table each, as it would for one connection's.
    """
    try:
        with others.own_open(str(path)):
            helper = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    except apsw.Error:
        helper = None
    if helper is None or len(checks) < 2:
        if helper is not None:
            helper.close()
        return _checked(conn, checks)
    saved = next(conn.execute("PRAGMA main.cache_size"))[0]
    queue = list(enumerate(checks))
    found: dict[int, str] = {}
    failed: list[BaseException] = []
    lock = threading.Lock()

    def work(c: apsw.Connection) -> None:
        try:
            while True:
                with lock:
                    if not queue or failed or (found and queue[0][0] > min(found)):
                        return
                    n, check = queue.pop(0)
                problem = _checked(c, [check])
                if problem != "ok":
                    with lock:
                        found[n] = problem
        except BaseException as exc:  # an I/O error, say: raised in the caller's thread
            with lock:
                failed.append(exc)

    try:
        harden(helper)
        patient(helper, READ_BUSY_TIMEOUT_MS)
        helper.execute(f"PRAGMA cache_size = -{CHECK_CACHE_KIB}")
        conn.execute(f"PRAGMA main.cache_size = -{CHECK_CACHE_KIB}")
        thread = threading.Thread(target=work, args=(helper,), name="dagsync page check", daemon=True)
        thread.start()
        work(conn)
        thread.join()
    finally:
        conn.execute(f"PRAGMA main.cache_size = {saved}")
        helper.close()
    if failed:
        raise failed[0]
    return found[min(found)] if found else "ok"


def _checked(conn: apsw.Connection, checks: list[str]) -> str:
    """What the first of ``checks`` to find damage says, or "ok"."""
    try:
        for check in checks:
            problems = [row[0] for row in conn.execute(check)]
            if problems != ["ok"]:
                return problems[0]
    except (apsw.CorruptError, apsw.NotADBError) as exc:
        return str(exc)
    return "ok"


def _refuse_damage(path: Path, problem: str, written: str) -> None:
    """:raises NotADatabase: unless quick_check said "ok"."""
    if problem != "ok":
        raise NotADatabase(
            f"{path} is damaged: PRAGMA quick_check says: {said(problem)}; {written}"
            f"restore it from a backup, or recover a copy with `sqlite3 {path} .recover`"
        )


def said(problem: str, limit: int = 300) -> str:
    """What quick_check said, on one line and at most about ``limit`` characters."""
    text = " ".join(str(problem).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def quote(name: str) -> str:
    return "'" + name.replace("'", "''") + "'"


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
                harden(conn)
                patient(conn, READ_BUSY_TIMEOUT_MS)
                quick_check(conn, path)
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

    def join(self) -> None:
        """Block until the checks have stopped, raising nothing: for a caller that
        fails before it waits (its own error says more), so no thread reads the
        sources after it has returned."""
        self._thread.join()
