"""locks: the bytes SQLite locks in a database file, seen and taken from outside SQLite.

SQLite's unix VFS locks a database with POSIX advisory locks on bytes past
the first gigabyte (os_unix.c): PENDING, RESERVED, then a 510-byte SHARED
range. A reader holds a read lock in the SHARED range; a writer adds
RESERVED, then PENDING (no new reader may begin), then a write lock on the
whole SHARED range (EXCLUSIVE).

dagsync takes a target's write lock beside a live llm, which writes in
*deferred* transactions: it reads, then its first write asks for RESERVED.
In rollback-journal mode SQLite refuses that at once, whatever the busy
timeout, while another connection holds RESERVED (waiting could deadlock).
``BEGIN EXCLUSIVE`` takes RESERVED before it finds out whether a reader is
there, so a try alone can refuse an llm that is one step from writing.
Two things here keep a try from being one:

* ``holds_lock``: whether another process holds any of the bytes now;
* ``pending_first``: hold PENDING, the byte that stops new readers and that
  no reader's upgrade needs, before asking. A reader already there is seen
  and let finish; none can begin between the answer and the try.

POSIX locks belong to the process, not to a descriptor, and closing *any*
descriptor of a file drops every lock the process holds on it - SQLite's
own included. So PENDING is taken through the write connection's own
descriptor, which SQLite opened and keeps as long as the connection, never
through one opened here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import apsw

__all__ = ["holds_lock", "pending_first"]

PENDING_BYTE = 0x40000000
LOCK_LAST = PENDING_BYTE + 2 + 510 - 1  # RESERVED is PENDING+1, the SHARED range follows


def holds_lock(path: str) -> bool:
    """Whether another process holds any SQLite lock on the file at ``path``.

    Read from the kernel's list of held locks (Linux ``/proc/locks``) rather
    than asked with ``fcntl(F_GETLK)``: that needs a descriptor of the file,
    and closing any descriptor of a file drops every POSIX lock this process
    holds on it, SQLite's own included. Where the list cannot be read (not
    Linux, an in-memory database), the answer is no.
    """
    if not path:
        return False
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            held = f.read().splitlines()
    except OSError:
        return False
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    me = str(os.getpid())
    for line in held:
        fields = line.split()
        # "1: POSIX  ADVISORY  READ 5666 fe:00:2148082 1073741826 1073742335";
        # a waiter's line has "->" after the number: it holds nothing yet.
        if len(fields) < 8 or fields[1] == "->" or fields[5] != ident or fields[4] == me:
            continue
        start, end = fields[6], fields[7]
        if not start.isdigit():
            continue
        if int(start) <= LOCK_LAST and (end == "EOF" or (end.isdigit() and int(end) >= PENDING_BYTE)):
            return True
    return False


@contextlib.contextmanager
def pending_first(conn: apsw.Connection) -> Iterator[bool]:
    """Take the write lock of ``conn``'s file PENDING first, never holding RESERVED
    while another process reads; say whether the block should try its statement.

    SQLite's own way from SHARED to EXCLUSIVE without RESERVED (the one it
    takes to roll back a hot journal) is asked of the VFS directly: SHARED,
    then EXCLUSIVE, which takes PENDING (no reader can begin) and then finds
    out whether a reader is there. If one is, everything is let go at once
    and the block is told not to try: that reader can still upgrade, since
    PENDING does not stand in the way of RESERVED, and finishes first. If
    none is, the file is EXCLUSIVE, and the block's ``BEGIN EXCLUSIVE`` finds
    every lock it asks for already held: nobody met it half-way.

    A journal left by a crash must be rolled back by SQLite, which would
    take it for a live writer's while we hold EXCLUSIVE: if the journal file
    exists the lock is let go and the block is told to try its statement
    the usual way (``holds_lock`` first), as it is where the file cannot be
    reached through SQLite's unix VFS (another VFS, an in-memory database)
    or is not in rollback-journal mode.

    On leaving, whatever is still held is let go unless ``conn`` is now in a
    transaction, which owns it (SQLite lets go at COMMIT or ROLLBACK).
    """
    file = _unix_file(conn)
    if file is None:
        yield not holds_lock(conn.filename)
        return
    lock, unlock = file.contents.pMethods.contents.xLock, file.contents.pMethods.contents.xUnlock
    try:
        code = lock(file, apsw.SQLITE_LOCK_SHARED)
        if code == apsw.SQLITE_OK:
            code = lock(file, apsw.SQLITE_LOCK_EXCLUSIVE)
        if code == apsw.SQLITE_OK and os.path.exists(conn.filename + "-journal"):  # a crash's: SQLite's to roll back
            unlock(file, apsw.SQLITE_LOCK_NONE)
            yield not holds_lock(conn.filename)
        elif code & 0xFF == apsw.SQLITE_BUSY:
            yield False
        else:  # locked, or an error (an I/O error taking the lock) that the statement will meet and name
            if code != apsw.SQLITE_OK:
                unlock(file, apsw.SQLITE_LOCK_NONE)
            yield True
    finally:
        if not conn.in_transaction:
            unlock(file, apsw.SQLITE_LOCK_NONE)


class _IoMethods(ctypes.Structure):
    """The head of ``sqlite3_io_methods`` (sqlite3.h), up to the two locking methods."""

    _LOCK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    _fields_ = [
        ("iVersion", ctypes.c_int),
        *((name, ctypes.c_void_p) for name in ("xClose", "xRead", "xWrite", "xTruncate", "xSync", "xFileSize")),
        ("xLock", _LOCK),
        ("xUnlock", _LOCK),
    ]


class _File(ctypes.Structure):
    """``sqlite3_file`` (sqlite3.h): its methods, then the VFS's own state."""

    _fields_ = [("pMethods", ctypes.POINTER(_IoMethods))]


def _unix_file(conn: apsw.Connection) -> ctypes._Pointer[_File] | None:
    """The ``sqlite3_file`` of ``conn``'s main database, if SQLite's own unix VFS
    holds it for writing and the file is in rollback-journal (``delete``) mode;
    else None.

    ``SQLITE_FCNTL_FILE_POINTER`` hands it out; its locking methods are the
    VFS interface of sqlite3.h, which SQLite keeps stable.
    """
    if not conn.filename or conn.vfsname("main") != "unix" or conn.readonly("main"):
        return None
    if conn.execute("PRAGMA main.journal_mode").fetchall() != [("delete",)]:
        return None
    file = ctypes.POINTER(_File)()
    if not conn.file_control("main", apsw.SQLITE_FCNTL_FILE_POINTER, ctypes.addressof(file)) or not file:
        return None
    return file
