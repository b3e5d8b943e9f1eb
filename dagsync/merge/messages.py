"""DAG messages, both kinds: mapped onto the target from the root down, copied parents first.

**dag** messages (``Key.DAG_MESSAGE``) are keyed by a ULID; their identity is
``(parent_id, content_hash)``. **llm** messages (``Key.HASH_MESSAGE``) are
keyed by a Merkle hash over parent and content: the key is the identity.

Planning maps every source message into ``temp.msg_map (src, dst, parent,
depth, kind)``, parents before children, so that a message's parent's place
in the target is known when the message is looked up:

* SAME - the target has the message's own id, with the same parent and
  identity: it is that row (one bounded pass settles all of these; in a
  re-merge, everything);
* MAPPED - the target has another row with the message's identity under its
  mapped parent: the message is that row. Its parts are not copied, and its
  children, calls and heads follow it there. This cascades: a mapped parent
  makes its children collide too - the case plain ``INSERT OR IGNORE`` gets
  wrong (every conversation that starts with the same system prompt on two
  machines would lose its chain);
* NEW - neither: it is copied, keeping its id. Two source rows with one
  identity (a file without the unique index) become one, the smallest id,
  as canonicalise would.

Rounds of lookups go out one level at a time from what is settled; below a
NEW message the target has nothing, so its descendants are settled at once
(``descendants.py``: in one pass after the rounds, when the source is in order).
Hash messages need no rounds when the source is in order: the key is the
identity, so the pass that settles SAME settles NEW too, its ``depth`` the
source's row order (``_new_in_order``). A message the rounds never reach has a missing parent or a cycle: the
source is refused. Owned rows (the dag format's ``message_parts``,
``owned.py``) are copied with their message, in its transaction.
"""

from __future__ import annotations

from dagsync import bookkeeping
from dagsync.errors import DamagedSource, UnresolvedReference
from dagsync.formats import Key, Table
from dagsync.merge.owned import copy as copy_owned
from dagsync.merge import descendants
from dagsync.merge.core import BOUNDARY, MAPPED, MAX_CONFLICTS_SHOWN, NEW, SAME, TOP, SourceMerge
from dagsync.merge.descendants import id_conflict

__all__ = ["BOUNDARY", "MAPPED", "NEW", "SAME", "apply", "plan"]

def role_conflict(src: str, id_role: str | None, role: str | None) -> str:
    return f"message {src} has role {id_role!r} in the target but {role!r} in the source, under the same hash"


def _conflict(
    src: str, id_parent: str, id_hash: str | None, parent: str, content_hash: str | None,
    id_role: str | None = None, role: str | None = None,
) -> str:
    if id_parent == parent and id_hash == content_hash:
        # The same key and identity, another role: one of the two files is damaged.
        return role_conflict(src, id_role, role)
    return id_conflict(src, id_parent, id_hash, parent, content_hash)


# -- plan ------------------------------------------------------------------------------


def plan(run: SourceMerge, table: Table) -> None:
    """Map every source message onto the target, parents before children."""
    _read_source(run, table)
    _settle_unchanged(run, table)
    if run.thin:
        _boundary(run, table)
    total = run.one("SELECT count(*) FROM temp.src_msg")
    settled = table.key is Key.HASH_MESSAGE and _new_in_order(run)
    if not settled:
        settled = _rounds(run, table, total)
    _refuse_unreached(run, total)
    _order_new(run, table, settled)
    counts = run.counts[table.name]
    for kind, n in run.conn.execute(f"SELECT kind, count(*) FROM temp.msg_map WHERE src != '{TOP}' GROUP BY kind"):
        if kind == NEW:
            counts.added = n
        elif kind == MAPPED:
            counts.mapped = n
        elif kind == SAME:
            counts.existing = n


