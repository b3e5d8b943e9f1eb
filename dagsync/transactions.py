"""transactions: how dagsync takes, holds and lets go of a target's write lock beside a live llm.

llm writes with a 5 s busy timeout and no retry, in a *deferred* transaction
(``BEGIN``, some reads, then the first write upgrades its lock). In
rollback-journal mode SQLite refuses that upgrade at once, busy timeout or
not, when another connection holds the write lock (waiting could deadlock).
So every write transaction dagsync takes:

* takes the lock EXCLUSIVE, so while it writes llm cannot even begin reading
  and its busy timeout makes it wait instead of failing;
* never waits for the lock while holding part of it (``run_without_waiting``),
  and takes it PENDING first, never holding RESERVED while another process
  reads (``locks.pending_first``);
* pauses after its commit while someone may be waiting for the lock;
* and, while no other process has the file open, may be a step of one long
  transaction instead (``long_transactions``), given up the moment another
  process opens the file.

How long each transaction runs is the ``writer.Writer``'s to decide; who
else has the file open is ``others``'. docs/merge.md ("Crash safety and a
live writer") tells the whole story.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import apsw

from dagsync import locks, others

__all__ = [
    "Gate", "OpenedMeanwhile", "gated", "long_transactions", "patient", "run_without_waiting", "write_transaction",
]  # fmt: skip

log = logging.getLogger("dagsync")

# How long one statement waits for a lock before SQLite gives up, and how long
# a write transaction keeps retrying after that. The first is short so that we
# never queue ahead of llm for long; the second is our patience.
BUSY_TIMEOUT_MS = 2000
WRITE_RETRY_SECONDS = 120.0
# Inside ``long_transactions``, while nobody else has the file open, commit
# this often. Whoever the open alarm cannot hear (a process of another user,
# or of another PID namespace, that had the file open before) waits for at
# most this plus one step plus the commit: well inside llm's 5 s.
LONG_COMMIT_SECONDS = 2.0
# A wait for another program's lock longer than this is said (on a terminal,
# through the ``dagsync`` logger), naming the file.
NOTICE_SECONDS = 1.0


def waiting(path: str) -> None:
    """Say, once per wait, that another program's lock on ``path`` is being waited for."""
    log.warning("waiting for another program to finish writing %s ...", path)


