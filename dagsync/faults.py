"""Faults named: what the disk, the file system or another program did, in one line.

SQLite reports a full disk, a read-only file, a lock held too long and an
I/O error as exceptions that say little to a person ("database or disk is
full"). Every writing operation is wrapped in ``named``, which turns them
into a ``DagsyncError`` that names the file, says what happened and what to
do. What was committed before the fault is consistent (every commit point
is), and the transaction the fault interrupted is rolled back by SQLite, so
each message can say the file is intact.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

import apsw

from dagsync import encoding
from dagsync.errors import DagsyncError

__all__ = ["Fault", "named", "not_utf8", "one_line"]

F = TypeVar("F", bound=Callable[..., Any])

INTACT = "the file is as it was after its last commit"


class Fault(DagsyncError):
    """The disk, the file system or another program stopped an operation."""


def one_line(text: str) -> str:
    """``text`` with its line breaks folded (SQLite's messages can hold several lines)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _what(path: str, exc: BaseException) -> str | None:
    """The one-line message for a fault, or None for an exception that is not one."""
    detail = one_line(str(exc)) or type(exc).__name__
    number = getattr(exc, "errno", None)
    if isinstance(exc, apsw.FullError) or number == errno.ENOSPC:
        return (
            f"{path}: the disk is full ({detail}); {INTACT} - free some space (a merge needs room for what "
            "it copies, in the file and in the temp directory) and run the command again"
        )
    if isinstance(exc, (apsw.ReadOnlyError, apsw.CantOpenError)) or number in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"{path}: cannot be written ({detail}): the file or its directory is read-only, and SQLite "
            f"writes a journal beside the file; nothing was written - make both writable and run the command again"
        )
    if isinstance(exc, apsw.BusyError):
        return (
            f"another program is writing to {path}; try again when it has finished (it held its lock "
            f"longer than dagsync waits; {INTACT}; `fuser {path}` shows who has it open)"
        )
    if isinstance(exc, (apsw.IOError, apsw.CorruptError, apsw.NotADBError)) or number == errno.EIO:
        return (
            f"{path}: an I/O error ({detail}); the interrupted transaction was rolled back - check the "
            f"disk (dmesg, smartctl), then run `dagsync verify {path}` before using the file again"
        )
    return None


def _locked(paths: list[str]) -> str:
    """The first of ``paths`` another program holds a lock on that stops a reader
    (a lock that stopped a writer only, the first: the file written to)."""
    for path in paths:
        try:
            conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        except apsw.Error:
            continue
        try:
            conn.execute("SELECT count(*) FROM sqlite_schema").fetchall()
        except apsw.BusyError:
            return path
        except apsw.Error:
            pass
        finally:
            conn.close()
    return paths[0]


def not_utf8(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was raised while handling, Python failing to read TEXT
    as UTF-8 (the statement that met it stays open, so cleanup after it can fail too)."""
    while exc is not None:
        if isinstance(exc, UnicodeDecodeError):
            return True
        exc = exc.__context__
    return False


def _paths(arguments: dict[str, Any], parameter: str, others: tuple[str, ...]) -> list[str]:
    """The file passed as ``parameter``, then those in ``others`` (a path or a list of paths each)."""
    paths = [os.fspath(arguments[parameter])]
    for name in others:
        value = arguments.get(name)
        values = [value] if isinstance(value, (str, os.PathLike)) else list(value or ())
        paths += [os.fspath(v) for v in values]
    return paths


def named(parameter: str, *others: str) -> Callable[[F], F]:
    """Wrap an operation so that a fault becomes a ``Fault`` naming the file
    passed as ``parameter``; a lock held too long names whichever of it and
    the files in ``others`` (a path or a list of paths each) is locked."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except DagsyncError:
                raise
            except (apsw.Error, OSError, UnicodeDecodeError) as exc:
                arguments = signature.bind(*args, **kwargs).arguments
                if not_utf8(exc):
                    # A TEXT value that is not UTF-8, met by a read (every read
                    # comes before the first write): find it and name it.
                    for path in _paths(arguments, parameter, others):
                        found = encoding.open_and_find(path)
                        if found is not None:
                            raise encoding.found_in(path, found) from None
                    raise
                path = os.fspath(arguments[parameter])
                if isinstance(exc, apsw.BusyError) and others:
                    path = _locked(_paths(arguments, parameter, others))
                what = _what(str(path), exc)
                if what is None:
                    raise
                raise Fault(what) from exc

        return wrapper  # type: ignore[return-value]

    return wrap