def _read_source(run: SourceMerge, table: Table) -> None:
    """``temp.src_msg``: each source message's key, parent and identity, by source rowid."""
    key, parent = run.fmt.message_key, run.fmt.parent_column
    identity = "content_hash" if table.key is Key.DAG_MESSAGE else key
    run.conn.execute(
        "CREATE TEMP TABLE src_msg (rid INTEGER PRIMARY KEY, id TEXT NOT NULL, parent_id TEXT, hash TEXT, role TEXT)"
    )
    for low, high in run.chunks("src.messages"):
        run.conn.execute(
            f"INSERT INTO temp.src_msg SELECT rowid, {key}, coalesce({parent}, '{TOP}'), {identity}, role "
            f"FROM src.messages WHERE rowid BETWEEN ? AND ? AND {key} != '{TOP}'",
            (low, high),
        )
    run.conn.execute(
        "CREATE TEMP TABLE msg_map (src TEXT PRIMARY KEY, dst TEXT NOT NULL, parent TEXT NOT NULL, "
        "depth INTEGER NOT NULL, kind INTEGER NOT NULL) WITHOUT ROWID"
    )
    # Where messages were mapped onto another row (few): see _rounds' twin search.
    run.conn.execute(f"CREATE INDEX temp.msg_map_moved ON msg_map (dst) WHERE kind IN ({MAPPED}, {BOUNDARY})")
    run.conn.execute(f"INSERT INTO temp.msg_map VALUES ('{TOP}', '{TOP}', '{TOP}', 0, 0)")


def _settle_unchanged(run: SourceMerge, table: Table) -> None:
    """A message the target holds under its own id, with the same parent and
    identity, is that row whatever its depth (its parent is there too, by the
    same token). One bounded pass settles all of those - in a re-merge, everything."""
    key, parent = run.fmt.message_key, run.fmt.parent_column
    # The role is compared too: the hash stands for it, so the same hash with
    # another role means one file is damaged - left to the rounds, which name it.
    # In key order, so the lookups walk the target's key index in order too.
    run.conn.execute("CREATE UNIQUE INDEX temp.src_msg_id ON src_msg (id)")
    if table.key is Key.DAG_MESSAGE:
        unchanged = f"coalesce(t.{parent}, '{TOP}') = s.parent_id AND t.content_hash IS s.hash AND t.role IS s.role"
        select = f"s.id, s.id, s.parent_id, 0, {SAME} FROM temp.src_msg s JOIN main.messages t ON t.{key} = s.id"
    else:
        # The hash covers the parent: the same hash is the same message. (Its
        # role is compared in a thread, shared.SharedContent: reading it here
        # would cost a row read per message on every re-merge.) What the
        # target lacks is new, as itself, in the same pass, its depth the
        # source's row order - if that order puts parents first
        # (_new_in_order); else the rounds settle it.
        unchanged = "1"
        select = (
            f"s.id, s.id, s.parent_id, CASE WHEN t.{key} IS NULL THEN s.rid ELSE 0 END, "
            f"CASE WHEN t.{key} IS NULL THEN {NEW} ELSE {SAME} END "
            f"FROM temp.src_msg s LEFT JOIN main.messages t ON t.{key} = s.id"
        )
    for low, high in run.chunks("temp.src_msg", "id"):
        run.conn.execute(
            f"INSERT INTO temp.msg_map SELECT {select} WHERE s.id BETWEEN ? AND ? AND {unchanged} ORDER BY s.id",
            (low, high),
        )


def _new_in_order(run: SourceMerge) -> bool:
    """Hash messages: whether each new message's parent is the target's, or
    new and earlier in the source (its depth, ``_settle_unchanged``). Then
    they are settled as they are: no dangling parent, no cycle, parents
    first. Else they are unsettled again, for the rounds (which name a
    dangling parent or a cycle)."""
    out_of_order = run.one(
        "SELECT 1 FROM temp.msg_map c WHERE c.kind = ? AND NOT EXISTS (SELECT 1 FROM temp.msg_map p "
        "WHERE p.src = c.parent AND (p.kind != ? OR p.depth < c.depth)) LIMIT 1",
        (NEW, NEW),
    )
    if out_of_order is None:
        return True
    run.conn.execute("DELETE FROM temp.msg_map WHERE kind = ?", (NEW,))
    return False


