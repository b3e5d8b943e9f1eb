"""sync: after it, both files hold the union of their histories."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dagsync.merge import MergeReport, Progress, merge

__all__ = ["SyncReport", "sync"]


@dataclass(frozen=True)
class SyncReport:
    into_a: MergeReport
    into_b: MergeReport


def sync(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> SyncReport:
    """Merge ``b`` into ``a``, then ``a`` into ``b``.

    The second merge reads ``a`` after the first has finished, so ``b``
    receives everything both held. A diverged conversation keeps each file's
    own head and gains a fork for the other's.
    """
    into_a = merge(a, [b], dry_run=dry_run, progress=progress)
    into_b = merge(b, [a], dry_run=dry_run, progress=progress)
    return SyncReport(into_a, into_b)
