"""gc's sweep: delete the candidates and what only they used, a chunk at a time.

Each chunk of candidate messages is one write transaction (or step of the
writer's long one) that first checks the file as it is now (``_protect``): a
candidate is kept, with its ancestors, when a root points at it, when it has
a child that is not a candidate of this or an earlier chunk, or when its own
time is inside the grace period. So a message goes only together with
everything below it: no commit point leaves a dangling parent, and nothing a
root reaches is deleted, whatever was written since the mark. Shared rows
then go in transactions that first check again that no row references them;
last, ``record`` starts the grace clock for what waits and forgets what is
reachable or referenced again.
"""

from __future__ import annotations

from dagsync import bookkeeping
from dagsync.formats import Collect, Table
from dagsync.gc.run import DYING, MESSAGE_MAP, SEEN, UNREFERENCED_OLD, WAITING, GcRun
from dagsync.packed import generation

__all__ = ["record", "sweep", "sweep_shared"]


def sweep(run: GcRun) -> None:
    if not run.dry_run and run.shared:
        _mark_dying_as_old(run)
    run.conn.execute("CREATE TEMP TABLE gc_chunk (key TEXT PRIMARY KEY)")
    total = run.one("SELECT count(*) FROM temp.gc_cand")
    done = 0
    for low, high in run.ranges("temp.gc_cand", writes=True):
        with run.writer.transaction():
            if bookkeeping.merge_running(run.db.path):
                # Messages a merge has copied look old and unreachable until
                # its last steps point at them: leave the rest to the next run.
                run.merge_in_progress = run.kept_back = True
                break
            run.conn.execute("DELETE FROM temp.gc_chunk")
            run.conn.execute("INSERT INTO temp.gc_chunk SELECT key FROM temp.gc_cand WHERE seq BETWEEN ? AND ?", (low, high))
            _protect(run, high)
            where = f't."{run.key}" IN (SELECT key FROM temp.gc_chunk)'
            _delete_owned(run, run.messages, where)
            run.delete(run.messages.name, where)
            if not run.dry_run:
                if run.stamp:
                    bookkeeping.rewritten(run.conn, run.stamp)
                if MESSAGE_MAP in run.present:
                    run.conn.execute(f"DELETE FROM main.{MESSAGE_MAP} WHERE target_id IN (SELECT key FROM temp.gc_chunk)")
                if run.has_seen_table():
                    run.conn.execute(
                        f"DELETE FROM main.{SEEN} WHERE tbl = 'messages' AND key IN (SELECT key FROM temp.gc_chunk)"
                    )
        done += high - low + 1
        run.progress("gc: deleting messages", done, total)


def _protect(run: GcRun, high: int) -> None:
    """Take out of the chunk (and the candidates) every message the file as it is now still needs.

    Kept: a message a root points at, one that is new by its own time,
    and one with a child that is not a candidate of this or an earlier
    chunk (written since the mark, or kept) - and then its parent, and so on.
    """
    if run.unchanged():
        return  # nothing but this gc has written since the mark: it stands as it is
    msgs = run.main_table("messages")
    found = [
        f'SELECT t."{column}" FROM main."{table}" t WHERE t."{column}" IN (SELECT key FROM temp.gc_chunk) '
        f"AND NOT {run.gone(table, 't')}"
        for table, column in run.roots
        if table in run.present
    ]
    if run.fmt.message_time is not None:
        found.append(
            f'SELECT m."{run.key}" FROM {msgs} m WHERE m."{run.key}" IN (SELECT key FROM temp.gc_chunk) '
            f"AND {run.young('m')}"
        )
    children = (
        # CROSS JOIN: look each chunk member's children up by the parent index
        # (left to itself the planner may scan every message per chunk).
        f'SELECT c.key FROM temp.gc_chunk c CROSS JOIN {msgs} ch ON ch."{run.parent}" = c.key '
        f'WHERE ch."{run.key}" != c.key AND NOT EXISTS '
        f'(SELECT 1 FROM temp.gc_cand k WHERE k.key = ch."{run.key}" AND k.seq <= {int(high)})'
    )
    query = " UNION ".join([*found, children])
    run.conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_kept (key TEXT PRIMARY KEY)")
    while True:
        run.conn.execute("DELETE FROM temp.gc_kept")
        run.conn.execute(f"INSERT INTO temp.gc_kept {query}")
        kept = run.one("SELECT count(*) FROM temp.gc_kept")
        if not kept:
            return
        run.kept_as_new += kept
        run.kept_back = True
        run.conn.execute("DELETE FROM temp.gc_cand WHERE key IN (SELECT key FROM temp.gc_kept)")
        run.conn.execute("DELETE FROM temp.gc_chunk WHERE key IN (SELECT key FROM temp.gc_kept)")
        # Their parents in this chunk now have a child that stays: look again.
        query = children


