"""merge: copy every row of every source into a target, losing nothing.

One engine merges every table of a format, driven by the format's table
descriptions (``dagsync/formats``): how a table is keyed decides how its rows
are matched - each key kind is a module of this package - and its foreign
keys decide which columns are rewritten and the order tables go in. For
each source:

1. **Check** the source as untrusted input (its tables now, every page with
   ``quick_check`` in a background thread that the first write waits for:
   ``db.SourceChecks``), then attach it read-only to the target's connection
   (``core.SourceMerge``).
2. **Plan** every table in reference order (reads only; writes nothing but
   temp tables): each key kind maps the source's rows onto the target's and
   counts what is new; the dangling-reference checks refuse a row that would
   point at nothing; conflicts (a key on both sides with different content)
   are collected. Any conflict stops the merge here, before a write.
3. **Apply** in the same order, handing every chunk to the target's
   ``writer.Writer``: tables after the tables they reference and messages
   parents-first, so that every commit point leaves no reference dangling
   and a ``kill -9`` at any moment leaves a consistent file that a re-run
   completes.
4. **Report** what each table gained.

The key kinds: ``messages`` (dag and hash messages), ``owned`` (rows copied
with their message), ``integer`` (surrogate ids, natural keys, ids in JSON),
``keyed`` (text keys and composite link rows), ``pointers`` (heads and tips:
fast-forward, keep or fork), ``derived`` (full-text indexes); ``proofs``
proves what is about to be copied, ``shared`` compares the messages both
files hold. Re-running
recomputes the plan from the files alone: rows already copied are found by
key, so a second merge writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import apsw

from dagsync import blobs, bookkeeping, faults, packed, transactions
from dagsync.db import Database, SourceChecks, open_target, open_unchecked_source
from dagsync.errors import DagsyncError, UnresolvedReference, UnsupportedDatabase
from dagsync.formats import Key, Table
from dagsync.merge import delta, derived, integer, keyed, marks, messages, owned, pointers, proofs, shared
from dagsync.merge.core import MESSAGE_KEYS, SourceMerge
from dagsync.merge.references import check_dangling
from dagsync.merge.report import Counts, MergeReport, SourceReport, TableReport
from dagsync.writer import OpenedMeanwhile, Progress, Writer

__all__ = ["MergeReport", "SourceReport", "TableReport", "merge"]

# A live writer that inserts a colliding row between plan and apply makes an
# insert fail, and another process opening the target mid-statement rolls a
# long transaction back; either way the merge plans again from the files,
# this many times in all.
ATTEMPTS = 3
# Seconds: how long a thread may hold the interpreter while another waits (_short_turns).
SWITCH_INTERVAL = 0.001


@faults.named("target", "sources")
def merge(
    target: str | os.PathLike[str],
    sources: list[str | os.PathLike[str]],
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    label: str | None = None,
    target_label: str | None = None,
    full: bool = False,
) -> MergeReport:
    """Merge each source into ``target``, in order; create ``target`` if it does not exist.

    A source merged before is read from the target's marks (``marks``): only
    what lies beyond them (``delta``), after proving they hold; else, or
    with ``full``, whole. Either way the target ends the same.

    A fork row for a pointer that diverged is named after where its branch
    came from (``origins``): the file that holds it, called ``label`` (a
    source) or ``target_label`` (the target), else its ``core.source_label``.

    A missing target is created (0600) with the first source's format. Sources
    are only read. With ``dry_run`` nothing is written anywhere and the report
    says what a real run would add, map and fork.

    :raises NotADatabase, UnsupportedDatabase: a file dagsync cannot read or trust.
    :raises DamagedSource: a source whose parent links or references are broken.
    :raises MergeConflict: a key with different content on the two sides.
    """
    started = time.perf_counter()
    if not sources:
        raise DagsyncError("no source databases given: merge TARGET SOURCE [SOURCE...]")
    target = Path(target)
    source_paths = [Path(s) for s in sources]
    # Check every source before writing to the target, so a bad one late in
    # the list cannot leave the target half-merged: the tables now, every
    # page (quick_check) in the background while the first source is
    # planned; nothing is written before both are done.
    formats = []
    for path in source_paths:
        if target.exists() and path.exists() and os.path.samefile(target, path):
            raise DagsyncError(f"{path} is the target itself; give another file as the source")
        with open_unchecked_source(path) as src:
            formats.append(src.format)
    # An empty file is a target whose creation was interrupted: create it again.
    created = not target.exists() or target.stat().st_size == 0
    scratch = None
    if created and dry_run:
        # Plan against an empty database of the right format, then throw it away.
        scratch = tempfile.mkdtemp(prefix="dagsync-dry-run-")
        target_db = open_target(Path(scratch) / "target.db", create=formats[0])
    elif created:
        target_db = open_target(target, create=formats[0])
    else:
        target_db = open_target(target)
    checks = None
    reports: list[SourceReport] = []
    try:
        for path, fmt in zip(source_paths, formats, strict=True):
            if fmt is not target_db.format:
                raise UnsupportedDatabase(
                    f"{path} is in the {fmt.name} format but {target} is in the "
                    f"{target_db.format.name} format; dagsync merges files of the same format"
                )
        full_because = "a new target" if created else "--full" if full else None
        decisions = [_decide(target_db, path, full_because) for path in source_paths]
        # Every source read whole is checked before anything is written to the
        # target, so a bad one late in the list cannot leave it half-merged: the
        # tables now, every page (quick_check) in the background while the first
        # source is planned; nothing is written before both are done. A source
        # read from its marks is read only beyond them, every row proven by its key.
        checks = SourceChecks([p for p, d in zip(source_paths, decisions, strict=True) if not d.incremental])
        # (A bundle is checked whole: it is all beyond the marks.)
        writer = Writer(target_db.conn, progress, dry_run=dry_run)
        with _short_turns():
            for path, decision in zip(source_paths, decisions, strict=True):
                # Marked from before the plan (which maps rows onto the target's) to
                # the end of the copy, so a gc beside it waits (bookkeeping.merging).
                with bookkeeping.merging(target_db.path) if not dry_run else contextlib.nullcontext():
                    report = _merge_source(target_db, path, decision, checks, writer, (label, target_label))
                if not dry_run:
                    # Forgotten stays forgotten: the source's tombstones join the
                    # target's, and what they name goes again (dagsync/forget).
                    from dagsync import forget  # which builds on gc, as merge does not

                    report = dataclasses.replace(report, forgotten=forget.reapply(target_db, path, writer))
                reports.append(report)
    except BaseException:
        if checks is not None:
            checks.join()  # no thread goes on reading the sources after merge has failed
        target_db.close()
        if created and not dry_run and not any(r.written for r in reports):
            _remove_database(target)
        raise
    finally:
        if scratch:
            target_db.close()
            shutil.rmtree(scratch, ignore_errors=True)
    target_db.close()
    return MergeReport(str(target), created, dry_run, tuple(reports), round(time.perf_counter() - started, 3))


@contextlib.contextmanager
def _short_turns() -> Iterator[None]:
    """Shorter turns between Python threads while the merge runs. Its helpers
    (message proofs, role conflicts, page checks) run Python while the merge
    thread mostly waits on SQLite, which it leaves and re-enters once per
    statement; with CPython's default 5 ms switch interval it may wait that long
    for the interpreter each time (the plan of a 1% merge took 15-25% longer)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _remove_database(path: Path) -> None:
    """Remove a target this run created and never wrote history to."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _decide(target: Database, source: Path, full_because: str | None) -> marks.Decision:
    """Whether ``source`` is read from the target's marks, or whole and why."""
    conn = target.conn
    uri = "file:" + urllib.parse.quote(str(source.resolve())) + "?mode=ro"
    conn.execute("ATTACH DATABASE ? AS src", (uri,))
    try:
        present = {n for (n,) in conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")}
        from dagsync import bundle  # which builds on this package

        found = bundle.meta(conn)
        if found is not None:
            taken = bundle.received(conn, target.format, source, found)
            held = None
            if taken.entry is not None:
                held = marks.Marks(taken.entry, taken.source, dict(
                    (t, (m, k)) for t, m, k in conn.execute(
                        "SELECT tbl, mark, mark_key FROM main._dagsync_marks WHERE source = ?", (taken.entry,)
                    )
                ))  # fmt: skip
            entry = taken.entry if taken.entry is not None else taken.replaces
            return marks.Decision(taken.identity, held, entry=entry, bundle=taken)
        ident = marks.identity(conn, target.format)
        if full_because:
            return marks.Decision(ident, why_full=full_because)
        if packed.is_packed(conn, "src"):
            return marks.Decision(ident, why_full="a packed source is read whole")
        conn.execute("BEGIN")
        try:
            return marks.decide(conn, target.format, source, present)
        finally:
            conn.execute("COMMIT")
    finally:
        conn.execute("DETACH DATABASE src")


def _merge_source(
    target: Database,
    source: Path,
    decision: marks.Decision,
    checks: SourceChecks,
    writer: Writer,
    labels: tuple[str | None, str | None],
) -> SourceReport:
    """One source into the target: plan, check, apply; planned again if the apply was cut short.

    An incremental merge falls back to a full one when a row beyond the marks
    refers to rows a forget removed from the target (``marks.forgotten_below``).
    """
    scratch = tempfile.mkdtemp(prefix="dagsync-delta-") if decision.incremental else None
    # What attempts cut short had committed, which the next one finds already there.
    carried: dict[str, Counts] = {}
    try:
        for attempt in range(1, ATTEMPTS + 1):
            report = _try_source(target, source, decision, checks, writer, labels, attempt, scratch, carried)
            if report is not None:
                return report
    except UnresolvedReference as exc:
        why = marks.forgotten_below(target.conn, decision, exc)
        if why is None:
            raise
        if decision.bundle is not None:
            from dagsync.bundle import WHOLE_AGAIN  # which builds on merge

            raise DagsyncError(
                f"{source}: {exc.detail}, which {target.path} no longer has: a forget there removed it, and a "
                f"bundle made against the marks leaves it out; nothing was merged - {WHOLE_AGAIN}"
            ) from None
        assert decision.marks is not None
        whole = marks.Decision(decision.identity, why_full=why, entry=decision.marks.entry)
        checked = SourceChecks([source])  # read whole now: every page checked, as for any full merge
        try:
            return _merge_source(target, source, whole, checked, writer, labels)
        finally:
            checked.join()
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    raise AssertionError("unreachable")


def _try_source(
    target: Database,
    source: Path,
    decision: marks.Decision,
    checks: SourceChecks,
    writer: Writer,
    labels: tuple[str | None, str | None],
    attempt: int,
    scratch: str | None,
    carried: dict[str, Counts],
) -> SourceReport | None:
    """One attempt at one source; None when it must be planned again."""
    after = None
    if decision.bundle is not None:
        # Thin: what it refers to may be in the target alone.
        after = decision.bundle.now
        run = SourceMerge(target, source, writer, labels[0] or decision.bundle.label, labels[1], thin=True)
    elif decision.unchanged is not None:
        # Nothing was written to the source since its marks were taken
        # (marks.decide): nothing to read, and the marks stand as they are.
        run = SourceMerge(target, source, writer, *labels, thin=True)
        run.source_tables = set(decision.unchanged)
        return run.report()
    elif scratch is not None:
        # What lies beyond the marks, read afresh on every attempt.
        file = Path(scratch) / f"delta-{attempt}.db"
        extracted = _extract(target, source, decision, file)
        after = extracted.now
        run = SourceMerge(target, source, writer, *labels, file=file, thin=True)
        run.state = extracted.state
        if not any(extracted.rows.values()) and decision.marks is not None and after == decision.marks.tables:
            # Nothing beyond the marks and no pointer moved: nothing to plan or
            # write, and the marks stand as they are.
            run.source_tables = set(extracted.rows)
            return run.report()
    else:
        run = SourceMerge(target, source, writer, *labels)
        run.full_because = decision.why_full
    try:
        return _attempt(run, checks, decision, after, carried)
    except OpenedMeanwhile:
        # A process opened the target in the middle of a long transaction,
        # which was rolled back for its sake; what was committed before is
        # consistent. Plan again from the files, and write politely from
        # now on (the file stays marked as opened by another: once only).
        if attempt == ATTEMPTS:
            raise DagsyncError(
                f"another process kept opening {target.path} during the merge of {source}; "
                "everything merged so far is consistent - run the merge again"
            ) from None
    except apsw.ConstraintError as exc:
        # Someone wrote a colliding row between plan and apply; every
        # commit so far is consistent, so plan again from the files.
        if attempt == ATTEMPTS:
            raise DagsyncError(
                f"merging {source} into {target.path} kept colliding with rows written "
                f"meanwhile ({exc}); everything merged so far is consistent - run the merge again"
            ) from exc
    finally:
        run.detach()
    for name, done in run.committed.items():
        into = carried.setdefault(name, Counts())
        into.written_from(into, done)
    return None


def _extract(target: Database, source: Path, decision: marks.Decision, file: Path) -> delta.Extract:
    """Write what ``source`` holds beyond its marks to ``file``: its rows per table, and the source's marks now."""
    conn = target.conn
    uri = "file:" + urllib.parse.quote(str(source.resolve())) + "?mode=ro"
    conn.execute("ATTACH DATABASE ? AS src", (uri,))
    try:
        present = {n for (n,) in conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")}
        assert decision.marks is not None
        return delta.extract(conn, target.format, decision.marks.tables, present, file, decision.marks.entry)
    finally:
        conn.execute("DETACH DATABASE src")


def _attempt(
    run: SourceMerge,
    checks: SourceChecks,
    decision: marks.Decision,
    after: dict[str, tuple[int, str | None]] | None,
    carried: dict[str, Counts],
) -> SourceReport:
    """Check, plan every table in reference order, apply in the same order, report."""
    message_proofs = shared_content = None
    run.writer.after_commit = lambda: run.committed.update((n, dataclasses.replace(c)) for n, c in run.written.items())
    try:
        run.attach()
        _check_migrations(run)
        # Messages both files hold, compared in a thread while the plan runs.
        shared_content = shared.SharedContent.start(run)
        order = [*run.order, *derived.tables(run)]
        for step, table in enumerate(order):
            run.progress(f"planning {table.name}", step, len(order))
            kind = _kind(table)
            kind.plan(run, table)
            if kind is messages:
                shared.compare_mapped(run)
                # Re-hashed in a thread while the rest is planned (and copied).
                message_proofs = proofs.MessageProofs.start(run, table.key)
            if kind is not derived:
                check_dangling(run, table)
            if table.pointer:
                pointers.plan(run, table)
        run.progress("planned", len(order), len(order))
        # Every source's pages checked before anything is written, and every
        # row to be copied proven by its key.
        checks.wait()
        if shared_content is not None:
            for conflict in shared_content.wait():
                run.conflict(conflict)
        proofs.prove(run)  # may find conflicts too
        run.raise_conflicts()
        if run.writer.dry_run:
            if message_proofs is not None:
                message_proofs.wait()
            return run.report()
        # While nobody else has the target open, in long transactions; the
        # message proofs gate every commit (transactions.gated): a long
        # transaction copies while they run, a short one waits for them.
        with transactions.gated(run.conn, message_proofs), run.writer.session():
            for step, table in enumerate(order):
                run.progress(f"copying {table.name}", step, len(order))
                _kind(table).apply(run, table)
                if table.pointer:
                    pointers.apply(run, table)
            run.progress("copied", len(order), len(order))
            if run.target_packed:
                # A packed target stays packed: what arrived inline is packed with
                # the target's settings, blobs the source has copied by key.
                blobs.pack_new_rows(run.db, run.writer, source_schema="src" if run.source_packed else None)
            _record_marks(run, decision, after)
        if message_proofs is not None:
            message_proofs.wait()  # had nothing been committed, it would not have been waited for
        message_proofs = None
    except BaseException:
        if message_proofs is not None:
            message_proofs.stop()
        if shared_content is not None:
            shared_content.stop()
        checks.wait()  # a damaged page explains any error better
        raise
    finally:
        run.writer.after_commit = None
    # Report what was done, which is what the plan said unless a live writer got
    # there first, with what earlier attempts committed (found existing by this one).
    for name, done in run.written.items():
        counts, before = run.counts[name], carried.get(name, Counts())
        counts.existing = max(0, counts.existing - before.added)
        counts.written_from(done, before)
    return run.report()


def _record_marks(run: SourceMerge, decision: marks.Decision, after: dict[str, tuple[int, str | None]] | None) -> None:
    """Record how far the target has now merged the source, in the merge's last
    transaction; nothing when an incremental merge found nothing new."""
    now = after if after is not None else run.taken
    assert now is not None
    if decision.marks is not None and now == decision.marks.tables and not any(
        run.one(f'SELECT 1 FROM src."{t.name}" LIMIT 1') for t in run.order if t.pointer
    ):
        return
    source = marks.where(run.source)
    if decision.bundle is not None:
        source = decision.bundle.source
        if decision.marks is not None and any(now.get(t, (0, None))[0] < m for t, (m, _) in decision.marks.tables.items()):
            return  # an older bundle than what the target has merged of its source since
    state = None if decision.bundle is not None else run.state
    with run.writer.transaction():
        marks.save(run.conn, run.fmt, decision, source, run.label, now, "src" if run.thin else "temp", state)


def _kind(table: Table) -> ModuleType:
    """The module that merges ``table``: the kind of its key decides."""
    if table.key in MESSAGE_KEYS:
        return messages
    if table.owner is not None:
        return owned
    if table.key is Key.INTEGER:
        return integer
    if table.key is Key.DERIVED:
        return derived
    return keyed  # text and composite keys; a pointer table's pointer is pointers'


def _check_migrations(run: SourceMerge) -> None:
    """A source migrated further than the target may hold what the target's schema cannot.

    :raises UnsupportedDatabase: naming the migrations the target lacks.
    """
    gate = run.fmt.migration_gate
    if not gate or "_llm_migrations" not in run.source_tables:
        return
    same = "name" if gate == "name" else "substr(name, 1, instr(name || '_', '_'))"
    ahead = [
        name for (name,) in run.conn.execute(
            f"SELECT name FROM src._llm_migrations WHERE {same} NOT IN "
            f"(SELECT {same} FROM main._llm_migrations) ORDER BY name"
        )
    ]  # fmt: skip
    if ahead:
        target = run.db.path
        raise UnsupportedDatabase(
            f"{run.source} was written by a newer llm than {target}: it has migration(s) "
            f"{', '.join(ahead)} that {target} lacks; open {target} once with that newer llm "
            f"(for example `llm logs -n 1 -d {target}`), which migrates it, then merge again"
        )
