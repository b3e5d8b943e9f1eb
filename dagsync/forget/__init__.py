"""forget: delete selected conversations, and exactly what nothing else reaches any more.

A shared prefix is one set of rows in both formats (a system prompt and
first message two threads share, a fork's past), so deleting a
conversation's messages by hand deletes the other threads' too, and
deleting only its row leaves what only gc can find. ``forget`` does both
halves, safely:

1. **Select** (``select``): conversations by id, age, model and full-text
   query, combined with AND.
2. **Unlink** (``unlink``): each chunk of conversations in one write
   transaction: their rows and everything hanging off them by foreign key
   (turns or calls, responses, search rows and so FTS entries, tool and
   fragment links) are deleted, their ids tombstoned, and what they pointed
   at noted as pending.
3. **Collect** (``collect``): gc's sweep over what only they reached:
   messages, parts, fragments, attachments, tools, blobs. A prefix another
   thread uses stays whole.

**Forgotten stays forgotten.** The tombstones (``tombstones``) live in
``_dagsync_forgotten``; a merge imports the source's and then reapplies
them to the target (``reapply``), so a source that still holds a forgotten
conversation does not bring it back, and a forget travels with sync, push,
pull and bundles. ``restore`` lifts tombstones (a restore travels too); a
``merge --full`` from a file that still holds the conversation then brings
it back.

A ``kill -9`` at any point leaves a consistent file; running forget again
(with any selector) finishes what was pending.
"""

from __future__ import annotations

import datetime as dt
import os
import time
import urllib.parse
from pathlib import Path

from dagsync import faults
from dagsync.db import Database, open_target
from dagsync.errors import DagsyncError
from dagsync.forget import tombstones
from dagsync.forget.collect import Collect
from dagsync.forget.report import Conversation, ForgetReport, RestoreReport
from dagsync.forget.select import Selector, add_merge_forks, create_selection, latest, parse_date, select
from dagsync.forget.tombstones import PENDING
from dagsync.forget.unlink import Unlink
from dagsync.gc import _check_migrations, parse_grace
from dagsync.gc.report import GcTable
from dagsync.writer import Progress, Writer

__all__ = ["ForgetReport", "RestoreReport", "Selector", "forget", "parse_age", "parse_date", "reapply", "restore"]

# The page cache forget works with (KiB): see forget().
CACHE_KIB = 32768


def parse_age(text: str, now: float) -> float:
    """The unix time ``text`` (``90d``, ``12h``, ``2w``, ``1d12h``) before ``now``.

    :raises DagsyncError: anything else.
    """
    try:
        return now - parse_grace(text)
    except DagsyncError:
        raise DagsyncError(f"invalid age {text!r}: give a number and a unit (s, m, h, d or w), e.g. 90d or 52w") from None


@faults.named("path")
def forget(
    path: str | os.PathLike[str],
    selector: Selector,
    *,
    dry_run: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
) -> ForgetReport:
    """Forget the conversations of ``path`` that ``selector`` names; return what was (or would be) deleted.

    :raises NotADatabase, UnsupportedDatabase: a file dagsync cannot read or trust.
    :raises DagsyncError: an empty selector, a query the file cannot answer.
    """
    started = time.perf_counter()
    if selector.empty:
        raise DagsyncError(
            "nothing selected: give --id, --before, --older-than, --model or --query (they combine with AND)"
        )
    clock = time.time() if now is None else now
    db = open_target(path, check=True)
    try:
        _check_migrations(db)
        conn = db.conn
        # Deleting touches a few pages of each index per chunk; a smaller cache
        # than a merge's holds them, and keeps the peak memory of a large forget
        # small (benchmarks/forget.py).
        conn.execute(f"PRAGMA main.cache_size = -{CACHE_KIB}")
        present = _present(db)
        writer = Writer(conn, progress, dry_run=dry_run)
        writer.progress("forget: selecting", 0, 1)
        select(conn, db.format, selector, present)
        listing = _listing(db, present)
        deleted: dict[str, list[int]] = {}

        def attempt() -> tuple[Unlink, Collect | None]:
            return _unlink_and_collect(db, writer, clock, dry_run, deleted, tombstone=True)

        unlink, collect = writer.redo(attempt, "forgetting conversations in it")
        return _report(db, path, selector, dry_run, listing, deleted, collect, started)
    finally:
        _drop_temp(db)
        db.close()


