"""What gc reports: per table, and for the whole run."""

from __future__ import annotations

from dataclasses import dataclass

from dagsync.vacuum import VacuumReport

__all__ = ["GcReport", "GcTable"]


@dataclass(frozen=True)
class GcTable:
    table: str
    deleted: int = 0
    bytes: int = 0  # the deleted rows' column values, in bytes
    waiting: int = 0  # unreachable or unreferenced, kept until the grace period has passed


@dataclass(frozen=True)
class GcReport:
    path: str
    format: str
    dry_run: bool
    grace_seconds: float
    roots: int  # distinct messages roots point at
    reachable: int  # messages reached from a root
    unreachable: int  # messages no root reaches
    kept_by_grace: int  # unreachable messages kept: inside the grace period, or reached by one that is
    kept_as_new: int  # candidates the sweep found reachable again (written meanwhile)
    merge_in_progress: bool  # a merge into the file was under way: messages were left for the next run
    tables: tuple[GcTable, ...]
    deleted: int  # rows, every table
    deleted_bytes: int
    file_bytes: int
    vacuum: VacuumReport | None
    seconds: float

    def table(self, name: str) -> GcTable:
        return next((t for t in self.tables if t.table == name), GcTable(name))
