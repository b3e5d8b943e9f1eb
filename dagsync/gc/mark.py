"""gc's mark: read the file, in short statements, into a proposal of what to delete.

The mark is only a proposal: the file may change while it reads. It builds
the DAG's skeleton by rowid, walks it up from the roots (``Format.roots``,
and the foreign keys the file itself declares) to find what is reachable,
keeps every unreachable message still inside the grace period with all it
reaches, and lists the rest as candidates, tree by tree, leaves first. Then
it classifies every shared row (fragments, attachments, tools, blobs, ...):
referenced by a survivor, only by rows about to die, or by nothing. The
sweep (``sweep.py``) checks the file as it is before it deletes any of it.
"""

from __future__ import annotations

import re

from dagsync.formats import Collect, Key, Table
from dagsync.gc.run import DYING, SEEN, UNREFERENCED_OLD, WAITING, GcRun, Shared
from dagsync.packed import blob_hash_sql, is_packed, marker_sql, register_functions

__all__ = ["dying", "mark"]


def mark(run: GcRun) -> None:
    # Before the first read: if this never changes, the mark saw one
    # consistent file and the sweep need not check it again.
    run.data_version = run.one("PRAGMA data_version")
    _messages(run)
    _candidates(run)
    for table in run.shared:
        _shared(run, table)


def _messages(run: GcRun) -> None:
    msgs, key, parent = run.main_table("messages"), run.key, run.parent
    run.conn.execute(
        "CREATE TEMP TABLE gc_node (rid INTEGER PRIMARY KEY, prid INTEGER, young INTEGER NOT NULL);"
        "CREATE TEMP TABLE gc_root (rid INTEGER);"
        "CREATE TEMP TABLE gc_live (rid INTEGER PRIMARY KEY);"
    )
    # The skeleton: each message's rowid, its parent's rowid, and whether it is new.
    for low, high in run.ranges(msgs, "gc: reading messages"):
        run.conn.execute(
            f'INSERT INTO temp.gc_node SELECT m.rowid, p.rowid, {run.young("m")} FROM {msgs} m '
            f'LEFT JOIN {msgs} p ON p."{key}" = m."{parent}" WHERE m.rowid BETWEEN ? AND ?',
            (low, high),
        )
    for table, column in run.roots:
        if table not in run.present:
            continue
        for low, high in run.ranges(run.main_table(table), f"gc: reading {table}"):
            run.conn.execute(
                f'INSERT INTO temp.gc_root SELECT m.rowid FROM main."{table}" t '
                f'JOIN {msgs} m ON m."{key}" = t."{column}" WHERE t.rowid BETWEEN ? AND ?',
                (low, high),
            )
    if run.fmt.root_id is not None:
        run.conn.execute(
            f'INSERT INTO temp.gc_root SELECT rowid FROM {msgs} WHERE "{key}" = ?', (run.fmt.root_id,)
        )
    run.root_count = run.one("SELECT count(DISTINCT rid) FROM temp.gc_root")
    run.progress("gc: walking from the roots", 0, 1)
    run.conn.execute(
        "WITH RECURSIVE r(rid) AS ("
        " SELECT rid FROM temp.gc_root"
        " UNION SELECT n.prid FROM r JOIN temp.gc_node n ON n.rid = r.rid WHERE n.prid IS NOT NULL"
        ") INSERT INTO temp.gc_live SELECT rid FROM r"
    )
    run.conn.execute(
        "CREATE TEMP TABLE gc_unreach (rid INTEGER PRIMARY KEY, key TEXT, prid INTEGER,"
        " young INTEGER NOT NULL, keep INTEGER NOT NULL DEFAULT 0);"
        "INSERT INTO temp.gc_unreach (rid, prid, young) SELECT rid, prid, young FROM temp.gc_node"
        " WHERE rid NOT IN (SELECT rid FROM temp.gc_live);"
    )
    run.reachable = run.one("SELECT count(*) FROM temp.gc_node WHERE rid IN (SELECT rid FROM temp.gc_live)")
    run.unreachable = run.one("SELECT count(*) FROM temp.gc_unreach")
    for low, high in run.ranges("temp.gc_unreach", "gc: reading unreachable messages"):
        run.conn.execute(
            f'UPDATE temp.gc_unreach SET key = (SELECT m."{key}" FROM {msgs} m WHERE m.rowid = gc_unreach.rid) '
            "WHERE rid BETWEEN ? AND ?",
            (low, high),
        )
    if run.fmt.message_time is None and not run.no_grace:
        # No time on the rows: new until gc has seen them unreachable for the grace period.
        seen = (
            f"(SELECT key FROM main.{SEEN} WHERE tbl = 'messages' AND first_seen <= {run.cutoff!r})"
            if run.has_seen_table()
            else "(SELECT NULL WHERE 0)"
        )
        run.conn.execute(f"UPDATE temp.gc_unreach SET young = (key IS NULL OR key NOT IN {seen})")