def reapply(db: Database, source: Path | None, writer: Writer) -> int:
    """After a merge of ``source`` into ``db``: take the source's tombstones, then forget in
    ``db`` every conversation a live tombstone names; return the rows deleted (what the
    tombstones kept out). Writes nothing when there is nothing to do."""
    conn = db.conn
    if source is not None:
        uri = "file:" + urllib.parse.quote(str(Path(source).resolve())) + "?mode=ro"
        conn.execute("ATTACH DATABASE ? AS fg_src", (uri,))
        try:
            if tombstones.has(conn, "fg_src"):
                with writer.transaction():
                    tombstones.import_from(conn, "fg_src")
        finally:
            conn.execute("DETACH DATABASE fg_src")
    if not tombstones.has(conn):
        return 0
    present = _present(db)
    spec = db.format.conversations
    assert spec is not None
    create_selection(conn)
    back = " UNION ".join(
        f'SELECT f.key FROM main.{tombstones.FORGOTTEN} f JOIN main."{t}" c ON c."id" = f.key WHERE {tombstones.LIVE}'
        for t in spec.tables
        if t in present
    )
    conn.execute(f"INSERT OR IGNORE INTO temp.fg_sel (key) {back}")
    add_merge_forks(conn, db.format, present, tombstones.live_keys_sql())
    waiting = next(conn.execute("SELECT count(*) FROM temp.fg_sel"))[0] or (
        PENDING in present and any(conn.execute(f"SELECT 1 FROM main.{PENDING} LIMIT 1"))
    )
    if not waiting:
        _drop_temp(db)
        return 0
    deleted: dict[str, list[int]] = {}
    try:
        writer.redo(
            lambda: _unlink_and_collect(db, writer, time.time(), False, deleted, tombstone=False),
            "keeping forgotten conversations out of it",
        )
    finally:
        _drop_temp(db)
    return sum(rows for rows, _ in deleted.values())


