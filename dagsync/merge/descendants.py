"""The dag messages' plan, settling many messages at once (``messages.plan``'s shortcuts).

Below a message the target lacks, the target has nothing: no row of it has
a parent it lacks. So a new message's descendants need no lookup in the
target: each is new, under its own parent, unless two of them share an
identity (twins: a source without the unique index), which the rounds
collapse. ``rest_new`` settles everything the rounds leave in one pass, when
``in_order`` and no ``twins``; ``below_new`` settles the descendants of one
round's new messages. ``tests/test_message_plan.py`` holds both to what the
rounds alone give.
"""

from __future__ import annotations

from dagsync.merge.core import MAPPED, MAX_CONFLICTS_SHOWN, NEW, TOP, SourceMerge

__all__ = ["below_new", "id_conflict", "in_order", "onto_new", "rest_new", "twins"]


def id_conflict(src: str, id_parent: str, id_hash: str | None, parent: str, content_hash: str | None) -> str:
    return (
        f"message {src} is (parent {id_parent}, hash {(id_hash or '')[:12]}) in the target "
        f"but (parent {parent}, hash {(content_hash or '')[:12]}) in the source"
    )


def below_new(run: SourceMerge, depth: int) -> int | None:
    """Settle every descendant of the messages the last round found new, at once.

    Below a message the target lacks, the target has nothing (no row of it
    has a parent it lacks), so no descendant can match one of its rows: each
    is new, under its own parent, unless two siblings share an identity (a
    source without the unique index), which the rounds collapse. Returns how
    many were settled, or None when such twins are there (nothing is settled
    then). A descendant whose id the target holds for another message is a
    conflict, as in the rounds.
    """
    c = run.conn
    c.execute("DROP TABLE IF EXISTS temp.below_new")
    c.execute(
        "CREATE TEMP TABLE below_new AS WITH RECURSIVE d(src, parent, hash, depth) AS ("
        "  SELECT s.id, s.parent_id, s.hash, m.depth + 1 FROM temp.msg_map m "
        "  JOIN temp.src_msg s ON s.parent_id = m.src WHERE m.depth = ? AND m.kind = ? "
        "  AND NOT EXISTS (SELECT 1 FROM temp.msg_map x WHERE x.src = s.id) "
        "  UNION ALL "
        "  SELECT s.id, s.parent_id, s.hash, d.depth + 1 FROM d JOIN temp.src_msg s ON s.parent_id = d.src "
        "  WHERE NOT EXISTS (SELECT 1 FROM temp.msg_map x WHERE x.src = s.id)"
        ") SELECT src, parent, hash, depth FROM d",
        (depth, NEW),
    )
    twins_below = run.one("SELECT 1 FROM temp.below_new GROUP BY parent, hash HAVING count(*) > 1 LIMIT 1")
    # A twin the last round mapped onto a new message: its children must
    # meet that message's children in one round.
    if twins_below or onto_new(run, depth):
        return None
    _held(run, "SELECT src, parent, hash FROM temp.below_new")
    # In key order: msg_map is keyed by src.
    c.execute(f"INSERT INTO temp.msg_map SELECT src, src, parent, depth, {NEW} FROM temp.below_new ORDER BY src")
    return run.changes()


def onto_new(run: SourceMerge, depth: int) -> bool:
    """A message the round to ``depth`` mapped onto a new one (a twin)."""
    return run.one(
        "SELECT 1 FROM temp.msg_map m JOIN temp.msg_map n ON n.src = m.dst "
        "WHERE m.depth = ? AND m.kind = ? AND n.kind = ? LIMIT 1",
        (depth, MAPPED, NEW),
    ) is not None


def twins(run: SourceMerge) -> bool:
    """Two unsettled messages with one identity (a source without the unique index)."""
    return run.one("SELECT 1 FROM temp.unsettled GROUP BY parent_id, hash HAVING count(*) > 1 LIMIT 1") is not None


def rest_new(run: SourceMerge) -> None:
    """When the rounds have looked up every child of a message the target
    holds, settle the rest as new, at once.

    What is left descends from a message the rounds found new (``in_order``
    found each one's parent settled or earlier), and below a new message the
    target has nothing: with no ``twins``, each is new, under its own parent,
    as ``below_new`` would find it. (A twin the rounds map onto a new message
    ends the one pass before this: ``onto_new``.) A message whose id the
    target holds for another message is a conflict.
    """
    _held(
        run,
        "SELECT id AS src, parent_id AS parent, hash FROM temp.unsettled u "
        "WHERE NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = u.id)",
    )
    # What the rounds settled is there already; unsettled is in key order.
    run.conn.execute(f"INSERT OR IGNORE INTO temp.msg_map SELECT id, id, parent_id, 0, {NEW} FROM temp.unsettled")


def _held(run: SourceMerge, settled_new: str) -> None:
    """Messages about to be settled as new (``settled_new``: src, parent,
    hash) whose id the target holds for another message: each a conflict."""
    for src, id_parent, id_hash, p, h in run.conn.execute(
        f"SELECT n.src, coalesce(t.{run.fmt.parent_column}, '{TOP}'), t.content_hash, n.parent, n.hash "
        f"FROM ({settled_new}) n JOIN main.messages t ON t.{run.fmt.message_key} = n.src LIMIT ?",
        (MAX_CONFLICTS_SHOWN * 10,),
    ):
        run.conflict(id_conflict(src, id_parent, id_hash, p, h))


def in_order(run: SourceMerge) -> bool:
    """Every unsettled message's parent is settled or unsettled-and-earlier in
    the source: no dangling parent, no cycle, and source order is parents first."""
    run.conn.execute("CREATE INDEX temp.unsettled_id ON unsettled (id, rid)")  # covering: no row fetched
    # The earlier-unsettled parent first: it is most messages' (new chains).
    out_of_order = run.one(
        "SELECT count(*) FROM temp.unsettled u WHERE u.parent_id != ? "
        "AND NOT EXISTS (SELECT 1 FROM temp.unsettled p WHERE p.id = u.parent_id AND p.rid < u.rid) "
        "AND NOT EXISTS (SELECT 1 FROM temp.msg_map m WHERE m.src = u.parent_id)",
        (TOP,),
    )
    return out_of_order == 0