def _boundary(run: SourceMerge, table: Table) -> None:
    """A thin source's references to messages it does not hold (a parent, a
    tip): each is the target's row of that id, or the row the target recorded
    it under (``_dagsync_message_map``). One found nowhere stays out of the
    map: the rounds, or the dangling checks, refuse the source."""
    c = run.conn
    key = run.fmt.message_key
    c.execute("CREATE TEMP TABLE boundary (src TEXT PRIMARY KEY) WITHOUT ROWID")
    c.execute(
        f"INSERT OR IGNORE INTO temp.boundary SELECT s.parent_id FROM temp.src_msg s WHERE s.parent_id != '{TOP}' "
        "AND NOT EXISTS (SELECT 1 FROM temp.src_msg p WHERE p.id = s.parent_id)"
    )
    for other, refs in run.fmt.references.items():
        if other == table.name or other not in run.source_tables:
            continue
        for column, ref in refs.items():
            if ref == table.name:
                c.execute(
                    f'INSERT OR IGNORE INTO temp.boundary SELECT s."{column}" FROM src."{other}" s '
                    f'WHERE s."{column}" IS NOT NULL AND s."{column}" != \'{TOP}\' '
                    f'AND NOT EXISTS (SELECT 1 FROM temp.src_msg p WHERE p.id = s."{column}")'
                )
    recorded = "NULL"
    if bookkeeping.has(c, "_dagsync_message_map"):
        recorded = "(SELECT r.target_id FROM main._dagsync_message_map r WHERE r.source_id = b.src)"
    c.execute(
        f"INSERT INTO temp.msg_map SELECT src, dst, '{TOP}', 0, {BOUNDARY} FROM (SELECT b.src, "
        f"coalesce((SELECT t.{key} FROM main.messages t WHERE t.{key} = b.src), {recorded}) AS dst "
        "FROM temp.boundary b) WHERE dst IS NOT NULL"
    )
    run.boundary = run.changes()