@faults.named("path")
def restore(
    path: str | os.PathLike[str], ids: tuple[str, ...] | None, *, dry_run: bool = False, now: float | None = None
) -> RestoreReport:
    """Stop keeping the conversations ``ids`` (every one, with None) forgotten.

    What forget deleted is not in the file any more: a later ``merge --full``
    of a file that still holds a conversation brings it back (and a sync or
    push carries the restore to the other side).

    :raises DagsyncError: an id the file keeps no tombstone for.
    """
    db = open_target(path, check=True)
    try:
        conn = db.conn
        live = {k for (k,) in conn.execute(tombstones.live_keys_sql())} if tombstones.has(conn) else set()
        unknown = sorted(set(ids or ()) - live)
        if unknown:
            raise DagsyncError(
                f"{path} keeps no forgotten conversation {unknown[0]!r}"
                + (f" (nor {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                + ": it was never forgotten in this file, or is restored already"
            )
        chosen = tuple(sorted(live if ids is None else set(ids)))
        if not dry_run and chosen:
            writer = Writer(conn)
            with writer.transaction():
                tombstones.restore(conn, chosen, time.time() if now is None else now)
        return RestoreReport(str(path), dry_run, chosen, len(live) - (0 if dry_run else len(chosen)))
    finally:
        db.close()


def forgotten(path: str | os.PathLike[str]) -> tuple[tuple[str, str], ...]:
    """The conversations ``path`` keeps forgotten: (id, when, UTC), oldest first."""
    db = open_target(path, check=False)
    try:
        if not tombstones.has(db.conn):
            return ()
        return tuple(
            (key, _utc(when))
            for key, when in db.conn.execute(
                f"SELECT f.key, f.forgotten_at FROM main.{tombstones.FORGOTTEN} f WHERE {tombstones.LIVE} "
                "ORDER BY f.forgotten_at, f.key"
            )
        )
    finally:
        db.close()


# -- the steps -----------------------------------------------------------------


def _unlink_and_collect(
    db: Database, writer: Writer, now: float, dry_run: bool, deleted: dict[str, list[int]], *, tombstone: bool
) -> tuple[Unlink, Collect | None]:
    """Unlink the conversations in ``temp.fg_sel``, then collect what only they reached.
    Starts from the file as it is (``Writer.redo`` may call it again)."""
    _drop_temp(db, keep=True)
    conn = db.conn
    present = _present(db)
    if dry_run:
        conn.execute("CREATE TEMP TABLE fg_pending (tbl TEXT NOT NULL, key NOT NULL, PRIMARY KEY (tbl, key)) WITHOUT ROWID")
        pending = "temp.fg_pending"
    else:
        pending = f"main.{PENDING}"
    unlink = Unlink(db, writer, present, pending, dry_run)
    unlink.deleted = deleted
    unlink.run(now, tombstone)
    if not dry_run and PENDING not in _present(db):
        return unlink, None
    if not any(conn.execute(f"SELECT 1 FROM {pending} LIMIT 1")):
        return unlink, None
    collect = Collect(db, now, dry_run, writer, unlink, pending)
    collect.deleted = deleted
    collect.run()
    collect.finish()
    return unlink, collect


def _present(db: Database) -> set[str]:
    return {n for (n,) in db.conn.execute("SELECT name FROM main.sqlite_schema WHERE type = 'table'")}


def _drop_temp(db: Database, keep: bool = False) -> None:
    """Drop forget's temp tables (but the selection, with ``keep``)."""
    conn = db.conn
    for (name,) in list(conn.execute("SELECT name FROM temp.sqlite_schema WHERE type = 'table'")):
        if name.startswith(("fg_", "gc_")) and not (keep and name.startswith(("fg_sel", "fg_latest", "fg_model", "fg_found"))):
            conn.execute(f'DROP TABLE temp."{name}"')


def _utc(when: float | None) -> str | None:
    if when is None:
        return None
    return dt.datetime.fromtimestamp(when, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _listing(db: Database, present: set[str]) -> tuple[Conversation, ...]:
    """The selected conversations: id, name, latest activity."""
    spec = db.format.conversations
    assert spec is not None
    conn = db.conn
    named = [t for t in spec.tables if t in present and "name" in db.format.columns[t]]
    name = (
        "coalesce(" + ", ".join(f'(SELECT "name" FROM main."{t}" WHERE "id" = s.key)' for t in named) + ", NULL)"
        if named
        else "NULL"
    )
    # Latest activity, for the report: one pass per table over the selection.
    latest(conn, spec.times, present, "fg_listed", within="temp.fg_sel")
    return tuple(
        Conversation(key, label, _utc(when))
        for key, label, when in conn.execute(
            f"SELECT s.key, {name}, l.latest FROM temp.fg_sel s LEFT JOIN temp.fg_listed l ON l.key = s.key ORDER BY s.key"
        )
    )


def _report(
    db: Database,
    path: str | os.PathLike[str],
    selector: Selector,
    dry_run: bool,
    listing: tuple[Conversation, ...],
    deleted: dict[str, list[int]],
    collect: Collect | None,
    started: float,
) -> ForgetReport:
    order = [t.name for t in db.format.tables]
    tables = tuple(
        GcTable(name, rows, size)
        for name, (rows, size) in sorted(deleted.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        if rows
    )
    conn = db.conn
    live = next(conn.execute(f"SELECT count(*) FROM ({tombstones.live_keys_sql()})"))[0] if tombstones.has(conn) else 0
    pending = (
        next(conn.execute(f"SELECT count(*) FROM main.{PENDING}"))[0] if PENDING in _present(db) and not dry_run else 0
    )
    return ForgetReport(
        path=str(path),
        format=db.format.name,
        dry_run=dry_run,
        selector=dict(selector.written),
        conversations=listing,
        tables=tables,
        messages=deleted.get("messages", [0, 0])[0],
        shared_messages=collect.shared_prefix if collect is not None else 0,
        deleted=sum(t.deleted for t in tables),
        deleted_bytes=sum(t.bytes for t in tables),
        tombstones=live + (len(listing) if dry_run else 0),
        merge_in_progress=collect.merge_in_progress if collect is not None else False,
        pending=pending,
        file_bytes=Path(path).stat().st_size,
        seconds=round(time.perf_counter() - started, 3),
    )
