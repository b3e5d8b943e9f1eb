"""writer: the one owner of how a target is written, beside a live llm.

Every operation that writes a target - merge, gc, pack, unpack,
canonicalise, vacuum - says *what* to write, a chunk at a time, and hands
the chunks to a ``Writer``, which decides *how*:

* how big a chunk is: each statement and each write transaction aims at a
  length of time (``TARGET_SECONDS``), learnt as the loop goes (``Pacer``);
* whether a chunk is a short transaction of its own or a step of one long
  transaction (while no other process has the file open), and what happens
  when another process opens the file in the middle of one (``redo``);
* how the write lock is taken and waited for, and when to pause after a
  commit so that a waiting llm gets in (``transactions``, below the writer);
* when a progress report may be passed on (never inside a transaction: a
  callback that blocks, a terminal paused with Ctrl-S, must not hold the lock);
* what counts as done: ``on_commit`` work runs once the rows it counts are
  committed, and is forgotten when they are rolled back.

Why it is so careful: llm writes the same file with a 5 s busy timeout and
no retry, so a writer beside it must never make it wait long
(``transactions`` says why and how; ``others`` tells who else has the file
open). Reads are chunked too: in rollback-journal mode a long read would
block llm's commits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import apsw

from dagsync import others, transactions
from dagsync.errors import DagsyncError
from dagsync.transactions import OpenedMeanwhile

__all__ = ["OpenedMeanwhile", "Pacer", "Progress", "Writer"]

T = TypeVar("T")
Progress = Callable[[str, int, int], None]

# Aim for statements and write transactions this long; chunk sizes adapt to
# it. Far below llm's 5 s busy timeout.
TARGET_SECONDS = 0.8
# While no other process has had the target open, nobody waits for our lock,
# and one that opens it meanwhile waits for at most one step: write steps may
# be this long (fewer, larger statements). Still well inside a 5 s timeout.
ALONE_TARGET_SECONDS = 1.6
FIRST_CHUNK = 2000
MAX_READ_CHUNK = 100_000
# A write's cost is less even than a read's (an FTS index may merge its
# segments in one of them), so write chunks stay smaller.
MAX_WRITE_CHUNK = 50_000
ALONE_MAX_WRITE_CHUNK = 200_000
# Work interrupted because another process opened the file is redone, this
# many times in all (after the first, politely: it cannot be interrupted again).
ATTEMPTS = 3


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


class Writer:
    """Writes one target for one operation: chunks, transactions, progress.

    An operation asks for ``ranges`` of a table (or ``sizes``), writes each
    one inside ``transaction()``, reports with ``progress`` and counts with
    ``on_commit``; around the whole it holds a ``session()``, or lets
    ``redo`` hold it and start again when the session had to give way. With
    ``dry_run`` nothing is written: transactions and sessions are no-ops,
    and ``on_commit`` work runs at once.
    """

    def __init__(self, conn: apsw.Connection, progress: Progress | None = None, *, dry_run: bool = False) -> None:
        self.conn = conn
        self.dry_run = dry_run
        self._on_progress = progress or (lambda phase, done, total: None)
        self._pending_progress: tuple[str, int, int] | None = None
        self._pending_commit: list[Callable[[], None]] = []
        # Called after every commit (an operation that may have to start again
        # notes there what it has for good).
        self.after_commit: Callable[[], None] | None = None

    def one(self, sql: str, params: Any = ()) -> Any:
        for row in self.conn.execute(sql, params):
            return row[0]
        return None

    # -- progress and what is done ---------------------------------------------------

    def progress(self, phase: str, done: int, total: int) -> None:
        """Tell the caller, but only while no transaction is open; inside one
        the latest report waits for the commit."""
        if self.conn.in_transaction:
            self._pending_progress = (phase, done, total)
            return
        self._pending_progress = None
        self._on_progress(phase, done, total)

    def on_commit(self, work: Callable[[], None]) -> None:
        """Run ``work`` (counting what a step wrote) once that step is committed;
        never, if it is rolled back. At once outside a transaction. Inside a
        session a step may be committed only when the session ends: read what
        ``work`` counts after it."""
        if self.conn.in_transaction:
            self._pending_commit.append(work)
        else:
            work()

    def _settled(self) -> None:
        """After a step: if it left no transaction open, what it wrote is committed."""
        if self.conn.in_transaction:
            return
        pending, self._pending_commit = self._pending_commit, []
        for work in pending:
            work()
        if self.after_commit is not None:
            self.after_commit()
        if self._pending_progress is not None:
            self.progress(*self._pending_progress)

    # -- transactions --------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One chunk of writes: a short transaction, or a step of the session's long one."""
        if self.dry_run:
            yield
            return
        try:
            with transactions.write_transaction(self.conn):
                yield
        except BaseException:
            if not self.conn.in_transaction:
                self._pending_commit.clear()  # rolled back: none of it happened
            raise
        self._settled()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Let the transactions inside share long ones while nobody else has the file open.

        :raises OpenedMeanwhile: another process opened the file while a
            statement ran; the long transaction was rolled back (what was
            committed before stays, and is consistent).
        """
        if self.dry_run:
            yield
            return
        try:
            with transactions.long_transactions(self.conn):
                yield
        except BaseException:
            self._pending_commit.clear()
            raise
        self._settled()

    def redo(self, work: Callable[[], T], doing: str) -> T:
        """``work()`` inside a session; started again, politely, if the session gave way.

        ``work`` must start from the file as it is: everything committed
        before is consistent, and what was rolled back is simply not there.

        :raises DagsyncError: another process kept interrupting (``doing`` says what).
        """
        for attempt in range(1, ATTEMPTS + 1):
            try:
                with self.session():
                    return work()
            except OpenedMeanwhile:
                if attempt == ATTEMPTS:
                    raise DagsyncError(
                        f"another process kept opening {self.conn.filename} while {doing}; "
                        "everything written so far is consistent - run the command again"
                    ) from None
        raise AssertionError("unreachable")

    # -- chunks ----------------------------------------------------------------------

    def pacer(self, writes: bool) -> Pacer:
        """A new loop's pacer: each loop learns its own pace from a small start
        (rows of one table cost very differently from another's, reads from writes)."""
        return Pacer(MAX_WRITE_CHUNK if writes else MAX_READ_CHUNK, FIRST_CHUNK, TARGET_SECONDS)

    def timed(self, pacer: Pacer, seconds: float, writes: bool) -> None:
        """Size the next chunk from this one's time. Writes may be longer while
        nobody else has had the file open (nobody can be waiting for them)."""
        if writes:
            alone = not others.may_be_waiting(self.conn.filename)
            pacer.target = ALONE_TARGET_SECONDS if alone else TARGET_SECONDS
            pacer.largest = ALONE_MAX_WRITE_CHUNK if alone else MAX_WRITE_CHUNK
        pacer.timed(seconds)

    def sizes(self, writes: bool = True) -> Iterator[int]:
        """Sizes for steps that are not ranges of a table (pages to free, say):
        the caller stops when done; each step's time sizes the next."""
        pacer = self.pacer(writes)
        while True:
            started = time.perf_counter()
            yield pacer.size
            self.timed(pacer, time.perf_counter() - started, writes)

    def ranges(
        self,
        table: str,
        column: str = "rowid",
        *,
        where: str = "1",
        rowid_bound: int | None = None,
        phase: str | None = None,
        writes: bool = False,
    ) -> Iterator[tuple[int, int]]:
        """Consecutive inclusive ``column`` ranges over the rows of ``table``
        (``schema."name"``) matching ``where``, each holding about as many rows as
        the pace allows.

        The caller runs its statements (or a transaction) on one range per
        step; each step's time sizes the next, so none holds a lock on the
        file for long however big the table. ``rowid_bound`` reads only rows
        up to that rowid (a live source's snapshot), whatever ``column`` is;
        the caller's statements need not repeat it for ``rowid`` or an
        integer ``id``. With ``phase``, progress is reported after each range.
        ``writes``: the steps write (smaller, or longer while alone).
        """
        pacer = self.pacer(writes)
        # Integer keys are dense in practice: a range of the pacer's size
        # needs no scan to find its end (gaps only make it lighter), unless a
        # filter, or a bound on another column, thins it out.
        dense = where == "1" and (rowid_bound is None or column in ("rowid", "id"))
        if rowid_bound is not None:
            where = f"{where} AND rowid <= {int(rowid_bound)}"
        low = self.one(f"SELECT min({column}) FROM {table} WHERE {where}")
        arithmetic = dense and isinstance(low, int)
        positional = isinstance(low, int)  # progress by position: counting rows reads them all
        if phase and low is not None:
            first, top = low, self.one(f"SELECT max({column}) FROM {table} WHERE {where}")
            total = top - first + 1 if positional else self.one(f"SELECT count(*) FROM {table} WHERE {where}")
        done = 0
        while low is not None:
            if arithmetic:
                # Up to the last row there is now, so that rows added meanwhile
                # after it are found by the next range, not passed over.
                high = min(low + pacer.size - 1, self.one(f"SELECT max({column}) FROM {table} WHERE {where}"))
            else:
                high = self.one(
                    f"SELECT {column} FROM {table} WHERE {column} >= ? AND {where} ORDER BY {column} LIMIT 1 OFFSET ?",
                    (low, pacer.size - 1),
                )
                if high is None:
                    # Asked again, not remembered: rows may have been added since.
                    high = self.one(f"SELECT max({column}) FROM {table} WHERE {where}")
            started = time.perf_counter()
            yield low, high
            self.timed(pacer, time.perf_counter() - started, writes)
            if phase:
                if positional:
                    done = min(high, top) - first + 1  # top as it was: rows added since are extra
                else:
                    done += self.one(f"SELECT count(*) FROM {table} WHERE {column} BETWEEN ? AND ? AND {where}", (low, high))
                self.progress(phase, done, total)
            low = self.one(f"SELECT min({column}) FROM {table} WHERE {column} > ? AND {where}", (high,))