def _delete_owned(run: GcRun, table: Table, where: str) -> None:
    """Delete the rows collected with the rows of ``table`` matching ``where``, deepest first."""
    for child in run.fmt.tables:
        if child.collect is not Collect.WITH_OWNER or child.name not in run.present:
            continue
        if run.fmt.references[child.name].get(child.owned_by or "") != table.name:
            continue
        column = run.fmt.referenced_columns[child.name][child.owned_by]  # type: ignore[index]
        if table is run.messages and column == run.key:
            keys = "temp.gc_chunk"  # the chunk's own keys
        else:
            # The owners' keys, gathered once for every child and grandchild.
            keys = f'temp."gc_keys_{table.name}_{column}"'
            run.conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {keys.removeprefix('temp.')} (key PRIMARY KEY)")
            run.conn.execute(f"DELETE FROM {keys}")
            run.conn.execute(
                f'INSERT OR IGNORE INTO {keys} SELECT t."{column}" FROM main."{table.name}" t WHERE {where}'
            )
        child_where = f't."{child.owned_by}" IN (SELECT key FROM {keys})'
        _delete_owned(run, child, child_where)
        run.delete(child.name, child_where)


def _mark_dying_as_old(run: GcRun) -> None:
    """Record the shared rows only candidates reference as past their grace period.

    If this run is interrupted after deleting their last references, the
    next run finds them unreferenced and old, and deletes them.
    """
    if not run.one(f"SELECT 1 FROM temp.gc_dep WHERE state = {DYING} LIMIT 1"):
        return  # nothing to record: a gc that deletes nothing writes nothing
    run.ensure_seen()
    for low, high in run.ranges("temp.gc_dep", writes=True, where=f"state = {DYING}"):
        with run.writer.transaction():
            run.conn.execute(
                f"INSERT OR REPLACE INTO main.{SEEN} (tbl, key, first_seen) "
                f"SELECT tbl, CAST(key AS TEXT), 0 FROM temp.gc_dep WHERE state = {DYING} AND rowid BETWEEN ? AND ?",
                (low, high),
            )


# -- 3. shared rows --------------------------------------------------------


def sweep_shared(run: GcRun) -> None:
    if not run.shared:
        return
    run.conn.execute("CREATE TEMP TABLE gc_dep_chunk (key PRIMARY KEY)")
    for table in run.shared:
        pk = table.pk
        where = f"tbl = '{table.name}' AND state IN ({DYING}, {UNREFERENCED_OLD})"
        for low, high in run.ranges("temp.gc_dep", writes=True, where=where):
            with run.writer.transaction():
                run.conn.execute("DELETE FROM temp.gc_dep_chunk")
                run.conn.execute(
                    f"INSERT INTO temp.gc_dep_chunk SELECT key FROM temp.gc_dep WHERE {where} AND rowid BETWEEN ? AND ?",
                    (low, high),
                )
                if not run.dry_run:
                    before = run.one("SELECT count(*) FROM temp.gc_dep_chunk")
                    if bookkeeping.merge_running(run.db.path):
                        # A merge's plan may have matched these rows: next run.
                        run.merge_in_progress = run.kept_back = True
                        run.conn.execute("DELETE FROM temp.gc_dep_chunk")
                    if table.markers and generation(run.conn) != run.generation:
                        # Blob references are not indexed, so they are not looked
                        # up again here: if pack or merge wrote some since the
                        # mark, leave the store to the next run.
                        run.conn.execute("DELETE FROM temp.gc_dep_chunk")
                    if run.kept_back:
                        # The sweep kept rows it meant to delete; what only they
                        # used may be referenced in ways not looked up again here
                        # (inside JSON, by blob reference): keep it this time.
                        run.conn.execute(
                            f"DELETE FROM temp.gc_dep_chunk WHERE key IN (SELECT key FROM temp.gc_dep "
                            f"WHERE tbl = ? AND state = {DYING})",
                            (table.name,),
                        )
                    # A reference written since the mark, or kept by the sweep, keeps the row.
                    for other, column in table.refs if run.kept_back or not run.unchanged() else ():
                        if other in run.present:
                            run.conn.execute(
                                f'DELETE FROM temp.gc_dep_chunk WHERE key IN (SELECT t."{column}" '
                                f'FROM main."{other}" t WHERE t."{column}" IN (SELECT key FROM temp.gc_dep_chunk))'
                            )
                    if run.one("SELECT count(*) FROM temp.gc_dep_chunk") != before:
                        run.kept_back = True
                run.delete(table.name, f't."{pk}" IN (SELECT key FROM temp.gc_dep_chunk)', table.columns)
                if not run.dry_run and run.stamp:
                    bookkeeping.rewritten(run.conn, run.stamp)
                if not run.dry_run and run.has_seen_table():
                    run.conn.execute(
                        f"DELETE FROM main.{SEEN} WHERE tbl = ? AND key IN "
                        "(SELECT CAST(key AS TEXT) FROM temp.gc_dep_chunk)",
                        (table.name,),
                    )
            run.progress(f"gc: deleting {table.name}", high, high)


