"""writer: the one owner of how a target is written, beside a live llm.

Every operation that writes a target - merge, gc, pack, unpack,
canonicalise, vacuum - says *what* to write, a chunk at a time, and hands
the chunks to a ``Writer``, which decides *how*:

* how big a chunk is: each statement and each write transaction aims at a
  length of time (``TARGET_SECONDS``), learnt as the loop goes (``Pacer``);
* whether a chunk is a short transaction of its own or a step of one long
  transaction (``long_transactions``, while no other process has the file
  open), and when that one commits;
* how the write lock is taken and waited for, and when to pause after a
  commit so that a waiting llm gets in (``write_transaction``);
* when a progress report may be passed on (never inside a transaction: a
  callback that blocks, a terminal paused with Ctrl-S, must not hold the lock);
* what counts as done: ``on_commit`` work runs once the rows it counts are
  committed, and is forgotten when they are rolled back.

Why it is so careful: llm writes with a 5 s busy timeout and no retry, in a
*deferred* transaction (``BEGIN``, reads, then the first write upgrades its
lock). In rollback-journal mode SQLite refuses that upgrade at once, busy
timeout or not, when another connection holds the write lock. So a writer
beside llm must never make it wait long, and must never hold part of the
lock while it waits itself. docs/merge.md ("Crash safety and a live
writer") says it at length; ``others`` tells who else has the file open.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import apsw

from dagsync import others
from dagsync.errors import DagsyncError

__all__ = [
    "OpenedMeanwhile",
    "Pacer",
    "Writer",
    "long_transactions",
    "run_without_waiting",
    "write_transaction",
]

T = TypeVar("T")
Progress = Callable[[str, int, int], None]

# How long one statement waits for a lock before SQLite gives up, and how long
# a write transaction keeps retrying after that. The first is short so that we
# never queue ahead of llm for long; the second is our patience.
BUSY_TIMEOUT_MS = 2000
WRITE_RETRY_SECONDS = 120.0

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
# Inside ``long_transactions``, while nobody else has the file open, commit
# this often. Whoever the open alarm cannot hear (a process of another user,
# or of another PID namespace, that had the file open before) waits for at
# most this plus one step plus the commit: well inside llm's 5 s.
LONG_COMMIT_SECONDS = 2.0
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
        never, if it is rolled back. At once outside a transaction."""
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
            with write_transaction(self.conn):
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
            with long_transactions(self.conn):
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
                high = low + pacer.size - 1
                if rowid_bound is not None:
                    high = min(high, int(rowid_bound))
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


# -- the transactions themselves ---------------------------------------------------------


@contextlib.contextmanager
def write_transaction(conn: apsw.Connection) -> Iterator[None]:
    """An exclusive write transaction that a running llm waits for rather than fails on.

    Joins an enclosing transaction if one is open; rolls back on any exception.

    * The lock is taken EXCLUSIVE: while we write, llm cannot even start
      reading, and its busy timeout makes it wait instead of failing.
    * It is never waited for while held in part: it is tried with no busy
      timeout, and if a reader is active we let go and try again later, so
      a reader half-way to writing finishes first (``run_without_waiting``).
    * After each commit we pause for a quarter of the transaction's length
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
