"""What a merge reports: per table, per source, and for the whole run."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Counts", "ForkReport", "MergeReport", "SourceReport", "TableReport"]


@dataclass(frozen=True)
class TableReport:
    table: str
    added: int = 0  # rows copied into the target
    mapped: int = 0  # rows found in the target under another key
    existing: int = 0  # rows the target already had
    updated: int = 0  # pointers fast-forwarded
    forked: int = 0  # fork rows added for pointers that diverged
    moved: int = 0  # calls (turns) moved onto the row of their branch (merge.branches)


@dataclass(frozen=True)
class ForkReport:
    """A fork row a merge added for a pointer that diverged."""

    table: str  # conversations (dag) or threads (llm)
    original: str  # the row whose pointer diverged
    fork: str  # the new row's key
    name: str | None
    head: str  # where the fork points: the branch's tip
    side: str  # whose branch the fork holds: "source" or "target"


@dataclass(frozen=True)
class SourceReport:
    source: str
    format: str
    tables: tuple[TableReport, ...]
    forks: tuple[ForkReport, ...] = ()
    label: str = ""  # how fork names call this source
    # Read from its marks (merge.marks): only what lay beyond them, and the
    # pointer rows that moved; else in full, ``full_because`` says why.
    incremental: bool = False
    full_because: str | None = None
    # Rows of conversations the target keeps forgotten (its tombstones and the
    # source's: dagsync/forget) that the merge kept out of it.
    forgotten: int = 0

    def table(self, name: str) -> TableReport:
        return next(t for t in self.tables if t.table == name)

    @property
    def written(self) -> int:
        return sum(t.added + t.updated + t.forked + t.moved for t in self.tables)


@dataclass(frozen=True)
class MergeReport:
    target: str
    created: bool
    dry_run: bool
    sources: tuple[SourceReport, ...]
    seconds: float


@dataclass
class Counts:
    """A table's figures as a merge plans and then writes them (a TableReport in the making)."""

    added: int = 0
    mapped: int = 0
    existing: int = 0
    updated: int = 0
    forked: int = 0
    moved: int = 0

    def written_from(self, *attempts: Counts) -> None:
        """Take what was written (added, updated, forked, moved) as the sum of ``attempts``'."""
        for name in ("added", "updated", "forked", "moved"):
            setattr(self, name, sum(getattr(a, name) for a in attempts))