def _rounds(run: SourceMerge, table: Table, total: int) -> bool:
    """Settle the rest, a level at a time out from what is settled; True when
    each new message's parent is earlier in the source or held by the target
    (descendants.rest_new, dag format; the hash format gets here only when
    that does not hold: _new_in_order)."""
    c = run.conn
    key, parent = run.fmt.message_key, run.fmt.parent_column
    if table.key is Key.DAG_MESSAGE:
        # Identity is (parent, content_hash): look for it under the mapped parent.
        identity = "content_hash"
        # Under a parent mapped onto another row, the new message it is looked
        # up against may be a twin's the rounds settled before (a source
        # without the unique index): a new message under the same row, child
        # of that row or of another mapped onto it.
        match = (
            "SELECT coalesce((SELECT min(t.id) FROM main.messages t WHERE t.parent_id = lvl.p "
            f"AND t.content_hash = lvl.hash AND t.id != '{TOP}'), CASE WHEN lvl.moved THEN ("
            "SELECT min(c.id) FROM temp.src_msg c JOIN temp.msg_map cm ON cm.src = c.id WHERE c.parent_id IN "
            f"(SELECT lvl.p UNION SELECT x.src FROM temp.msg_map x WHERE x.dst = lvl.p AND x.kind IN ({MAPPED}, {BOUNDARY})) "
            f"AND c.hash IS lvl.hash AND cm.kind = {NEW} AND cm.parent = lvl.p) END)"
        )
    else:
        identity = key
        match = f"SELECT t.{key} FROM main.messages t WHERE t.{key} = lvl.src"
    c.execute(
        "CREATE TEMP TABLE lvl (src TEXT NOT NULL, p TEXT NOT NULL, hash TEXT, role TEXT, moved INTEGER, match TEXT, "
        "id_exists INTEGER, id_parent TEXT, id_hash TEXT, id_role TEXT)"
    )
    c.execute("CREATE INDEX temp.lvl_identity ON lvl (p, hash)")
    # Each round reads the one before it; made here, after the first pass
    # (hash messages' depths, the source's row order, would be random inserts).
    c.execute("CREATE INDEX temp.msg_map_depth ON msg_map (depth)")
    # "depth" counts rounds out from what is settled: a row's parent is
    # always settled a round before it, so round order is parents first.
    depth, done = 0, run.one("SELECT count(*) FROM temp.msg_map") - 1
    # The first round starts from what is left unsettled (in a re-merge,
    # nothing), not from everything settled so far; later rounds from the
    # round before. In key order, so the lookups walk msg_map's key in order too.
    c.execute(
        "CREATE TEMP TABLE unsettled AS SELECT s.rid, s.id, s.parent_id, s.hash, s.role FROM temp.src_msg s "
        "WHERE NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = s.id) ORDER BY s.id"
    )
    # A new message's descendants are new. In the dag format, the rounds
    # look up only the children of messages the target holds, and settle
    # the rest at the end (descendants.rest_new) when the source is in order
    # without twins; else each round's new messages' descendants at once
    # (descendants.below_new).
    dag = table.key is Key.DAG_MESSAGE
    settled = False
    rest_new = dag and descendants.in_order(run) and not descendants.twins(run)
    below_new = dag and not rest_new
    frontier = False  # a round of every unsettled message whose parent is settled
    while not settled:
        c.execute("DELETE FROM temp.lvl")
        if depth == 0 or frontier:
            c.execute(
                "INSERT INTO temp.lvl (src, p, hash, role, moved) SELECT u.id, m.dst, u.hash, u.role, m.dst != m.src "
                "FROM temp.unsettled u JOIN temp.msg_map m ON m.src = u.parent_id"
                + (" WHERE u.id NOT IN (SELECT src FROM temp.msg_map)" if frontier else "")
            )
            frontier = False
        else:
            c.execute(
                "INSERT INTO temp.lvl (src, p, hash, role, moved) SELECT s.id, m.dst, s.hash, s.role, m.dst != m.src "
                "FROM temp.src_msg s "
                "JOIN temp.msg_map m ON m.src = s.parent_id WHERE m.depth = ? AND s.id NOT IN "
                f"(SELECT src FROM temp.msg_map){' AND m.kind != ?' if rest_new else ''}",
                (depth, NEW) if rest_new else (depth,),
            )
        if run.changes() == 0:
            if rest_new:
                descendants.rest_new(run)
                settled = True
                run.progress("mapping messages", total, total)
            break
        # Children are looked up by parent (in the rounds below the first, and by the twin search).
        c.execute("CREATE INDEX IF NOT EXISTS temp.src_msg_parent ON src_msg (parent_id)")
        for low, high in run.chunks("temp.lvl"):
            # Look the level up in the target: by identity, and by id.
            c.execute(
                f"UPDATE temp.lvl SET match = ({match}), "
                f"(id_exists, id_parent, id_hash, id_role) = (SELECT 1, coalesce(t.{parent}, '{TOP}'), t.{identity}, t.role "
                f"FROM main.messages t WHERE t.{key} = lvl.src) "
                "WHERE rowid BETWEEN ? AND ?",
                (low, high),
            )
        for src, id_parent, id_hash, p, h, id_role, role in c.execute(
            "SELECT src, id_parent, id_hash, p, hash, id_role, role FROM temp.lvl WHERE id_exists "
            "AND (id_parent IS NOT p OR id_hash IS NOT hash OR id_role IS NOT role) LIMIT ?",
            (MAX_CONFLICTS_SHOWN * 10,),
        ):
            run.conflict(_conflict(src, id_parent, id_hash, p, h, id_role, role))
        # The message's own id when the target has it unchanged; else the
        # target's row with its identity; else a new row - the smallest
        # source id among source rows with the same identity, so duplicates
        # in a source without the unique index collapse as canonicalise would.
        c.execute(
            "INSERT INTO temp.msg_map (src, dst, parent, depth, kind) "
            "SELECT src, dst, p, ?, CASE WHEN dst = src AND NOT found THEN ? "
            "WHEN dst = src THEN ? ELSE ? END FROM ("
            "  SELECT l.src, l.p, "
            "  CASE WHEN l.id_exists AND l.id_parent IS l.p AND l.id_hash IS l.hash THEN l.src "
            "       WHEN l.match IS NOT NULL THEN l.match "
            "       ELSE (SELECT min(l2.src) FROM temp.lvl l2 WHERE l2.p = l.p AND l2.hash IS l.hash) "
            "  END AS dst, "
            "  (l.match IS NOT NULL OR coalesce(l.id_exists, 0)) AS found "
            "  FROM temp.lvl l)",
            (depth + 1, NEW, SAME, MAPPED),
        )
        done += run.one("SELECT count(*) FROM temp.lvl")
        if rest_new and descendants.onto_new(run, depth + 1):
            # Its children must meet that message's, which the rounds skipped:
            # they are looked up from here, with every message left that can be.
            rest_new, frontier = False, True
        if below_new:
            settled_below = descendants.below_new(run, depth + 1)
            if settled_below is None:
                below_new = False  # twins under a new parent: level by level from here
            else:
                done += settled_below
        run.progress("mapping messages", done, total)
        depth += 1
    return settled