def patient(conn: apsw.Connection, timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    """Wait up to ``timeout_ms`` for another program's lock, as a busy timeout
    does, and say so (``waiting``) once a wait passes NOTICE_SECONDS."""
    timeout, path = timeout_ms / 1000, conn.filename
    state = {"start": 0.0, "said": False}

    def handler(count: int) -> bool:
        now = time.monotonic()
        if count == 0:
            state["start"], state["said"] = now, False
        waited = now - state["start"]
        if waited >= timeout:
            return False
        if waited >= NOTICE_SECONDS and not state["said"]:
            state["said"] = True
            waiting(path)
        time.sleep(min(0.001 * 2**min(count, 7), 0.1, timeout - waited))
        return True

    conn.set_busy_handler(handler)


@contextlib.contextmanager
def write_transaction(conn: apsw.Connection) -> Iterator[None]:
    """An exclusive write transaction that a running llm waits for rather than fails on.

    Joins an enclosing transaction if one is open; rolls back on any exception.

    * The lock is taken EXCLUSIVE: while we write, llm cannot even start
      reading, and its busy timeout makes it wait instead of failing.
    * It is never waited for while held in part: it is tried with no busy
      timeout, PENDING first, and if a reader is active we let go and try
      again later, so a reader half-way to writing finishes first
      (``run_without_waiting``).
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
    gate = _GATES.get(id(conn))
    if gate is not None:
        gate.wait()  # a short transaction commits at its end: nothing may be written before
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
                long.await_gate()
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
        """Somebody is waiting: commit now, and be polite from here on. If the
        connection's gate is still shut, what this transaction wrote may not be
        committed yet: it is rolled back instead, for the caller to redo."""
        gate = _GATES.get(id(self.conn))
        if self.conn.in_transaction and gate is not None and not gate.ready():
            raise OpenedMeanwhile(f"another process opened {self.conn.filename} before its writes could be committed")
        _LONG.pop(id(self.conn), None)
        if self.conn.in_transaction:
            _retry_busy(self.conn, "COMMIT")

    def step_done(self) -> None:
        """At a step's end, a point at which the file is consistent."""
        if self.heard():
            self.let_in()
        elif time.monotonic() - self.began >= LONG_COMMIT_SECONDS:
            gate = _GATES.get(id(self.conn))
            if gate is None or gate.ready():
                _retry_busy(self.conn, "COMMIT")  # the next step begins the next one
            # else: the gate is shut - go on in this transaction, commit later

    def await_gate(self) -> None:
        """Before the last commit: wait for the gate; give way (roll back, for
        the caller to redo) if somebody opens the file meanwhile."""
        gate = _GATES.get(id(self.conn))
        while gate is not None and not gate.ready(timeout=0.05):
            if self.heard():
                raise OpenedMeanwhile(f"another process opened {self.conn.filename} before its writes could be committed")


# The connections inside ``long_transactions`` now, by id().
_LONG: dict[int, _LongTransaction] = {}


class Gate(Protocol):
    """Something every write to a connection must wait for before it is committed
    (merge's message proofs): ``ready`` (optionally waiting up to ``timeout``
    seconds) and ``wait`` say whether it is open, and raise its failure."""

    def ready(self, timeout: float = 0.0) -> bool: ...

    def wait(self) -> None: ...


# Each connection's gate, by id(), while one is set (``gated``).
_GATES: dict[int, Gate] = {}


@contextlib.contextmanager
def gated(conn: apsw.Connection, gate: Gate | None) -> Iterator[None]:
    """Nothing written to ``conn`` inside this block is committed before ``gate`` opens.

    A short transaction waits for it before it begins (so no lock is held
    while waiting). A long one goes on writing meanwhile and holds back its
    commits; if another process opens the file before the gate opens, the
    long transaction is rolled back (``OpenedMeanwhile``) rather than
    committed, and the caller redoes it politely. If the gate fails, the
    failure is raised where it was waited for, and the transaction rolls back.
    """
    if gate is None:
        yield
        return
    _GATES[id(conn)] = gate
    try:
        yield
    finally:
        _GATES.pop(id(conn), None)


def _begin_exclusive(conn: apsw.Connection) -> None:
    """Take the write lock without ever waiting for it inside SQLite (see above)."""
    run_without_waiting(conn, "BEGIN EXCLUSIVE")


def run_without_waiting(conn: apsw.Connection, sql: str) -> None:
    """Run a statement that takes the write lock (``BEGIN EXCLUSIVE``, ``VACUUM``)
    with no busy timeout inside SQLite, retrying on our side (see ``write_transaction``).

    A plain try takes RESERVED and PENDING for a moment before it finds a
    reader and lets go, and an llm reader that tries to start writing in
    that moment is refused at once ("database is locked"), busy timeout or
    not. So the lock is taken PENDING first, never through RESERVED while a
    reader is there (``locks.pending_first``), and the statement then finds
    it held.
    """
    conn.set_busy_timeout(0)
    try:
        _retry_busy(conn, sql, first_delay=0.005, guard=lambda: locks.pending_first(conn))
    finally:
        patient(conn)


def _retry_busy(
    conn: apsw.Connection,
    sql: str,
    first_delay: float = 0.01,
    guard: Callable[[], contextlib.AbstractContextManager[bool]] = lambda: contextlib.nullcontext(True),
) -> None:
    """Run ``sql`` until the database is not busy, backing off, for WRITE_RETRY_SECONDS.

    ``sql`` is run inside ``guard()``, and only when it says so (always at the deadline).
    """
    started = time.monotonic()
    deadline = started + WRITE_RETRY_SECONDS
    delay, said = first_delay, False
    while True:
        if not said and time.monotonic() - started >= NOTICE_SECONDS:
            said = True
            waiting(conn.filename)
        try:
            with guard() as clear:
                if clear or time.monotonic() > deadline:
                    conn.execute(sql)
                    return
        except apsw.BusyError:
            if time.monotonic() > deadline:
                raise
        # Jitter so two waiting writers do not retry in lockstep.
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 0.2)
