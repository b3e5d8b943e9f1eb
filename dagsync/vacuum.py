"""vacuum: give a file's free pages back to the file system, beside a live llm.

``gc``, ``pack`` and ``unpack`` free pages inside the file; ``--vacuum`` then
returns them. A file in incremental auto-vacuum mode is shrunk in steps that
the writer paces like any other write. Any other file needs one full
``VACUUM`` (a rewrite, holding the lock for its whole length), which also
switches it to incremental mode so that every later ``--vacuum`` is short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dagsync.db import Database
from dagsync.transactions import run_without_waiting
from dagsync.writer import Writer

__all__ = ["VacuumReport", "vacuum"]


@dataclass(frozen=True)
class VacuumReport:
    mode: str  # "incremental", "full" (a one-time rewrite that makes later ones incremental), "auto"
    bytes_before: int
    bytes_after: int
    grew: str | None = None  # why the file is larger than before, if it is


def vacuum(db: Database, progress: Callable[[str, int, int], None] | None = None) -> VacuumReport:
    """Return free pages to the file system without holding the write lock for long."""
    writer = Writer(db.conn, progress)
    path = Path(db.path)
    before = path.stat().st_size
    mode = writer.one("PRAGMA auto_vacuum")
    if mode == 1:  # FULL: SQLite already gave the pages back at each commit.
        return VacuumReport("auto", before, path.stat().st_size)
    if mode == 0:
        db.conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        writer.progress("vacuum (full, once)", 0, 1)
        run_without_waiting(db.conn, "VACUUM")
        after = path.stat().st_size
        grew = None
        if after > before:
            grew = (
                f"the file grew by {after - before:,} bytes: the one full VACUUM switched it to incremental "
                "auto-vacuum, which keeps a map of its pages, so that every later --vacuum is short"
            )
        return VacuumReport("full", before, after, grew)
    writer.redo(lambda: _free_pages(writer), "vacuuming it")
    return VacuumReport("incremental", before, path.stat().st_size)


def _free_pages(writer: Writer) -> None:
    total = free = writer.one("PRAGMA freelist_count")
    for pages in writer.sizes():
        if not free:
            return
        with writer.transaction():
            # The pragma frees pages as its statement is stepped: run it to the end.
            writer.conn.execute(f"PRAGMA incremental_vacuum({int(pages)})").fetchall()
        free = writer.one("PRAGMA freelist_count")
        writer.progress("vacuum", total - free, total)