def _candidates(run: GcRun) -> None:
    # A new unreachable message keeps everything it reaches.
    run.conn.execute(
        "WITH RECURSIVE y(rid) AS ("
        " SELECT rid FROM temp.gc_unreach WHERE young"
        " UNION SELECT u.prid FROM y JOIN temp.gc_unreach u ON u.rid = y.rid WHERE u.prid IS NOT NULL"
        ") UPDATE temp.gc_unreach SET keep = 1 WHERE rid IN (SELECT rid FROM y)"
    )
    run.kept_by_grace = run.one("SELECT count(*) FROM temp.gc_unreach WHERE keep")
    run.waiting["messages"] = run.kept_by_grace
    # Leaves first: depth from the candidates whose parent is not one, deepest first.
    run.conn.execute(
        "CREATE INDEX temp.gc_unreach_prid ON gc_unreach (prid);"
        "CREATE TEMP TABLE gc_cand (seq INTEGER PRIMARY KEY, key TEXT NOT NULL);"
        "WITH RECURSIVE d(rid, depth, top) AS ("
        " SELECT rid, 0, rid FROM temp.gc_unreach c WHERE NOT keep AND key IS NOT NULL"
        "   AND (prid IS NULL OR prid NOT IN (SELECT rid FROM temp.gc_unreach WHERE NOT keep))"
        " UNION ALL"
        " SELECT c.rid, d.depth + 1, d.top FROM d JOIN temp.gc_unreach c ON c.prid = d.rid"
        "   WHERE NOT c.keep AND c.rid != d.rid AND c.key IS NOT NULL"
        # Tree by tree (a deleted conversation's messages sit together in
        # the file), each leaves first: a chunk's deletes touch few pages.
        ") INSERT INTO temp.gc_cand (key) SELECT u.key FROM d JOIN temp.gc_unreach u USING (rid)"
        " ORDER BY d.top, d.depth DESC, d.rid DESC;"
        "CREATE UNIQUE INDEX temp.gc_cand_key ON gc_cand (key);"
    )


def dying(run: GcRun, table: Table, alias: str) -> str:
    """SQL true when row ``alias`` of ``table`` is to be deleted by this run: it goes with a
    candidate message, or it is a shared row classified for deletion (0 for other tables)."""
    shared = next((t for t in run.shared if t.name == table.name), None)
    if shared is not None and run.refs_made:
        return (
            f'{alias}."{shared.pk}" IN (SELECT key FROM temp.gc_dep WHERE tbl = \'{shared.name}\' '
            f"AND state IN ({DYING}, {UNREFERENCED_OLD}))"
        )
    if table.collect is not Collect.WITH_OWNER or table.owned_by is None:
        return run.gone(table.name, alias)
    owner = run.fmt.table(run.fmt.references[table.name][table.owned_by])
    if owner.collect is Collect.UNREACHABLE:
        return f'{alias}."{table.owned_by}" IN (SELECT key FROM temp.gc_cand)'
    column = run.fmt.referenced_columns[table.name][table.owned_by]
    keys = f"gc_dying_{owner.name}"
    if keys not in run.dying_tables:
        # The owner's dying keys, gathered once (a candidate's parts, say).
        run.conn.execute(f"CREATE TEMP TABLE {keys} (key PRIMARY KEY)")
        inner = dying(run, owner, "o")
        for low, high in run.ranges(run.main_table(owner.name)):
            run.conn.execute(
                f'INSERT OR IGNORE INTO temp.{keys} SELECT o."{column}" FROM main."{owner.name}" o '
                f"WHERE o.rowid BETWEEN ? AND ? AND {inner}",
                (low, high),
            )
        run.dying_tables.add(keys)
    return f'{alias}."{table.owned_by}" IN (SELECT key FROM temp.{keys})'


