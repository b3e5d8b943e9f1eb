"""Branches: which one keeps a diverged conversation, and which calls follow a fork.

When a conversation (a thread, in the llm format) has diverged between the
two files, ``pointers`` adds a fork row. The conversation and its forks are a
*family* (``temp.fam``: each fork row -> the conversation it forked from, as
either file records it: llm's ``forked_from``, dagsync's ``_dagsync_forks``).
Three rules make the result the same whichever file is the target, and make
a fork something llm can continue:

* **The branch continued last keeps the conversation.** Of the two tips, the
  one with the later time (``Format.branch_time``: the turn that ends at it,
  in the llm format; the message's own ``created_at`` in the dag format),
  then the greater key, keeps the original row; the other gets the fork. So
  the target's own branch may be the one that moves to a fork (``SWAP``).
  That holds too when the source's branch continues one of the target's
  forks (the target forked it in an earlier merge, the source never did):
  if it is the newer, the conversation takes it and the fork stays where it
  was.
* **A call follows its branch.** Every call of a family, in either file,
  belongs to the row whose chain, after this merge, holds the call's tip:
  the conversation itself where it does (their common prefix), else the
  fork with the shortest chain (the fork made where the branch began keeps
  the turns it had when a later fork of the same branch arrives, so both
  stay rows llm can continue), then the least key. A fork whose head the
  conversation's own chain went on to hold (the conversation continued
  that branch in a file that never saw the fork) holds no calls.
  ``temp.branch`` says where source calls go when they are copied or
  compared, ``temp.tmove`` which target calls move (``apply``).
* **Calls are placed again wherever a family changes**: a fork added, a
  fork moved on, or a row of the family arriving from the source. The same
  family in two files then holds the same calls on the same rows, however
  the files came by their forks.

A fork's key and name come from the branch alone (``pointers._fork_key``
from where the branch begins, ``starts``; the label of the file the branch
came from), so two files that merge each other in either order, or
``sync``, end with the same rows.
"""

from __future__ import annotations

import json
from typing import Any

from dagsync import bookkeeping
from dagsync.formats import Table
from dagsync.merge.core import SourceMerge
from dagsync.merge.chains import in_target, step_up

__all__ = ["SWAP", "apply", "choose", "families", "family", "plan", "starts", "taken"]

# A verdict in temp.ptr besides pointers' own: the heads diverged and the
# source's branch is newer: the row moves to the source's head, and the
# target's branch gets the fork.
SWAP = 4


def families(run: SourceMerge, table: Table) -> None:
    """``temp.fam``: every fork row either file knows of -> the conversation its family
    started from (the row it forked from, or that row's own original)."""
    if table.name != run.fmt.conversation_table:
        return
    c = run.conn
    key = table.natural_key[0]
    c.execute("CREATE TEMP TABLE fam (row TEXT PRIMARY KEY, original TEXT NOT NULL) WITHOUT ROWID")
    for schema in ("main", "src"):
        bound = f" AND rowid <= {run.bounds.get(table.name, 0)}" if schema == "src" else ""
        if "forked_from" in run.columns[table.name]:
            c.execute(
                f'INSERT OR IGNORE INTO temp.fam SELECT "{key}", "forked_from" FROM {schema}."{table.name}" '
                f'WHERE "forked_from" IS NOT NULL AND "forked_from" != "{key}"{bound}'
            )
        if bookkeeping.has(c, "_dagsync_forks", schema):
            c.execute(
                f"INSERT OR IGNORE INTO temp.fam SELECT fork_key, key FROM {schema}._dagsync_forks "
                "WHERE pointer_table = ? AND fork_key != key",
                (table.name,),
            )
    # A fork of a fork belongs to the first conversation's family (a few levels at most;
    # the bound stops a cycle a hand-made file might hold).
    for _ in range(64):
        c.execute(
            "UPDATE temp.fam SET original = (SELECT up.original FROM temp.fam up WHERE up.row = fam.original) "
            "WHERE original IN (SELECT row FROM temp.fam) AND original != row"
        )
        if not run.changes():
            break
    c.execute("CREATE INDEX temp.fam_original ON fam (original)")
    run.families = True


