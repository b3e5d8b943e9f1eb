"""sync: after it, both files hold the union of their histories, row for row."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dagsync import encoding
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
    labels: tuple[str | None, str | None] = (None, None),
    full: bool = False,
) -> SyncReport:
    """Merge ``b`` into ``a``, then ``a`` into ``b``, then settle; nothing is
    written to either unless both are proven (see below).

    The second merge reads ``a`` after the first has finished, so ``b``
    receives everything both held. A conversation that diverged keeps each
    file's own head and gains a fork row for the other's; the fork rows the
    second merge adds to ``b`` go back to ``a`` in a third, small merge, after
    which merging either way writes nothing.

    Before any of that, ``a`` into ``b`` is planned as a dry run: the first
    merge proves ``b``'s rows before it writes them into ``a``, and this
    proves ``a``'s, so a damaged or conflicting file is refused with both
    files as they were.

    ``labels`` name each file's own branches in fork names (merge's
    ``label``); ``None`` is the file's ``source_label``. Each file is read
    from the other's marks of it, unless ``full`` (merge's).

    A dry run plans the first two merges on the files as they are: the
    second shows what ``a`` holds that ``b`` lacks, without the fork rows the
    first would have added to ``a``, and there is no third.
    """
    label_a, label_b = labels
    into_a_labels = {"label": label_b, "target_label": label_a, "full": full}
    into_b_labels = {"label": label_a, "target_label": label_b, "full": full}
    if not dry_run:
        # Both files are targets, and each is the other's source: A's rows are
        # proven (and any conflict found) by planning B's merge first, so a
        # damaged A is refused before B's rows are written into it.
        merge(b, [a], dry_run=True, progress=progress, **into_b_labels)
    into_a = merge(a, [b], dry_run=dry_run, progress=progress, **into_a_labels)
    try:
        into_b = merge(b, [a], dry_run=dry_run, progress=progress, **into_b_labels)
        settle = None
        # A dry run writes nothing to A, so a third leg would only repeat the first.
        if not dry_run and any(t.forked or t.moved for s in into_b.sources for t in s.tables):
            settle = merge(a, [b], dry_run=dry_run, progress=progress, **into_a_labels)
    except encoding.NotText as exc:
        # Text no key covers is copied as it is, so the first merge may have
        # carried it into A: say so, rather than that nothing was written.
        if dry_run:
            raise
        raise encoding.found_in(
            exc.path, exc.found, f"{a} was merged from {b} before it was found, and {b} was not written"
        ) from None
    return SyncReport(into_a, into_b, settle)