def _shared(run: GcRun, table: Shared) -> None:
    """Classify each row of a shared table: referenced by a survivor, only by dying rows, or by nothing."""
    if not run.refs_made:
        run.conn.execute(
            "CREATE TEMP TABLE gc_ref (tbl TEXT, key, dying INTEGER);"
            "CREATE INDEX temp.gc_ref_key ON gc_ref (tbl, key, dying);"
            "CREATE TEMP TABLE gc_dep (tbl TEXT, key, state INTEGER, PRIMARY KEY (tbl, key));"
        )
        run.refs_made = True
    for other, column in table.refs:
        if other not in run.present:
            continue
        referrer = next((t for t in run.fmt.tables if t.name == other), Table(other, Key.TEXT))
        for low, high in run.ranges(run.main_table(other), f"gc: reading {other}"):
            run.conn.execute(
                f'INSERT INTO temp.gc_ref SELECT ?, t."{column}", {dying(run, referrer, "t")} '
                f'FROM main."{other}" t WHERE t.rowid BETWEEN ? AND ? AND t."{column}" IS NOT NULL',
                (table.name, low, high),
            )
    for ref in run.fmt.payload_refs:
        if ref.target != table.name or ref.table not in run.present:
            continue
        referrer = run.fmt.table(ref.table)
        needle = '"' + re.split(r"[.\[]", ref.path.removeprefix("$."))[0] + '"'
        value = f't."{ref.column}"'
        packed = next((c for c in run.fmt.packed if (c.table, c.column) == (ref.table, ref.column)), None)
        if packed is not None and is_packed(run.conn):
            # A packed payload is read through its blob.
            register_functions(run.conn)
            value = f"(CASE WHEN {marker_sql(packed, 't')} THEN CAST(dagsync_unpack({value}, 'text') AS TEXT) ELSE {value} END)"
        for low, high in run.ranges(run.main_table(ref.table), f"gc: reading {ref.table}.{ref.column}"):
            run.conn.execute(
                f'INSERT INTO temp.gc_ref SELECT ?, j.value, {dying(run, referrer, "t")} '
                f"FROM main.\"{ref.table}\" t, json_tree({value}) j "
                f"WHERE t.rowid BETWEEN ? AND ? AND instr({value}, ?) "
                # SQLite quotes some labels in fullkey ($."text_ref"[0]): compare without quotes.
                f"AND json_valid({value}) AND replace(j.fullkey, '\"', '') GLOB ?",
                (table.name, low, high, needle, ref.glob),
            )
    for packed in table.markers:
        referrer = run.fmt.table(packed.table)
        ref = blob_hash_sql(packed, "t")
        for low, high in run.ranges(run.main_table(packed.table), f"gc: reading {packed.table}.{packed.column}"):
            run.conn.execute(
                f'INSERT INTO temp.gc_ref SELECT ?, {ref}, {dying(run, referrer, "t")} FROM main."{packed.table}" t '
                f"WHERE t.rowid BETWEEN ? AND ? AND {marker_sql(packed, 't')}",
                (table.name, low, high),
            )
    pk = table.pk
    seen = (
        "0"
        if run.no_grace
        else f"(SELECT first_seen FROM main.{SEEN} s WHERE s.tbl = ?1 AND s.key = CAST(d.\"{pk}\" AS TEXT))"
        if run.has_seen_table()
        else "NULL"
    )
    for low, high in run.ranges(run.main_table(table.name), f"gc: reading {table.name}"):
        run.conn.execute(
            f'INSERT INTO temp.gc_dep SELECT ?1, d."{pk}", CASE '
            f'WHEN EXISTS (SELECT 1 FROM temp.gc_ref r WHERE r.tbl = ?1 AND r.key = +d."{pk}") THEN {DYING} '
            f"WHEN {seen} <= ?4 THEN {UNREFERENCED_OLD} ELSE {WAITING} END "
            f'FROM main."{table.name}" d WHERE d.rowid BETWEEN ?2 AND ?3 AND NOT ({table.keep}) AND NOT EXISTS '
            # +d.pk: no affinity on the right, so the index on gc_ref (tbl, key)
            # is used for the key too (an INTEGER id would make it numeric).
            f'(SELECT 1 FROM temp.gc_ref r WHERE r.tbl = ?1 AND r.key = +d."{pk}" AND NOT r.dying)',
            (table.name, low, high, run.cutoff),
        )
    run.waiting[table.name] = run.one(
        "SELECT count(*) FROM temp.gc_dep WHERE tbl = ? AND state = ?", (table.name, WAITING)
    )