def family(value: str) -> str:
    """SQL for the family (the conversation a fork forked from, else itself) of conversation ``value``."""
    return f"coalesce((SELECT original FROM temp.fam WHERE row = {value}), {value})"


def choose(run: SourceMerge, table: Table, fork: int, fast_forward: int) -> None:
    """Turn each ``fork`` verdict whose source branch is the newer into ``SWAP``,
    and so each ``fast_forward`` of one of the row's forks (not of the row itself)."""
    if run.fmt.branch_time is None or table.name != run.fmt.conversation_table:
        return
    tbl, tip, time, scope = run.fmt.branch_time

    def latest(schema: str, head: str) -> str:
        within = f' AND "{scope}" = ptr.key' if scope else ""
        return (
            f"(SELECT coalesce(max(unixepoch(\"{time}\", 'subsec')), -1) FROM {schema}.\"{tbl}\" "
            f'WHERE "{tip}" = ptr.{head}{within})'
        )

    source = latest("src", "s_raw")
    if run.thin:
        # A thin source's tip may be a message merged before, with its time in the target.
        source = f"max({source}, {latest('main', 's_head')})"
    run.conn.execute(
        f"UPDATE temp.ptr SET verdict = {SWAP} WHERE (verdict = {fork} OR (verdict = {fast_forward} "
        f"AND row != key)) AND ({source}, s_head) > ({latest('main', 't_head')}, t_head)"
    )


def starts(run: SourceMerge, table: Table, fork: int) -> dict[str, str]:
    """Where each branch a fork will hold begins: for each ``fork`` or ``SWAP`` row
    of ``temp.ptr``, the message nearest the root on the forked branch's chain
    that the kept branch's chain does not hold (in the target's keys).

    A fork is keyed by it, not by the tip: a file that forked the branch at
    one turn and a file that forked it at a later one then hold the same
    fork row, which the later tip fast-forwards.
    """
    c = run.conn
    if not run.one(f"SELECT 1 FROM temp.ptr WHERE verdict IN ({fork}, {SWAP}) LIMIT 1"):
        return {}
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute("CREATE TEMP TABLE tchain (key TEXT NOT NULL, msg TEXT, d INTEGER NOT NULL)")
    c.execute(
        f"INSERT INTO temp.tchain WITH RECURSIVE up(k, cur, d) AS (SELECT key, t_head, 0 FROM temp.ptr "
        f"WHERE verdict IN ({fork}, {SWAP}) UNION SELECT up.k, m.{parent}, up.d + 1 FROM up "
        f"JOIN main.messages m ON m.{mkey} = up.cur WHERE {not_root}) SELECT k, cur, d FROM up WHERE cur IS NOT NULL"
    )
    c.execute("CREATE TEMP TABLE schain (key TEXT NOT NULL, msg TEXT, d INTEGER NOT NULL)")
    follow, above = step_up(run)
    c.execute(
        f"INSERT INTO temp.schain WITH RECURSIVE up(k, cur, d) AS (SELECT key, s_raw, 0 FROM temp.ptr "
        f"WHERE verdict IN ({fork}, {SWAP}) UNION SELECT up.k, {above}, up.d + 1 FROM up {follow}) "
        f"SELECT k, msg, d FROM (SELECT up.k, {in_target(run, 'up.cur')} AS msg, up.d FROM up) WHERE msg IS NOT NULL"
    )
    c.execute("CREATE INDEX temp.tchain_key ON tchain (key, msg)")
    c.execute("CREATE INDEX temp.schain_key ON schain (key, msg)")
    found = {}
    for forked, kept, verdict in (("schain", "tchain", fork), ("tchain", "schain", SWAP)):
        found.update(c.execute(
            f"SELECT p.key, (SELECT f.msg FROM temp.{forked} f WHERE f.key = p.key AND NOT EXISTS "
            f"(SELECT 1 FROM temp.{kept} k WHERE k.key = p.key AND k.msg = f.msg) ORDER BY f.d DESC LIMIT 1) "
            f"FROM temp.ptr p WHERE p.verdict = {verdict}"
        ).fetchall())  # fmt: skip
    return {k: v for k, v in found.items() if v is not None}


