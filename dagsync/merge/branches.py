"""Branches: which one keeps a diverged conversation, and which calls follow a fork.

When a conversation (a thread, in the llm format) has diverged between the
two files, ``pointers`` adds a fork row. Two rules make the result the same
whichever file is the target, and make a fork something llm can continue:

* **The branch continued last keeps the conversation.** Of the two tips, the
  one with the later time (``Format.branch_time``: the turn that ends at it,
  in the llm format; the message's own ``created_at`` in the dag format),
  then the greater key, keeps the original row; the other gets the fork. So
  the target's own branch may be the one that moves to a fork (``SWAP``).
* **A call follows its branch.** Every call of the conversation, in either
  file, belongs to the row (the conversation or one of its forks) whose
  chain, after this merge, holds the call's tip; the conversation itself
  where both do (their common prefix). ``temp.branch`` says where source
  calls go when they are copied or compared, ``temp.tmove`` which target
  calls move (``apply``).

A fork's key and name come from the branch alone (``pointers.fork_key``, the
label of the file the branch came from), so two files that merge each other
in either order, or ``sync``, end with the same rows.
"""

from __future__ import annotations

from dagsync.formats import Table
from dagsync.merge.core import SourceMerge

__all__ = ["SWAP", "apply", "choose", "plan"]

# A verdict in temp.ptr besides pointers' own: the heads diverged and the
# source's branch is newer: the row moves to the source's head, and the
# target's branch gets the fork.
SWAP = 4


def choose(run: SourceMerge, table: Table, fork: int) -> None:
    """Turn each ``fork`` verdict whose source branch is the newer into ``SWAP``."""
    if run.fmt.branch_time is None or table.name != run.fmt.conversation_table:
        return
    tbl, tip, time, scope = run.fmt.branch_time

    def latest(schema: str, head: str) -> str:
        within = f' AND "{scope}" = ptr.key' if scope else ""
        return (
            f"(SELECT coalesce(max(unixepoch(\"{time}\", 'subsec')), -1) FROM {schema}.\"{tbl}\" "
            f'WHERE "{tip}" = ptr.{head}{within})'
        )

    run.conn.execute(
        f"UPDATE temp.ptr SET verdict = {SWAP} WHERE verdict = {fork} AND "
        f"({latest('src', 's_raw')}, s_head) > ({latest('main', 't_head')}, t_head)"
    )


