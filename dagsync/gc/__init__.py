"""gc: delete what no root reaches and keep everything else, beside a live llm.

**Roots** are the columns that point into the message DAG from outside it,
read from the format's foreign keys (``Format.roots``): conversation heads
and call heads in the dag format, thread tips and turn parent/tip hashes in
the llm format; and the dag format's sentinel ``'root'``.

**Kept**: every message a root reaches through parent links; every
unreachable message still inside the grace period, with everything it
reaches. The grace clock is the message's own time (``Format.message_time``:
the dag format's ``created_at``, either spelling; a time SQLite cannot read
counts as new) or, where messages carry no time (llm), the moment gc first
found the message unreachable, recorded in ``_dagsync_gc_seen``.
A grace period of zero keeps nothing unreachable, not even on the first run.

**Deleted**: the other messages, together with the rows collected with them
(``Collect.WITH_OWNER``: their parts and the parts' link rows); then shared
rows (``Collect.UNREFERENCED``: fragments, attachments, tools, tool
instances) that nothing references any more: at once when this run deleted
the rows that referenced them, else once they have been seen unreferenced
for the grace period. Everything else is never touched.

Safe beside a writer, in four steps:

1. **Mark** reads the file in short statements (none holds a lock for long)
   into temp tables: the DAG's skeleton by rowid, the roots, who references
   each shared row. It proposes candidates, leaves first. It is only a
   proposal: the file may change while it reads.
2. **Sweep** deletes candidates a chunk at a time, each chunk in one short
   exclusive transaction that first checks the file as it is now: a
   candidate is kept, with its ancestors, when a root points at it, when it
   has a child that is not a candidate of this or an earlier chunk, or when
   its own time is inside the grace period. So a message goes only together
   with everything below it: no commit point leaves a dangling parent, and
   nothing a root reaches is deleted, whatever was written since the mark.
3. **Shared rows** go in short transactions that first check again that no
   row references them.
4. **Record** first-seen times for what waits out its grace period; forget
   rows that are reachable or referenced again.

A ``kill -9`` at any point leaves a consistent file (every transaction is
whole); the next gc starts again from the file and finishes the job. Shared
rows whose last references an interrupted run deleted are marked as past
their grace period before the sweep, so the next run deletes them too.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from dagsync import bookkeeping, faults
from dagsync.db import Database, open_target
from dagsync.errors import DagsyncError, UnsupportedDatabase
from dagsync.gc import mark as marking
from dagsync.gc import sweep as sweeping
from dagsync.gc.report import GcReport, GcTable
from dagsync.gc.run import GcRun
from dagsync.vacuum import VacuumReport
from dagsync.vacuum import vacuum as vacuum_file
from dagsync.writer import Progress, Writer

__all__ = ["DEFAULT_GRACE", "GcReport", "GcTable", "VacuumReport", "gc", "parse_grace"]

DEFAULT_GRACE = "14d"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_grace(text: str) -> float:
    """Seconds in a grace period written like ``0s``, ``30m``, ``12h``, ``14d``, ``2w`` or ``1d12h``.

    :raises DagsyncError: anything else.
    """
    spec = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw])", spec)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhdw])", "", spec).strip():
        raise DagsyncError(
            f"invalid grace period {text!r}: give a number and a unit (s, m, h, d or w), "
            "e.g. 0s, 12h, 14d or 2w"
        )
    return float(sum(float(n) * _UNITS[unit] for n, unit in parts))


@faults.named("path")
def gc(
    path: str | os.PathLike[str],
    *,
    grace: float | str = DEFAULT_GRACE,
    dry_run: bool = False,
    vacuum: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Delete from ``path`` what no root reaches, older than ``grace``; return what was (or would be) deleted.

    ``grace`` is seconds or a string for ``parse_grace``; ``now`` (unix time)
    is for tests. With ``dry_run`` nothing is written and the report says
    what a real run would delete. ``vacuum`` then returns the freed space to
    the file system (incrementally when the file allows it).

    :raises NotADatabase, UnsupportedDatabase: a file dagsync cannot read.
    :raises DagsyncError: an invalid grace period.
    """
    started = time.perf_counter()
    grace_seconds = parse_grace(grace) if isinstance(grace, str) else float(grace)
    if grace_seconds < 0:
        raise DagsyncError(f"invalid grace period {grace!r}: it cannot be negative")
    db = open_target(path, check=True)
    try:
        _check_migrations(db)
        writer = Writer(db.conn, progress, dry_run=dry_run)
        deleted: dict[str, list[int]] = {}  # what is committed, whatever attempt committed it
        clock = time.time() if now is None else now

        def collect() -> _Gc:
            run = _Gc(db, grace_seconds, clock, dry_run, progress, writer=writer, deleted=deleted)
            # An attempt that gave way dropped its temp tables inside the
            # transaction that was then rolled back: they are back.
            run.drop_temp()
            try:
                run.mark()
                run.sweep()
                run.sweep_shared()
                run.record()
            finally:
                run.drop_temp()
            return run

        # Marked again from the file if a long transaction had to give way.
        run = writer.redo(collect, "collecting garbage in it")
        tables = run.tables()  # once the session is over, everything it counts is committed
        vacuumed = vacuum_file(db, progress) if vacuum and not dry_run else None
        return GcReport(
            path=str(path),
            format=db.format.name,
            dry_run=dry_run,
            grace_seconds=grace_seconds,
            roots=run.root_count,
            reachable=run.reachable,
            unreachable=run.unreachable,
            kept_by_grace=run.kept_by_grace,
            kept_as_new=run.kept_as_new,
            merge_in_progress=run.merge_in_progress,
            tables=tables,
            deleted=sum(t.deleted for t in tables),
            deleted_bytes=sum(t.bytes for t in tables),
            file_bytes=Path(path).stat().st_size,
            vacuum=vacuumed,
            seconds=round(time.perf_counter() - started, 3),
        )
    finally:
        db.close()


def _check_migrations(db: Database) -> None:
    """Refuse a file a newer llm has migrated: its new tables may point at rows gc would delete.

    :raises UnsupportedDatabase: a migration the format does not know.
    """
    fmt = db.format
    if not fmt.migration_gate or not bookkeeping.has(db.conn, "_llm_migrations"):
        return
    number = (lambda name: name.split("_", 1)[0]) if fmt.migration_gate == "number" else (lambda name: name)
    known = {number(name) for name in fmt.migrations}
    unknown = sorted(name for (name,) in db.conn.execute("SELECT name FROM _llm_migrations") if number(name) not in known)
    if unknown:
        raise UnsupportedDatabase(
            f"{db.path} was written by a newer llm than this dagsync knows (migration(s) {', '.join(unknown)}); "
            "gc cannot tell what its new tables point at, so it deletes nothing: update dagsync"
        )


class _Gc(GcRun):
    """A run, phase by phase: ``mark.py`` proposes, ``sweep.py`` deletes and records."""

    def mark(self) -> None:
        marking.mark(self)

    def sweep(self) -> None:
        sweeping.sweep(self)

    def sweep_shared(self) -> None:
        sweeping.sweep_shared(self)

    def record(self) -> None:
        sweeping.record(self)