def taken(run: SourceMerge, table: Table, forks: list[tuple[str, str, str, bool]]) -> dict[str, tuple[str, Any]]:
    """Whether a row keyed ``fork_key`` is there already, for each fork
    (``original``, ``fork_key``, ``tip``, ``from_src``) of ``original`` that
    will hold the branch at ``tip`` (target keys; the source's branch if
    ``from_src``): ``original`` -> (``"free"`` (no such row), ``"behind"``
    (its head is on the branch's chain: the fork moves it on), ``"ahead"``
    (its chain holds the tip: nothing to add), else ``"other"`` (another
    branch, parted from this one after the start they share); that row's
    name). The target's row if it has one, else the source's. All forks in
    a few statements, not a few each. Call after ``starts``.
    """
    if not forks:
        return {}
    c = run.conn
    name, key, pointer = table.name, table.natural_key[0], table.pointer
    named = '"name"' if "name" in run.columns[name] else "NULL"
    mkey, parent, root = run.fmt.message_key, run.fmt.parent_column, run.fmt.root_id
    not_root = f"m.{mkey} != '{root}'" if root else "1"
    c.execute(
        "CREATE TEMP TABLE taking (original TEXT PRIMARY KEY, fork_key TEXT NOT NULL, tip TEXT, "
        "from_src INTEGER NOT NULL, found TEXT, head TEXT, name TEXT, held TEXT) WITHOUT ROWID"
    )
    c.execute(
        "INSERT INTO temp.taking (original, fork_key, tip, from_src) SELECT value ->> 0, value ->> 1, "
        "value ->> 2, value ->> 3 FROM json_each(?)",
        (json.dumps([[o, f, t, int(s)] for o, f, t, s in forks]),),
    )
    for schema, bound in (("main", ""), ("src", f" AND x.rowid <= {run.bounds.get(name, 0)}")):
        c.execute(
            f"UPDATE temp.taking SET found = ?, (head, name) = (SELECT x.\"{pointer}\", x.{named} "
            f'FROM {schema}."{name}" x WHERE x."{key}" = taking.fork_key{bound}) '
            f'WHERE found IS NULL AND EXISTS (SELECT 1 FROM {schema}."{name}" x WHERE x."{key}" = taking.fork_key{bound})',
            (schema,),
        )
    # Behind: the row's head is on the branch's chain (in the target's keys).
    for schema, held in (("main", "taking.head"), ("src", in_target(run, "taking.head"))):
        c.execute(
            f"UPDATE temp.taking SET held = 'behind' WHERE found = '{schema}' AND EXISTS (SELECT 1 FROM temp.schain "
            f"WHERE from_src AND key = taking.original AND msg = {held} UNION ALL SELECT 1 FROM temp.tchain "
            f"WHERE NOT from_src AND key = taking.original AND msg = {held})"
        )
    # Ahead: the row's chain holds the tip.
    follow, above = step_up(run)
    for schema, follow, above, here in (
        ("main", f"JOIN main.messages m ON m.{mkey} = up.cur WHERE {not_root}", f"m.{parent}", "up.cur"),
        ("src", follow, above, in_target(run, "up.cur")),
    ):
        c.execute(
            f"UPDATE temp.taking SET held = 'ahead' WHERE original IN (WITH RECURSIVE up(k, cur, tip) AS "
            f"(SELECT original, head, tip FROM temp.taking WHERE found = '{schema}' AND held IS NULL "
            f"UNION SELECT up.k, {above}, up.tip FROM up {follow}) SELECT k FROM up WHERE {here} = up.tip)"
        )
    rows = c.execute(
        "SELECT original, CASE WHEN found IS NULL THEN 'free' ELSE coalesce(held, 'other') END, name FROM temp.taking"
    ).fetchall()
    c.execute("DROP TABLE temp.taking")
    return {original: (held, row_name) for original, held, row_name in rows}