def plan(
    run: SourceMerge, table: Table, forks: list[tuple[str, str, str, bool]], fast_forward: int, changing: str
) -> None:
    """Where every call of each conversation the merge moves or forks belongs.

    ``forks``: (conversation, fork key, head, whether the head is the
    source's) for each fork row the merge will add; ``fast_forward``:
    pointers' verdict for a row that moves on to the source's head;
    ``changing``: SQL true for the temp.ptr rows whose branches change (a
    fork added, or a fork moved on). The others keep every branch where it
    is: their calls are compared through ``maps.differs``, which takes a
    target call on a fork of the source call's conversation for the same.
    """
    fmt = run.fmt
    if fmt.call_conversation is None or table.name != fmt.conversation_table:
        return
    if not run.one(f"SELECT 1 FROM temp.ptr WHERE {changing} LIMIT 1"):
        return
    c = run.conn
    FAST_FORWARD = fast_forward  # noqa: N806 - pointers' constant, passed in (pointers imports this module)
    # Each row's head after the merge: the conversation, its earlier forks, its new forks.
    c.execute("CREATE TEMP TABLE heads (key TEXT NOT NULL, row TEXT NOT NULL, head TEXT, from_src INTEGER NOT NULL)")
    moved = f"verdict = {SWAP} OR (verdict = {FAST_FORWARD} AND row = key)"
    c.execute(
        f"INSERT INTO temp.heads SELECT key, key, CASE WHEN {moved} THEN s_raw ELSE t_head END, "
        f"CASE WHEN {moved} THEN 1 ELSE 0 END FROM temp.ptr WHERE {changing}"
    )
    c.execute(
        "INSERT INTO temp.heads SELECT c.key, c.row, CASE WHEN p.verdict = ? AND p.row = c.row THEN p.s_raw "
        "ELSE c.head END, p.verdict = ? AND p.row = c.row FROM temp.cand c JOIN temp.ptr p ON p.key = c.key "
        f"WHERE c.row != c.key AND c.key IN (SELECT key FROM temp.ptr WHERE {changing})",
        (FAST_FORWARD, FAST_FORWARD),
    )
    c.executemany("INSERT INTO temp.heads VALUES (?, ?, ?, ?)", [(k, f, h, int(s)) for k, f, h, s in forks])
    _chains(run)
    # Source calls: to the row whose chain holds the call's tip (the conversation first).
    key = fmt.table(fmt.call_table).natural_key[0]
    conv, tip = fmt.call_conversation, fmt.call_tip
    calls = fmt.call_table
    target_tip = f't."{tip}"'

    def owner(alias: str, mapped_tip: str) -> str:
        return (
            f"(SELECT b.row FROM temp.bchain b WHERE b.key = {alias}.\"{conv}\" AND b.msg = {mapped_tip} "
            "ORDER BY b.row != b.key, b.row LIMIT 1)"
        )

    source_tip = f'(SELECT dst FROM temp.msg_map WHERE src = s."{tip}")'
    c.execute("CREATE TEMP TABLE branch (call TEXT PRIMARY KEY, conv TEXT NOT NULL) WITHOUT ROWID")
    c.execute(
        f"INSERT INTO temp.branch SELECT call, conv FROM (SELECT s.\"{key}\" AS call, s.\"{conv}\" AS old, "
        f"{owner('s', source_tip)} AS conv "
        f'FROM src."{calls}" s WHERE s."{conv}" IN (SELECT key FROM temp.heads)) '
        "WHERE conv IS NOT NULL AND conv IS NOT old"
    )
    c.execute("CREATE TEMP TABLE tmove (call TEXT PRIMARY KEY, conv TEXT NOT NULL) WITHOUT ROWID")
    c.execute(
        f"INSERT INTO temp.tmove SELECT call, conv FROM (SELECT t.\"{key}\" AS call, t.\"{conv}\" AS old, "
        f"{owner('t', target_tip)} AS conv "
        f'FROM main."{calls}" t WHERE t."{conv}" IN (SELECT key FROM temp.heads)) '
        "WHERE conv IS NOT NULL AND conv IS NOT old"
    )
    run.branches = True


def _chains(run: SourceMerge) -> None:
    """``temp.bchain``: every message on each head's chain, in the target's keys."""
    c = run.conn
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute("CREATE TEMP TABLE bchain (key TEXT NOT NULL, row TEXT NOT NULL, msg TEXT)")
    c.execute(
        f"INSERT INTO temp.bchain WITH RECURSIVE up(key, row, cur) AS ("
        f"SELECT key, row, head FROM temp.heads WHERE NOT from_src AND head IS NOT NULL "
        f"UNION SELECT up.key, up.row, m.{parent} FROM up JOIN main.messages m ON m.{mkey} = up.cur "
        f"WHERE {not_root}) SELECT key, row, cur FROM up"
    )
    c.execute(
        f"INSERT INTO temp.bchain WITH RECURSIVE up(key, row, cur) AS ("
        f"SELECT key, row, head FROM temp.heads WHERE from_src AND head IS NOT NULL "
        f"UNION SELECT up.key, up.row, m.{parent} FROM up JOIN src.messages m ON m.{mkey} = up.cur "
        f"WHERE {not_root}) SELECT up.key, up.row, mm.dst FROM up JOIN temp.msg_map mm ON mm.src = up.cur"
    )
    c.execute("CREATE INDEX temp.bchain_key ON bchain (key, msg)")


def apply(run: SourceMerge) -> int:
    """Move the target's calls onto their branches' rows; how many moved.
    Call inside the transaction that added the fork rows."""
    if not run.branches:
        return 0
    fmt = run.fmt
    key = fmt.table(fmt.call_table).natural_key[0]
    run.conn.execute(
        f'UPDATE main."{fmt.call_table}" SET "{fmt.call_conversation}" = m.conv FROM temp.tmove m '
        f'WHERE main."{fmt.call_table}"."{key}" = m.call'
    )
    return run.changes()