def _refuse_unreached(run: SourceMerge, total: int) -> None:
    """:raises DamagedSource: messages the rounds never reached (a missing parent, a cycle)."""
    # Every map row but the root's (and a thin source's boundary) is a settled source message.
    unreachable = total - (run.one("SELECT count(*) FROM temp.msg_map") - 1 - run.boundary)
    if not unreachable:
        return
    example, parent = next(iter(run.conn.execute(
        "SELECT id, parent_id FROM temp.src_msg WHERE id NOT IN (SELECT src FROM temp.msg_map) "
        "ORDER BY id LIMIT 1"
    )))  # fmt: skip
    dangling = run.one(
        f"SELECT count(*) FROM temp.src_msg s WHERE s.parent_id != '{TOP}' AND NOT EXISTS "
        "(SELECT 1 FROM temp.src_msg p WHERE p.id = s.parent_id) "
        "AND NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = s.parent_id)"
    )
    why = "a parent that does not exist" if dangling else "a cycle in the parent links"
    if dangling and run.thin:
        why = f"a parent that neither it nor {run.db.path} has"
    message = (
        f"{run.source}: {unreachable} message(s) do not lead back to the root "
        f"({why}; for example message {example} has parent {parent}); "
        "nothing was merged - run `dagsync verify` on the source"
    )
    if dangling and run.thin:
        raise UnresolvedReference(message, f"message {example} has parent {parent}")
    raise DamagedSource(message)


def _order_new(run: SourceMerge, table: Table, settled: bool) -> None:
    """``temp.msg_new``: the messages to insert, parents first; ``temp.msg_moved``:
    the ones mapped onto another row, where references to them go."""
    c = run.conn
    # ``rid``: the source's rowid, by which the copy reads each row (the key's
    # index would be one more lookup per message).
    c.execute(
        "CREATE TEMP TABLE msg_new (seq INTEGER PRIMARY KEY, src TEXT NOT NULL, parent TEXT NOT NULL, rid INTEGER NOT NULL)"
    )
    # Parents first, so every commit leaves each one's parent in place. The
    # source's own row order is that order in any file written a message at a
    # time (and it is the order of the ids, so inserts land near each other
    # in every index); where it is not, depth order is.
    if settled and table.key is Key.HASH_MESSAGE:
        # Without rounds: _new_in_order found each new message's parent
        # held by the target or earlier in the source (its depth).
        c.execute(
            # A new message's depth is its source rowid (_settle_unchanged).
            "INSERT INTO temp.msg_new (src, parent, rid) SELECT src, parent, depth FROM temp.msg_map "
            "WHERE kind = ? ORDER BY depth",
            (NEW,),
        )
    else:
        # Settled in order (descendants.rest_new): each new message's parent is
        # earlier, or a message the target holds.
        backwards = not settled and run.one(
            "SELECT count(*) FROM temp.msg_map c JOIN temp.src_msg cs ON cs.id = c.src "
            "JOIN temp.msg_map p ON p.src = cs.parent_id JOIN temp.src_msg ps ON ps.id = cs.parent_id "
            "WHERE c.kind = ? AND p.kind = ? AND ps.rid > cs.rid",
            (NEW, NEW),
        )
        order = "s.rid" if not backwards else "m.depth, m.src"
        c.execute(
            "INSERT INTO temp.msg_new (src, parent, rid) SELECT m.src, m.parent, s.rid FROM temp.msg_map m "
            f"JOIN temp.src_msg s ON s.id = m.src WHERE m.kind = ? ORDER BY {order}",
            (NEW,),
        )
    # Where a reference to a message goes: elsewhere only if it was mapped.
    c.execute("CREATE TEMP TABLE msg_moved (src TEXT PRIMARY KEY, dst TEXT NOT NULL) WITHOUT ROWID")
    c.execute("INSERT INTO temp.msg_moved SELECT src, dst FROM temp.msg_map WHERE kind = ? ORDER BY src", (MAPPED,))
    # A thin source's message the target holds under another id (merged before).
    c.execute("INSERT INTO temp.msg_moved SELECT src, dst FROM temp.msg_map WHERE kind = ? AND dst != src", (BOUNDARY,))
    run.moved = run.one("SELECT count(*) FROM temp.msg_moved")
    # "Is this message new?" is asked of every part and reference.
    c.execute("CREATE UNIQUE INDEX temp.msg_new_src ON msg_new (src)")


