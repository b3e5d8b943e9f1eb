"""sync: after it, both files hold the union of their histories, row for row."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dagsync.merge import MergeReport, Progress, merge

__all__ = ["SyncReport", "sync"]


@dataclass(frozen=True)
class SyncReport:
    into_a: MergeReport
    into_b: MergeReport
    # B into A once more, when merging into B added fork rows A lacks.
    settle: MergeReport | None = None


def sync(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> SyncReport:
    """Merge ``b`` into ``a``, then ``a`` into ``b``, then settle.

    The second merge reads ``a`` after the first has finished, so ``b``
    receives everything both held. A conversation that diverged keeps each
    file's own head and gains a fork row for the other's; the fork rows the
    second merge adds to ``b`` go back to ``a`` in a third, small merge, after
    which merging either way writes nothing.
    """
    into_a = merge(a, [b], dry_run=dry_run, progress=progress)
    into_b = merge(b, [a], dry_run=dry_run, progress=progress)
    settle = None
    if any(t.forked for s in into_b.sources for t in s.tables):
        settle = merge(a, [b], dry_run=dry_run, progress=progress)
    return SyncReport(into_a, into_b, settle)