def plan(
    run: SourceMerge,
    table: Table,
    forks: list[tuple[str, str, str, bool, bool]],
    fast_forward: int,
    changing: str,
) -> None:
    """Where every call of each family the merge changes belongs.

    ``forks``: (conversation, fork key, head, whether the head is the
    source's, whether the fork row will point there: not if a row of that
    key is already further along the branch) for each fork the merge adds;
    ``fast_forward``: pointers' verdict for a row that moves on to the
    source's head;
    ``changing``: SQL true for the temp.ptr rows whose branches change (a
    fork added, or a fork moved on). Families a row arrives in change too.
    The others keep every branch where it is: their calls are compared
    through ``maps.differs``, which takes a call on another row of the same
    family for the same.
    """
    fmt = run.fmt
    if fmt.call_conversation is None or table.name != fmt.conversation_table:
        return
    c = run.conn
    name, key, pointer = table.name, table.natural_key[0], table.pointer
    c.execute("CREATE TEMP TABLE replan (key TEXT PRIMARY KEY) WITHOUT ROWID")
    c.execute(f"INSERT OR IGNORE INTO temp.replan SELECT {family('key')} FROM temp.ptr WHERE {changing}")
    # A fork the target lacks, of a conversation it has.
    c.execute(
        f'INSERT OR IGNORE INTO temp.replan SELECT f.original FROM temp.fam f JOIN src."{name}" s ON s."{key}" = f.row '
        f'WHERE s.rowid <= ? AND NOT EXISTS (SELECT 1 FROM main."{name}" t WHERE t."{key}" = f.row) '
        f'AND EXISTS (SELECT 1 FROM main."{name}" t WHERE t."{key}" = f.original)',
        (run.bounds.get(name, 0),),
    )
    if not run.one("SELECT 1 FROM temp.replan LIMIT 1"):
        return
    # Every row of each family, in either file, with its head after the merge.
    c.execute("CREATE TEMP TABLE members (key TEXT NOT NULL, row TEXT NOT NULL, PRIMARY KEY (row, key)) WITHOUT ROWID")
    c.execute("INSERT INTO temp.members SELECT key, key FROM temp.replan")
    c.execute("INSERT OR IGNORE INTO temp.members SELECT r.key, f.row FROM temp.replan r JOIN temp.fam f ON f.original = r.key")
    c.execute(f"INSERT OR IGNORE INTO temp.members SELECT {family('key')}, fork FROM temp.ptr WHERE fork IS NOT NULL")
    c.execute("CREATE TEMP TABLE heads (key TEXT NOT NULL, row TEXT NOT NULL, head TEXT, from_src INTEGER NOT NULL)")
    c.execute("CREATE INDEX temp.heads_row ON heads (row)")
    # A row the target has: where the merge moves it (itself, a swap, or a fork of it
    # fast-forwarded: temp.moves), else where it is.
    c.execute("CREATE TEMP TABLE moves (row TEXT PRIMARY KEY, head TEXT) WITHOUT ROWID")
    c.execute(
        f"INSERT OR IGNORE INTO temp.moves SELECT key, s_raw FROM temp.ptr "
        f"WHERE verdict = {SWAP} OR (verdict = {fast_forward} AND row = key)"
    )
    c.execute(f"INSERT OR IGNORE INTO temp.moves SELECT row, s_raw FROM temp.ptr WHERE verdict = {fast_forward}")
    c.execute(
        f'INSERT INTO temp.heads SELECT m.key, m.row, coalesce(v.head, t."{pointer}"), v.row IS NOT NULL '
        f'FROM temp.members m JOIN main."{name}" t ON t."{key}" = m.row LEFT JOIN temp.moves v ON v.row = m.row'
    )
    # A row arriving from the source: where the source has it.
    c.execute(
        f'INSERT INTO temp.heads SELECT m.key, m.row, s."{pointer}", 1 FROM temp.members m '
        f'JOIN src."{name}" s ON s."{key}" = m.row WHERE s.rowid <= ? '
        f'AND NOT EXISTS (SELECT 1 FROM main."{name}" t WHERE t."{key}" = m.row)',
        (run.bounds.get(name, 0),),
    )
    # The fork rows this merge adds: a row of that key behind on the branch (copied
    # from the source first, or the target's) is the same row, moved on; one further
    # along keeps its head.
    c.execute(
        "DELETE FROM temp.heads WHERE row IN (SELECT value FROM json_each(?))",
        (json.dumps([f for _, f, _, _, replace in forks if replace]),),
    )
    c.execute(
        f"INSERT INTO temp.heads SELECT {family('j.value ->> 0')}, j.value ->> 1, j.value ->> 2, j.value ->> 3 "
        "FROM json_each(?) j WHERE NOT EXISTS (SELECT 1 FROM temp.heads WHERE row = j.value ->> 1)",
        (json.dumps([[k, f, h, int(s)] for k, f, h, s, _ in forks]),),
    )
    _chains(run)
    # Each call, in either file, of a conversation in these families: to the row whose chain holds its tip.
    call_key = fmt.table(fmt.call_table).natural_key[0]
    conv, tip, calls = fmt.call_conversation, fmt.call_tip, fmt.call_table

    def placed(schema: str, tip_sql: str) -> str:
        return (
            f'SELECT call, conv FROM (SELECT x."{call_key}" AS call, x."{conv}" AS old, '
            f"(SELECT b.row FROM temp.bchain b JOIN temp.depth d ON d.key = b.key AND d.row = b.row "
            f"WHERE b.key = m.key AND b.msg = {tip_sql} ORDER BY b.row != b.key, d.n, b.row LIMIT 1) AS conv "
            # CROSS JOIN: the few members first, then their calls by index (a temp
            # table has no statistics; SQLite would scan every call).
            f'FROM temp.members m CROSS JOIN {schema}."{calls}" x ON x."{conv}" = m.row) '
            "WHERE conv IS NOT NULL AND conv IS NOT old"
        )

    c.execute("CREATE TEMP TABLE branch (call TEXT PRIMARY KEY, conv TEXT NOT NULL) WITHOUT ROWID")
    source_tip = f'(SELECT dst FROM temp.msg_map WHERE src = x."{tip}")'
    c.execute(f"INSERT OR IGNORE INTO temp.branch {placed('src', source_tip)}")
    c.execute("CREATE TEMP TABLE tmove (call TEXT PRIMARY KEY, conv TEXT NOT NULL) WITHOUT ROWID")
    target_tip = f'x."{tip}"'
    c.execute(f"INSERT OR IGNORE INTO temp.tmove {placed('main', target_tip)}")
    run.counts[calls].moved = run.one("SELECT count(*) FROM temp.tmove")
    run.branches = True


def _chains(run: SourceMerge) -> None:
    """``temp.bchain``: every message on each head's chain, in the target's keys;
    ``temp.depth``: how many messages each chain holds."""
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
    follow, above = step_up(run)
    c.execute(
        f"INSERT INTO temp.bchain WITH RECURSIVE up(key, row, cur) AS ("
        f"SELECT key, row, head FROM temp.heads WHERE from_src AND head IS NOT NULL "
        f"UNION SELECT up.key, up.row, {above} FROM up {follow}) "
        f"SELECT key, row, msg FROM (SELECT up.key, up.row, {in_target(run, 'up.cur')} AS msg FROM up) WHERE msg IS NOT NULL"
    )
    c.execute("CREATE INDEX temp.bchain_key ON bchain (key, msg)")
    c.execute("CREATE TEMP TABLE depth (key TEXT NOT NULL, row TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (key, row))")
    c.execute("INSERT INTO temp.depth SELECT key, row, count(DISTINCT msg) FROM temp.bchain GROUP BY key, row")


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