# -- apply ------------------------------------------------------------------------------


def apply(run: SourceMerge, table: Table) -> None:
    """Insert the new messages and their owned rows, parents first, then record the map."""
    c = run.conn
    cols = run.columns[table.name]
    key, parent = run.fmt.message_key, run.fmt.parent_column
    top = "n.parent" if run.fmt.root_id == TOP else f"NULLIF(n.parent, '{TOP}')"
    select = ", ".join(top if col == parent else f's."{col}"' for col in cols)
    owned = [t for t in run.order if t.owner and t.owner[1] == table.name]
    for low, high in run.chunks("temp.msg_new", "seq", "copying messages", writes=True):
        # Parents first (msg_new's order) from one transaction to the next, so
        # every commit leaves each inserted message's parent in place. Inside
        # one, the order is free (_insert_order).
        with run.writer.transaction():
            c.execute(
                f"INSERT INTO main.messages ({run.column_list(table)}) SELECT {select} "
                f"FROM temp.msg_new n JOIN src.messages s ON s.rowid = n.rid "
                f"WHERE n.seq BETWEEN ? AND ? AND +s.{key} = n.src ORDER BY {_insert_order(run, table)}",
                (low, high),
            )
            run.written[table.name].added += run.changes()
            for part in owned:
                copy_owned(run, part, low, high)
    _record_map(run)


def _insert_order(run: SourceMerge, table: Table) -> str:
    """The order to insert one transaction's new messages in.

    llm's messages are keyed by a hash, so in key order each page of the
    key's index is visited once. dag messages are keyed by ULIDs, in time
    order like the source's rows; there, ordering by the one random index
    (content_hash) measured slower, as the others lose their order.
    """
    return f"s.{run.fmt.message_key}" if table.key is Key.HASH_MESSAGE else "n.seq"


def _record_map(run: SourceMerge) -> None:
    """Record where each mapped message went, for holders of its old id
    (``_dagsync_message_map``), and carry over the source's own records."""
    c = run.conn
    source_map = bookkeeping.has(c, "_dagsync_message_map", "src") and bool(
        run.one("SELECT 1 FROM src._dagsync_message_map LIMIT 1")
    )
    mapped = run.counts[run.fmt.table("messages").name].mapped  # a thin source's boundary is recorded already
    if not (mapped or source_map):
        return
    with run.writer.transaction():
        bookkeeping.ensure(c)
    for low, high in run.chunks("temp.msg_moved", "src", writes=True):
        with run.writer.transaction():
            c.execute(
                "INSERT OR IGNORE INTO main._dagsync_message_map (source_id, target_id) "
                "SELECT src, dst FROM temp.msg_moved WHERE src BETWEEN ? AND ?",
                (low, high),
            )
    if source_map:
        # The source's own records of old ids, carried over to where they
        # landed - unless the old id is itself a message here.
        for low, high in run.chunks("src._dagsync_message_map", writes=True):
            with run.writer.transaction():
                c.execute(
                    "INSERT OR IGNORE INTO main._dagsync_message_map (source_id, target_id) "
                    "SELECT s.source_id, m.dst FROM src._dagsync_message_map s "
                    "JOIN temp.msg_map m ON m.src = s.target_id WHERE s.rowid BETWEEN ? AND ? "
                    f"AND NOT EXISTS (SELECT 1 FROM main.messages t WHERE t.{run.fmt.message_key} = s.source_id)",
                    (low, high),
                )
