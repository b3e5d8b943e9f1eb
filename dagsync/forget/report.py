"""What forget reports."""

from __future__ import annotations

from dataclasses import dataclass

from dagsync.gc.report import GcTable

__all__ = ["Conversation", "ForgetReport", "RestoreReport"]


@dataclass(frozen=True)
class Conversation:
    id: str
    name: str | None
    latest: str | None  # its latest activity, UTC (None: nothing in it is dated)


@dataclass(frozen=True)
class ForgetReport:
    path: str
    format: str
    dry_run: bool
    selector: dict[str, object]  # the selectors as given
    conversations: tuple[Conversation, ...]  # what was (or would be) forgotten
    tables: tuple[GcTable, ...]  # rows and bytes deleted, per table
    messages: int  # messages deleted: those only the forgotten conversations reached
    shared_messages: int  # messages they reached that stay: another thread, call or message uses them
    deleted: int  # rows, every table
    deleted_bytes: int
    tombstones: int  # conversations the file keeps forgotten (live tombstones), after
    merge_in_progress: bool  # a merge into the file was under way: what it may need was left for later
    pending: int  # rows unlinked but not yet collected (left by a merge in progress)
    file_bytes: int
    seconds: float

    def table(self, name: str) -> GcTable:
        return next((t for t in self.tables if t.table == name), GcTable(name))


@dataclass(frozen=True)
class RestoreReport:
    path: str
    dry_run: bool
    restored: tuple[str, ...]  # conversation ids no longer kept forgotten
    tombstones: int  # conversations still kept forgotten