# -- 4. record -------------------------------------------------------------


def record(run: GcRun) -> None:
    """Start the grace clock for what waits; forget what is reachable or referenced again."""
    if run.dry_run:
        return
    timeless = run.fmt.message_time is None
    waiting = (timeless and run.kept_by_grace) or any(run.waiting.get(t.name) for t in run.shared)
    if not waiting and not run.has_seen_table():
        return  # nothing to remember, and no table to tidy: write nothing
    run.ensure_seen()
    if timeless:
        for low, high in run.ranges("temp.gc_unreach", writes=True, where="keep AND key IS NOT NULL"):
            with run.writer.transaction():
                run.conn.execute(
                    f"INSERT OR IGNORE INTO main.{SEEN} (tbl, key, first_seen) SELECT 'messages', key, ? "
                    "FROM temp.gc_unreach WHERE keep AND key IS NOT NULL AND rowid BETWEEN ? AND ?",
                    (run.now, low, high),
                )
    for low, high in run.ranges("temp.gc_dep", writes=True, where=f"state = {WAITING}"):
        with run.writer.transaction():
            run.conn.execute(
                f"INSERT OR IGNORE INTO main.{SEEN} (tbl, key, first_seen) SELECT tbl, CAST(key AS TEXT), ? "
                f"FROM temp.gc_dep WHERE state = {WAITING} AND rowid BETWEEN ? AND ?",
                (run.now, low, high),
            )
    # Entries for rows this run found reachable or referenced.
    run.conn.execute("CREATE TEMP TABLE gc_unseen (tbl TEXT, key TEXT, PRIMARY KEY (tbl, key))")
    run.conn.execute("CREATE INDEX temp.gc_unreach_key ON gc_unreach (key)")
    has_dep = run.refs_made
    for low, high in run.ranges(f"main.{SEEN}"):
        run.conn.execute(
            f"INSERT INTO temp.gc_unseen SELECT s.tbl, s.key FROM main.{SEEN} s WHERE s.rowid BETWEEN ? AND ? AND "
            "CASE WHEN s.tbl = 'messages' THEN s.key NOT IN (SELECT key FROM temp.gc_unreach WHERE key IS NOT NULL) "
            + (
                "ELSE NOT EXISTS (SELECT 1 FROM temp.gc_dep d WHERE d.tbl = s.tbl AND CAST(d.key AS TEXT) = s.key) END"
                if has_dep
                else "ELSE 1 END"
            ),
            (low, high),
        )
    for low, high in run.ranges("temp.gc_unseen", writes=True):
        with run.writer.transaction():
            run.conn.execute(
                f"DELETE FROM main.{SEEN} WHERE (tbl, key) IN "
                "(SELECT tbl, key FROM temp.gc_unseen WHERE rowid BETWEEN ? AND ?)",
                (low, high),
            )
